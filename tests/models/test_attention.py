"""Teacher-forcing attention (`models.attention`): every CPU-runnable implementation equals the
dense reference (`layers.gqa_attention` under the hand-built causal x segment mask), values and
gradients; the model's logits do not depend on the choice; the chunked path builds no `[T, T]`
array; dispatch picks per backend and falls back with one log line."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sparserl_jax.models import ModelConfig
from sparserl_jax.models.attention import causal_attention, resolve_attention, with_attention_mesh
from sparserl_jax.models.layers import gqa_attention
from sparserl_jax.parallel import MeshConfig, make_mesh
from sparserl_jax.testing.fixtures import tiny_model

# Per-dtype tolerances on outputs / gradients of O(1) magnitude. bf16 results carry 8
# significant bits and the two paths round different intermediates (the reference rounds the
# normalised probabilities, the online softmax the unnormalised ones): they differ by an ulp or
# two. In bf16 each path is also compared with the fp32 computation on the same operands: its
# largest error may be at most `accuracy` times the reference's. Splash's backward rounds dS
# and the saved output to bf16 before its matmuls (the chunked path keeps dS in fp32), which
# doubles the error of dq and dk at bf16 (2x measured; it matches to 2e-5 in fp32, so the
# wrapper is exact): its bf16 test bounds the error against fp32 only, at 2.5x the reference's.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _reference(q, k, v, seg):
    t = q.shape[1]
    causal = np.tril(np.ones((t, t), bool))[None]
    seg = np.asarray(seg)
    mask = causal & (seg[:, :, None] == seg[:, None, :])
    return gqa_attention(q, k, v, jnp.asarray(mask))


def _operands(b, t, kv_heads, groups, h, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, kv_heads * groups, h)) * 0.5
    k = rng.normal(size=(b, t, kv_heads, h))
    v = rng.normal(size=(b, t, kv_heads, h))
    # Packed rows: segments 1, 2, 3 of uneven lengths, then padding (segment 0) at the end of
    # row 0; row 1 is one segment then padding.
    seg = np.zeros((b, t), np.int32)
    cuts = [0, t // 5, t // 5 + 3, (3 * t) // 4, t]
    for s in range(3):
        seg[0, cuts[s] : cuts[s + 1]] = s + 1
    seg[1:, : t - 4] = 7
    cot = rng.normal(size=(b, t, kv_heads * groups, h))
    return (*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(seg), jnp.asarray(cot))


def _values_and_grads(fn, q, k, v, cot):
    out, vjp = jax.vjp(fn, q, k, v)
    return out.astype(jnp.float32), vjp(cot.astype(out.dtype))


def _assert_matches(
    impl, *, t, groups, dtype, blocks, segmented=True, b=2, kv_heads=2, h=16, accuracy=1.5
):
    q, k, v, seg, cot = _operands(b, t, kv_heads, groups, h, dtype)
    seg_or_none = seg if segmented else None
    ref_seg = seg if segmented else jnp.zeros_like(seg)

    def got_fn(q, k, v):
        return causal_attention(
            q, k, v, seg_or_none, impl=impl, block_q=blocks[0], block_kv=blocks[1]
        )

    def ref_fn(q, k, v):
        return _reference(q, k, v, ref_seg).astype(q.dtype)

    got, got_g = _values_and_grads(got_fn, q, k, v, cot)
    ref, ref_g = _values_and_grads(ref_fn, q, k, v, cot)
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=tol, rtol=tol)
    for name, a, r in zip("qkv", got_g, ref_g, strict=True):
        assert a.dtype == r.dtype == dtype, name
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        assert np.all(np.isfinite(a)), f"d{name} not finite"
        if accuracy <= 1.5:
            np.testing.assert_allclose(a, r, atol=tol, rtol=tol, err_msg=f"d{name}")
    if dtype != jnp.float32:
        wide = tuple(x.astype(jnp.float32) for x in (q, k, v))
        truth, truth_g = _values_and_grads(lambda *a: _reference(*a, ref_seg), *wide, cot)
        for name, a, r, x in zip("o", [got], [ref], [truth], strict=True):
            _assert_as_accurate(name, a, r, x, accuracy)
        for name, a, r, x in zip("qkv", got_g, ref_g, truth_g, strict=True):
            _assert_as_accurate(f"d{name}", a, r, x, accuracy)


def _assert_as_accurate(name, got, ref, truth, factor):
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - truth)))
    ref_err = float(jnp.max(jnp.abs(ref.astype(jnp.float32) - truth)))
    assert err <= factor * ref_err + 1e-6, f"{name}: error {err}, the reference's {ref_err}"


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_equals_dense(groups, dtype):
    # T = 37 is no multiple of either block; blocks smaller than the segments, so rows meet
    # key blocks where nothing is visible yet (the running max stays -inf there).
    _assert_matches("chunked", t=37, groups=groups, dtype=dtype, blocks=(8, 16))


@pytest.mark.parametrize("blocks", [(16, 8), (5, 7), (64, 64)])
def test_chunked_block_shapes(blocks):
    # kv blocks smaller than q blocks, coprime blocks (lcm padding), one block wider than T.
    _assert_matches("chunked", t=29, groups=2, dtype=jnp.float32, blocks=blocks)


def test_chunked_without_segments_and_short_rows():
    _assert_matches("chunked", t=23, groups=2, dtype=jnp.float32, blocks=(8, 8), segmented=False)
    _assert_matches("chunked", t=1, groups=2, dtype=jnp.float32, blocks=(8, 8), b=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "groups, dtype, accuracy",
    [(1, jnp.float32, 1.5), (4, jnp.float32, 1.5), (2, jnp.bfloat16, 2.5)],
)
def test_splash_interpret_equals_dense(groups, dtype, accuracy):
    # Pallas TPU splash attention in interpret mode on CPU; T = 200 pads to 256 (two 128 blocks).
    _assert_matches(
        "splash", t=200, groups=groups, dtype=dtype, blocks=(128, 128), accuracy=accuracy
    )


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, list | tuple) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _walk(inner)


def _square_arrays(fn, t, *args):
    """Shapes of every value `fn` computes that has two axes of length t."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    found = set()
    for eqn in _walk(jaxpr):
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            if sum(d == t for d in shape) >= 2:
                found.add(tuple(shape))
    return found


def test_hidden_states_builds_no_t_by_t_array():
    t = 61
    tokens = jax.random.randint(jax.random.key(0), (2, t), 0, 67)
    seg = jnp.asarray(np.repeat([[1] * 30 + [2] * 31], 2, axis=0))

    def loss_fn(attention):
        model = tiny_model(attention=attention, attention_block=16)
        graphdef, params = nnx.split(model)

        def loss(p):
            h = nnx.merge(graphdef, p).hidden_states(tokens, segment_ids_bt=seg)
            return jnp.sum(h.astype(jnp.float32) ** 2)

        return jax.value_and_grad(loss), params

    fn, params = loss_fn("chunked")
    assert _square_arrays(fn, t, params) == set()
    fn, params = loss_fn("dense")  # the check can fail: the reference builds them
    assert (2, t, t) in _square_arrays(fn, t, params)


@pytest.mark.parametrize("remat", [False, True])
def test_model_logits_and_grads_equal_dense(remat):
    tokens = jax.random.randint(jax.random.key(1), (2, 21), 0, 67)
    seg = jnp.asarray([[1] * 9 + [2] * 12, [5] * 17 + [0] * 4])
    out = {}
    for attention in ("dense", "chunked"):
        model = tiny_model(attention=attention, attention_block=8, remat=remat)
        graphdef, params = nnx.split(model)

        def loss(p, graphdef=graphdef):
            logits = nnx.merge(graphdef, p)(tokens, segment_ids=seg)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 3]), logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        out[attention] = (logits, grads)
    np.testing.assert_allclose(out["chunked"][0], out["dense"][0], atol=2e-5, rtol=2e-5)
    for a, r in zip(
        jax.tree.leaves(out["chunked"][1]), jax.tree.leaves(out["dense"][1]), strict=True
    ):
        np.testing.assert_allclose(a, r, atol=2e-5, rtol=1e-4)


def test_dispatch_per_backend(caplog, monkeypatch):
    monkeypatch.delenv("SPARSERL_KERNEL_IMPL", raising=False)
    bf16 = jnp.bfloat16
    assert resolve_attention("auto", bf16, 64, segmented=True, platform="cpu") == "chunked"
    assert resolve_attention("auto", bf16, 64, segmented=True, platform="tpu") == "splash"
    assert resolve_attention("splash", bf16, 64, segmented=True, platform="cpu") == "splash"
    assert resolve_attention("dense", bf16, 64, segmented=True, platform="tpu") == "dense"
    # cuDNN takes bf16 without segments; fp32, packed rows, odd head dims or a CPU fall back.
    with caplog.at_level(logging.INFO, logger="sparserl_jax.attention"):
        assert resolve_attention("cudnn", bf16, 64, segmented=True, platform="gpu") == "chunked"
        assert resolve_attention("cudnn", bf16, 64, segmented=True, platform="gpu") == "chunked"
        assert resolve_attention("auto", jnp.float32, 64, segmented=False, platform="gpu") == (
            "chunked"
        )
        assert resolve_attention("cudnn", bf16, 60, segmented=False, platform="gpu") == "chunked"
        assert resolve_attention("cudnn", bf16, 64, segmented=False, platform="cpu") == "chunked"
        assert resolve_attention("splash", jnp.float16, 64, segmented=False, platform="tpu") == (
            "chunked"
        )
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, lines  # one line per (kernel, reason): the repeat is not logged
    assert "packed segment ids" in lines[0] and "using chunked" in lines[0]
    # A warning only for the platform this (CPU) host runs; other platforms' choices: info.
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO] * 3 + [logging.WARNING, logging.INFO], levels
    monkeypatch.setenv("SPARSERL_KERNEL_IMPL", "xla")
    assert resolve_attention("auto", bf16, 64, segmented=True, platform="tpu") == "chunked"
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        resolve_attention("flash", bf16, 64, segmented=True)


def test_config_rejects_bad_attention():
    base = dict(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="attention 'flash' unknown"):
        ModelConfig(**base, intermediate_size=8, attention="flash")
    with pytest.raises(ValueError, match="attention_block must be a positive int"):
        ModelConfig(**base, intermediate_size=8, attention_block=0)


@pytest.mark.slow
def test_splash_on_a_mesh_runs_per_device_and_matches():
    # Traced under a mesh (as the learner's step is), splash runs under shard_map: rows over
    # fsdp, KV heads over tensor; values and gradients equal the single-device call.
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4])
    q, k, v, seg, cot = _operands(2, 128, 2, 2, 16, jnp.float32, seed=3)

    def loss(q, k, v):
        out = causal_attention(q, k, v, seg, impl="splash", block_q=128, block_kv=128)
        return jnp.sum(out * cot)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    sharded = jax.jit(with_attention_mesh(mesh, grad), in_shardings=(rows, rows, rows))
    assert "shard_map" in str(jax.make_jaxpr(with_attention_mesh(mesh, grad))(q, k, v))
    got = sharded(q, k, v)
    for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(grad(q, k, v)), strict=True):
        np.testing.assert_allclose(a, r, atol=2e-5, rtol=2e-5)
