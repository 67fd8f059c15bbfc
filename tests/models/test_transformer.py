"""Model properties: packing, causality, remat, compute dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.models import Transformer
from sparserl_jax.testing import tiny_model, tiny_model_config


@pytest.mark.slow
def test_packed_segments_equal_separate_sequences():
    model = tiny_model()
    a = jax.random.randint(jax.random.key(0), (1, 7), 0, 67)
    b = jax.random.randint(jax.random.key(1), (1, 5), 0, 67)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[1] * 7 + [2] * 5])
    out = model(packed, segment_ids=seg)
    np.testing.assert_allclose(out[:, :7], model(a), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[:, 7:], model(b), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["dense", "chunked"])
def test_causal_gradients(attention):
    """The logits at position t do not depend on tokens after t (gradient through embeddings)."""
    model = tiny_model(attention=attention, attention_block=4)
    tokens = jax.random.randint(jax.random.key(2), (1, 9), 0, 67)
    graphdef, state = nnx.split(model)

    def logit_at_4(emb_scale):
        m = nnx.merge(graphdef, state)
        h = m.embed_tokens(tokens) * emb_scale[None, :, None]
        x = h
        pos = jnp.arange(9)[None]
        for layer in m.layers:
            x = layer(x, pos, None)
        return m.logits(m.final_norm(x))[0, 4].sum()

    g = jax.grad(logit_at_4)(jnp.ones((9,)))
    assert np.all(np.asarray(g[5:]) == 0) and np.all(np.asarray(g[:5]) != 0)


@pytest.mark.slow
def test_remat_same_values_and_grads():
    cfg = tiny_model_config()
    plain = Transformer(cfg, rngs=nnx.Rngs(0))
    remat = Transformer(cfg.replace(remat=True), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, 67)

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0])

    g1 = nnx.grad(loss)(plain)
    g2 = nnx.grad(loss)(remat)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_bf16_compute_close_to_fp32():
    cfg = tiny_model_config()
    f32 = Transformer(cfg, rngs=nnx.Rngs(0))
    bf16 = Transformer(cfg.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, 67)
    out = bf16(tokens)
    assert out.dtype == jnp.float32  # logits always fp32
    assert bf16.layers[0].attn.q_proj[...].dtype == jnp.float32  # master weights stay fp32
    # bf16 has 8 mantissa bits: agreement to a few 1e-2 on O(1) logits is what it can give.
    np.testing.assert_allclose(out, f32(tokens), atol=5e-2, rtol=0)


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_chunked_mlp_same_values_and_grads(remat, mlp_bias):
    """The SwiGLU over 4-token blocks (T = 11: padded to 12) equals it over the whole sequence:
    logits and every parameter's gradient, fp32."""
    cfg = tiny_model_config(remat=remat, mlp_bias=mlp_bias, mlp_chunk=0)
    whole = Transformer(cfg, rngs=nnx.Rngs(0))
    chunked = Transformer(cfg.replace(mlp_chunk=4), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(4), (2, 11), 0, 67)

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(tokens))[..., 3])

    np.testing.assert_allclose(chunked(tokens), whole(tokens), atol=1e-6, rtol=0)
    g1, g2 = nnx.grad(loss)(whole), nnx.grad(loss)(chunked)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-6, rtol=1e-6)


def test_chunked_mlp_never_builds_the_whole_activation():
    """With chunk 4 at T = 16 no `[B, T, F]` array is in the gradient's program."""
    cfg = tiny_model_config(remat=True, mlp_chunk=4)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 16), jnp.int32)
    graphdef, state = nnx.split(model)

    def loss(s):
        return jnp.sum(nnx.merge(graphdef, s)(tokens)[..., 0])

    text = jax.jit(jax.grad(loss)).lower(state).as_text()
    f = cfg.intermediate_size
    assert f"1x16x{f}x" not in text and f"1x4x{f}x" in text
