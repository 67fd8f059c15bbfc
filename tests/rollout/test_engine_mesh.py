"""The rollout engine on a mesh of 8 CPU devices equals the engine on one device.

Meshes data 2 x tensor 4, data 4 x tensor 2 and tensor 8 (a model of 8 query / 4 KV heads, MLP 96
and vocabulary 64, so heads, MLP columns and vocabulary split over `tensor`; with tensor 8 the 4
KV heads are replicated). Each data shard holds its own slots, pages and free-page stack
(`rollout.shards`). For every policy and granularity (each granularity on one mesh, every
policy on every mesh): tokens identical to one device's for greedy and for sampled decoding with
the same keys, sampler logprobs within 1e-5 (fp32: tensor-parallel matmuls reduce in another
order), eviction counts identical; eviction records identical; the engine contract on a mesh
(sampler logprobs vs teacher-forced dense logprobs) holds.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from sparserl_jax.kvcache import CompressionConfig
from sparserl_jax.parallel.sharding import MeshConfig, make_mesh, shard_model
from sparserl_jax.rollout import RolloutConfig, RolloutEngine, dense_logprobs
from sparserl_jax.rollout.shards import weight_specs
from sparserl_jax.testing import tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [1], [2, 3, 4, 5, 6], [7, 7, 7], [8], [3, 3]]
MODEL = dict(num_heads=8, num_kv_heads=4, intermediate_size=96, vocab_size=64)
MODEL_LAYERS = 2
# (data, fsdp, tensor): over fsdp the shards also split the weights (gathered as each runs).
MESHES = {
    "d2t4": (2, 1, 4),
    "d4t2": (4, 1, 2),
    "t8": (1, 1, 8),
    "f2t4": (1, 2, 4),
    "d2f2t2": (2, 2, 2),
}
GRANULARITY = {"d2t4": "sequence", "d4t2": "layer", "t8": "head", "f2t4": "head", "d2f2t2": "layer"}


def config(policy: str, granularity: str, temperature: float, **kw) -> RolloutConfig:
    kv = None
    if policy != "none":
        kv = CompressionConfig(
            policy=policy,
            budget=8,
            window=2,
            interval=2,
            sink_tokens=2,
            granularity=granularity,
        )
    base = dict(
        num_slots=8,
        max_prompt_len=6,
        max_new_tokens=24,
        temperature=temperature,
        chunk_steps=8,
        n_samples=2,
        page_size=4,
        kv=kv,
        stop_token_ids=(17, 23, 31, 40, 45),  # ragged lengths: shards go idle apart
    )
    return RolloutConfig(**(base | kw))


def mesh_of(name: str):
    data, fsdp, tensor = MESHES[name]
    n = data * fsdp * tensor
    return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[:n])


def run(cfg: RolloutConfig, mesh=None):
    model = tiny_model(seed=3, **MODEL)
    if mesh is not None:
        model = shard_model(model, mesh)
        cfg = dataclasses.replace(cfg, fsdp_shards=mesh.shape["fsdp"] > 1)
    return RolloutEngine(model, cfg, mesh=mesh).generate(PROMPTS, seeds=list(range(8)))


def assert_same(got, want) -> None:
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_array_equal(got.completion_lens, want.completion_lens)
    np.testing.assert_array_equal(got.tokens_evicted, want.tokens_evicted)
    mask = want.completion_mask
    np.testing.assert_allclose(
        got.sampler_logprobs[mask], want.sampler_logprobs[mask], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("policy", ["none", "streaming", "snapkv", "h2o", "rkv"])
def test_sampled_tokens_equal_one_device(mesh, policy):
    cfg = config(policy, GRANULARITY[mesh], 1.0)
    want = run(cfg)
    if policy != "none":
        assert want.tokens_evicted.sum() > 0  # the budget binds: eviction is exercised
    assert_same(run(cfg, mesh_of(mesh)), want)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_greedy_tokens_equal_one_device(mesh):
    cfg = config("rkv", "head", 0.0)
    assert_same(run(cfg, mesh_of(mesh)), run(cfg))


def test_eviction_records_equal_one_device():
    cfg = config("rkv", "head", 1.0, record_evictions=True)
    want, got = run(cfg), run(cfg, mesh_of("d2t4"))
    assert_same(got, want)
    np.testing.assert_array_equal(got.evict_pos, want.evict_pos)


def test_engine_contract_on_a_mesh():
    # Dense, T = 1: the sampler's logprobs are the teacher-forced policy's.
    mesh = mesh_of("d2t4")
    model = shard_model(tiny_model(seed=3, **MODEL), mesh)
    res = RolloutEngine(model, config("none", "sequence", 1.0), mesh=mesh).generate(PROMPTS)
    tokens_bt, mask_bt, sampler_bt = res.sequences()
    dense_bt = np.asarray(dense_logprobs(tiny_model(seed=3, **MODEL), None, tokens_bt))
    np.testing.assert_allclose(sampler_bt[mask_bt], dense_bt[mask_bt], atol=1e-5, rtol=0)


def test_each_data_shard_holds_its_own_pages():
    mesh = mesh_of("d2t4")
    cfg = config("rkv", "head", 1.0)
    engine = RolloutEngine(shard_model(tiny_model(seed=3, **MODEL), mesh), cfg, mesh=mesh)
    cache, _ = engine._init()
    # [D, layers, P / D, page, K * H]: pages split over data, the 4 KV heads over tensor 4.
    assert cache.k_pages.shape[:3] == (2, 2, cfg.pool_pages // 2)
    assert tuple(cache.k_pages.sharding.spec)[:5] == ("data", None, None, None, "tensor")
    shard = cache.k_pages.addressable_shards[0].data
    assert shard.shape == (1, 2, cfg.pool_pages // 2, 4, 12)  # one shard, one KV head
    # Each shard's free stack holds only its own page ids.
    assert np.asarray(cache.free_stack).max() == cfg.pool_pages // 2 - 1


def test_fsdp_shards_hold_a_part_of_the_weights_and_never_gather_them():
    # With rollout.fsdp_shards, over fsdp 2 each shard holds its own slots and pages, as over
    # data, and half of every weight's hidden dim (as the trainer lays them out); the decode
    # chunk moves rows instead of weights: per layer 7 all-to-alls, 5 reduce-scatters, and no
    # all-gather of anything as wide as the hidden dim.
    mesh = mesh_of("f2t4")
    model = shard_model(tiny_model(seed=3, **MODEL), mesh)
    cfg = config("rkv", "head", 1.0, fsdp_shards=True)
    assert RolloutEngine(model, config("rkv", "head", 1.0), mesh=mesh).data == 1  # opt-in
    engine = RolloutEngine(model, cfg, mesh=mesh)
    assert engine.data == 2
    specs = weight_specs(nnx.state(model), mesh, fsdp=True)
    assert specs["layers"][0]["attn"]["q_proj"] == PartitionSpec("fsdp", "tensor", None)
    assert specs["layers"][0]["mlp"]["down_proj"] == PartitionSpec("tensor", "fsdp")
    assert specs["embed"]["embedding"] == PartitionSpec("tensor", "fsdp")
    assert weight_specs(nnx.state(model), mesh_of("d2t4"), fsdp=True) is None  # over data
    cache, slots = engine._init()
    assert cache.k_pages.shape[:3] == (2, 2, engine.config.pool_pages // 2)
    hlo = engine._chunk.lower(engine.default_params, cache, slots).compile().as_text()
    assert len(re.findall(r"all-to-all(-start)?\(", hlo)) >= MODEL_LAYERS * 7
    assert len(re.findall(r"reduce-scatter(-start)?\(", hlo)) >= MODEL_LAYERS * 5
    gathered = re.findall(r"= f32\[([0-9,]*)\]\S* all-gather", hlo)
    assert gathered and all(48 not in map(int, dims.split(",")) for dims in gathered)


def test_slots_that_do_not_divide_over_data_are_refused():
    mesh = mesh_of("d4t2")
    model = tiny_model(seed=3, **MODEL)
    with pytest.raises(ValueError, match="must divide over the mesh's data axis"):
        RolloutEngine(model, config("none", "sequence", 1.0, num_slots=6), mesh=mesh)


def test_kernels_per_shard_equal_one_device(monkeypatch):
    # The three Pallas kernels (TPU kernels in interpret mode) run per device inside each data
    # shard (`_dispatch.on_mesh`, nested in the engine's shard_map over data), KV heads split
    # over tensor 2; against the XLA path on one device.
    cfg = config("h2o", "head", 1.0)
    want = run(cfg)
    monkeypatch.setenv("SPARSERL_KERNEL_IMPL", "pallas_tpu")
    assert_same(run(cfg, mesh_of("d4t2")), want)
