"""Sharded model == single-device model on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from sparserl_jax.models import Transformer
from sparserl_jax.parallel import (
    MeshConfig,
    batch_sharding,
    create_sharded,
    logical_to_spec,
    make_mesh,
)
from sparserl_jax.testing import tiny_model_config


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh_cfg",
    [MeshConfig(data=1, fsdp=4, tensor=2), MeshConfig(data=2, fsdp=2, tensor=2)],
    ids=["fsdp4_tp2", "dp2_fsdp2_tp2"],
)
@pytest.mark.parametrize("tied", [False, True])
def test_sharded_logits_equal_single_device(mesh_cfg, tied):
    assert jax.device_count() == 8
    # 4 kv heads so the tensor axis really splits kv heads too.
    cfg = tiny_model_config(num_kv_heads=4, tie_embeddings=tied, vocab_size=68)
    tokens = jax.random.randint(jax.random.key(3), (4, 11), 0, cfg.vocab_size)
    # Init under jit in both cases (eager and jitted RNG arithmetic may round differently).
    one_device = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    single = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(7)), one_device)
    expected = np.asarray(jax.jit(lambda t: single(t))(tokens))

    mesh = make_mesh(mesh_cfg)
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(7)), mesh)
    q = model.layers[0].attn.q_proj[...]
    assert len(q.sharding.device_set) == 8
    assert q.sharding.spec == PartitionSpec("fsdp", "tensor", None)  # 12-wide heads: [D, N, H]
    # Same initial weights bit for bit, whichever layout they were created in.
    np.testing.assert_array_equal(np.asarray(q), np.asarray(single.layers[0].attn.q_proj[...]))

    tokens_sharded = jax.device_put(tokens, batch_sharding(mesh))
    got = jax.jit(lambda t: model(t))(tokens_sharded)
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)


def test_rules_drop_non_dividing_axes():
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    assert logical_to_spec(("embed", "mlp"), (48, 88), mesh) == PartitionSpec("fsdp", "tensor")
    # 2 kv heads over tensor=2 divide; 3 would not and is replicated.
    assert logical_to_spec(("kv_heads",), (3,), mesh) == PartitionSpec(None)
    assert logical_to_spec(("batch", "length"), (8, 5), mesh) == PartitionSpec("fsdp", None)
    with pytest.raises(KeyError, match="no rule"):
        logical_to_spec(("bogus",), (4,), mesh)


def test_mesh_config_errors():
    with pytest.raises(ValueError, match="at most one"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="cannot be split"):
        MeshConfig(data=3, fsdp=-1).shape(8)
    assert MeshConfig(data=2, fsdp=-1, tensor=2).shape(8) == (2, 2, 2)
    assert make_mesh(MeshConfig(), devices=jax.devices()[:1]).shape == {
        "data": 1,
        "fsdp": 1,
        "tensor": 1,
    }


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [12, 128])
def test_decode_matches_forward_fp32(head_dim):
    """Token-by-token decoding through the dense cache equals teacher forcing (fp32, 1e-5);
    with 128-wide heads the fused q/k/v weights are one matmul in decode and an einsum on their
    per-head view in teacher forcing."""
    from sparserl_jax.models import DenseKVCache

    cfg = tiny_model_config(qk_norm=True, family="qwen3", qkv_bias=False, head_dim=head_dim)
    assert cfg.fused_heads == (head_dim == 128)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(0), (3, 13), 0, cfg.vocab_size)
    expected = model(tokens)
    # Rows with different prompt lengths: prefill a left-aligned, padded block, then step.
    lengths = jnp.array([5, 3, 7])
    cache = DenseKVCache.create(
        num_layers=cfg.num_layers, batch=3, max_len=16, num_kv_heads=2, head_dim=head_dim
    )
    mask = jnp.arange(7)[None, :] < lengths[:, None]
    logits, cache = model.decode(tokens[:, :7], cache, mask)
    for b in range(3):
        n = int(lengths[b])
        np.testing.assert_allclose(logits[b, :n], expected[b, :n], atol=1e-5, rtol=0)
    step = jax.jit(lambda tok, c: model.decode(tok, c))
    pos = lengths
    for _ in range(5):
        tok = jnp.take_along_axis(tokens, pos[:, None], axis=1)
        logits, cache = step(tok, cache)
        want = jnp.take_along_axis(expected, pos[:, None, None], axis=1)
        np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
        pos = pos + 1


def test_fused_head_projections_shard_by_whole_heads():
    # 128-wide heads: q_proj is [D, N * H]. 6 heads over tensor 4 would split heads (768
    # columns divide by 4, 6 heads do not), so it stays replicated over tensor; so do 2 KV
    # heads (256 columns). Over tensor 2 both split, 3 and 1 heads per device.
    cfg = tiny_model_config(num_heads=6, num_kv_heads=2, head_dim=128)
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    attn = model.layers[0].attn
    assert cfg.fused_heads and attn.q_proj[...].shape == (cfg.hidden_size, 768)
    assert attn.q_proj[...].sharding.spec == PartitionSpec("fsdp", None)
    assert attn.k_proj[...].sharding.spec == PartitionSpec("fsdp", None)
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    attn = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh).layers[0].attn
    assert attn.q_proj[...].sharding.spec == PartitionSpec("fsdp", "tensor")
    assert attn.k_proj[...].sharding.spec == PartitionSpec("fsdp", "tensor")
