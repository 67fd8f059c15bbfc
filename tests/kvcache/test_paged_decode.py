"""(a) Decoding token by token through the paged cache equals the teacher-forced dense forward.

With budget >= length nothing is evicted, so paged decode must reproduce `model(tokens)` (fp32,
<= 1e-5), whatever the page size, the prompt split and the (ragged) number of real tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.kvcache import CompressionConfig, PagedKVCache, compress, paged_cache_for
from sparserl_jax.models import DenseKVCache, Transformer, model_preset

TINY = model_preset("kv-paged-tiny", param_dtype="float32", dtype="float32")


@pytest.fixture(scope="module")
def model():
    return Transformer(TINY, rngs=nnx.Rngs(0))


def _decode_all(model, cache, tokens_bt, prompt_len):
    """Prefill `prompt_len` tokens, then feed the rest one by one; logits for every token."""
    decode = nnx.jit(lambda m, t, c: m.decode(t, c))
    logits, cache = decode(model, tokens_bt[:, :prompt_len], cache)
    out = [logits]
    for i in range(prompt_len, tokens_bt.shape[1]):
        logits, cache = decode(model, tokens_bt[:, i : i + 1], cache)
        out.append(logits)
    return jnp.concatenate(out, axis=1), cache


@pytest.mark.parametrize(
    ("policy", "page_size", "prompt_len"),
    [pytest.param("none", 4, 5, marks=pytest.mark.slow), ("rkv", 3, 1), ("h2o", 5, 7)],
)
def test_paged_decode_matches_teacher_forcing(model, policy, page_size, prompt_len):
    b, t = 2, 13
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, TINY.vocab_size)
    dense = model(tokens)
    config = CompressionConfig(policy=policy, budget=64, window=4, interval=3)
    cache = paged_cache_for(TINY, config, batch=b, max_len=t, page_size=page_size)
    got, cache = _decode_all(model, cache, tokens, prompt_len)
    np.testing.assert_allclose(got, dense, atol=1e-5, rtol=1e-5)
    # Budget >= length: compression is a no-op, nothing evicted, no overflow.
    cache = compress(cache, config, force=True)
    assert int(jnp.sum(cache.evicted_b)) == 0
    assert not bool(jnp.any(cache.overflow_b))
    np.testing.assert_array_equal(cache.lengths_b, [t, t])
    np.testing.assert_array_equal(cache.num_pages_b, [-(-t // page_size)] * b)


def test_paged_matches_dense_cache_ragged(model):
    """Ragged prefill (left-aligned masks): paged and dense caches give the same logits."""
    b, t = 3, 6
    tokens = jax.random.randint(jax.random.key(2), (b, t), 0, TINY.vocab_size)
    mask = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], bool)
    dense = DenseKVCache.create(
        num_layers=TINY.num_layers, batch=b, max_len=16, num_kv_heads=2, head_dim=6
    )
    paged = PagedKVCache.create(
        num_layers=TINY.num_layers,
        batch=b,
        num_pages=12,
        page_size=4,
        max_pages_per_slot=4,
        num_kv_heads=2,
        head_dim=6,
    )
    step = nnx.jit(lambda m, tok, c, msk: m.decode(tok, c, msk))
    ld, dense = step(model, tokens, dense, mask)
    lp, paged = step(model, tokens, paged, mask)
    np.testing.assert_allclose(lp, jnp.where(mask[..., None], ld, lp), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lp * mask[..., None], ld * mask[..., None], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(paged.lengths_b, [6, 3, 1])
    np.testing.assert_array_equal(paged.num_pages_b, [2, 1, 1])
    for i in range(4):
        nxt = jax.random.randint(jax.random.key(10 + i), (b, 1), 0, TINY.vocab_size)
        ld, dense = step(model, nxt, dense, jnp.ones((b, 1), bool))
        lp, paged = step(model, nxt, paged, jnp.ones((b, 1), bool))
        np.testing.assert_allclose(lp, ld, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(paged.next_pos_b, dense.lengths_b)
