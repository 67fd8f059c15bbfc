"""Whole programs compile for a TPU from a CPU host: the rollout engine's decode chunk with R-KV,
the learner step (splash attention, or the chunked XLA path) and a packed forward + backward, at
a small model whose heads tile the TPU's lanes (2 KV heads of dim 64, as in Qwen2.5-0.5B), so
the programs hold the Mosaic kernels. Abstract inputs only (`benchmarks.tpu_aot`); the
Qwen2.5-0.5B figures are `tools/bench_tpu_aot.py`'s (too slow here). Skipped without libtpu,
failing instead when `SPARSERL_REQUIRE_TPU_AOT` is set (`make test-tpu-aot`), like
tests/kernels/test_tpu_aot.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from benchmarks import tpu_aot
from sparserl_jax.models import Transformer, model_preset
from sparserl_jax.parallel.sharding import MeshConfig
from sparserl_jax.rl.config import LearnerConfig
from sparserl_jax.testing import tpu

pytestmark = pytest.mark.slow

SMALL = model_preset("tpu-lanes-small", dtype="bfloat16", param_dtype="bfloat16", remat=True)


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    with tpu.no_persistent_cache():
        yield


@pytest.fixture(scope="module")
def v5p():
    return list(tpu.topology("v5p:2x2x1").devices)


def _check(result: dict, *, mosaic: bool | None = None):
    assert result["ok"], result.get("error")
    assert result["flops"] > 0 and result["temp_bytes"] >= 0
    if mosaic is not None:
        assert result["mosaic"] is mosaic


@pytest.mark.parametrize("name", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_rkv_engine_compiles_on_one_chip(name):
    rc = tpu_aot.engine_config("rkv", slots=8, prompt=32, new=96, page=16, budget=32)
    got = tpu_aot.engine_programs(SMALL, rc, list(tpu.topology(name).devices)[:1])
    _check(got["prefill"])
    _check(got["decode_chunk"], mosaic=True)
    _check_engine_kernels(got["decode_chunk"])


def _check_engine_kernels(chunk: dict) -> None:
    """All three kernels in the R-KV decode chunk: attention once per layer, window scoring and
    compaction (K and V apart) in the compression's loop over layers (one call in its body)."""
    calls = chunk["mosaic_calls"]
    assert calls.get("paged_decode_attention_tpu", 0) >= SMALL.num_layers, calls
    assert calls.get("window_scores_tpu", 0) >= 1, calls
    assert calls.get("compact_pages_tpu", 0) >= 2, calls


def test_rkv_engine_compiles_on_a_4_chip_v5p_mesh(v5p):
    # Mosaic calls cannot be partitioned by XLA: the kernels run per chip under shard_map (2 KV
    # heads do not divide over 4 chips, so replicated; tests/kernels/test_cache_on_kernels.py
    # checks the numerics of both layouts in interpret mode).
    rc = tpu_aot.engine_config("rkv", slots=8, prompt=32, new=96, page=16, budget=32)
    got = tpu_aot.engine_programs(SMALL, rc, v5p[:4])
    _check(got["prefill"])
    _check(got["decode_chunk"], mosaic=True)
    _check_engine_kernels(got["decode_chunk"])


@pytest.mark.parametrize("data, tensor", [(2, 2), (4, 1)])
def test_rkv_engine_compiles_on_a_4_chip_v5e_mesh_per_data_shard(data, tensor):
    # Each data shard its own slots and pages (`rollout.shards`: shard_map over data), the
    # kernels per chip inside it (nested over the other axes), the 2 KV heads over tensor 2.
    rc = tpu_aot.engine_config("rkv", slots=8, prompt=32, new=96, page=16, budget=32)
    mesh_cfg = MeshConfig(data=data, fsdp=1, tensor=tensor)
    devices = list(tpu.topology("v5e:2x2").devices)
    got = tpu_aot.engine_programs(SMALL, rc, devices, mesh_cfg)
    _check(got["prefill"])
    _check(got["decode_chunk"], mosaic=True)
    _check_engine_kernels(got["decode_chunk"])


@pytest.mark.parametrize("chips", [1, 4])
def test_learner_step_compiles_for_v5p(v5p, chips):
    # Teacher forcing runs splash attention (auto on TPU): a Mosaic call, per chip under
    # shard_map on the mesh (the learner traces under it), T = 64 padded to one 128 block.
    lcfg = LearnerConfig(num_micro_batches=2)
    got = tpu_aot.learner_program(SMALL, lcfg, v5p[:chips], batch=8, seq_len=64)
    _check(got, mosaic=True)


@pytest.mark.parametrize("name", ["v5e:2x2", "v6e:2x2"])
def test_learner_step_compiles_for_v5e_and_v6e(name):
    lcfg = LearnerConfig(num_micro_batches=2)
    devices = list(tpu.topology(name).devices)[:1]
    _check(tpu_aot.learner_program(SMALL, lcfg, devices, batch=8, seq_len=64), mosaic=True)


def test_learner_step_compiles_with_chunked_attention(v5p):
    lcfg = LearnerConfig(num_micro_batches=2)
    cfg = SMALL.replace(attention="chunked", attention_block=32)
    got = tpu_aot.learner_program(cfg, lcfg, v5p[:1], batch=8, seq_len=80)
    _check(got, mosaic=False)  # online softmax in XLA, no kernel


@pytest.mark.parametrize("chips", [1, 2])
def test_replay_step_and_loss_grad_compile_for_v5p(v5p, chips):
    # Eviction replay: the sampler's record per layer and KV head, on the chunked XLA path
    # (`auto` picks it: splash cannot take the mask), one chip and fsdp over two.
    lcfg = LearnerConfig(num_micro_batches=2, attention_mask="replay")
    got = tpu_aot.learner_program(SMALL, lcfg, v5p[:chips], batch=8, seq_len=64)
    _check(got, mosaic=False)
    _check(tpu_aot.loss_grad_program(SMALL, lcfg, v5p[:chips], batch=2, seq_len=64), mosaic=False)


@pytest.mark.parametrize("attention, mosaic", [("splash", True), ("chunked", False)])
def test_packed_forward_backward_compiles_for_v5p(v5p, attention, mosaic):
    # Packed segments (splash's segment ids) and T = 300, no multiple of the 128-lane blocks.
    cfg = SMALL.replace(param_dtype="float32", attention=attention, attention_block=128)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    one = SingleDeviceSharding(v5p[0])
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), nnx.to_pure_dict(state)
    )
    ints = jax.ShapeDtypeStruct((2, 300), jnp.int32, sharding=one)

    def loss(p, tokens_bt, segment_ids_bt):
        logits = nnx.merge(graphdef, p)(tokens_bt, segment_ids=segment_ids_bt)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    got = tpu_aot.compile_program(v5p[0], jax.jit(jax.value_and_grad(loss)), params, ints, ints)
    _check(got, mosaic=mosaic)
