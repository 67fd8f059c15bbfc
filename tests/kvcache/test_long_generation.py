"""(d) A generation of 8x the budget runs in a pool sized for budget + interval + one page per slot;
and an exhausted pool is a clear error, never silent corruption."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.kvcache import (
    CompressionConfig,
    PagedKVCache,
    PoolExhaustedError,
    check_overflow,
    paged_cache_for,
)
from sparserl_jax.models import Transformer, model_preset
from sparserl_jax.testing import greedy_generate

TINY = model_preset("kv-longgen-tiny", param_dtype="float32", dtype="float32")
BUDGET, INTERVAL, PAGE, BATCH, PROMPT = 16, 8, 4, 2, 5


@pytest.fixture(scope="module")
def model():
    return Transformer(TINY, rngs=nnx.Rngs(3))


@pytest.mark.parametrize(
    "policy",
    ["streaming", "snapkv", *(pytest.param(p, marks=pytest.mark.slow) for p in ("h2o", "rkv"))],
)
def test_generation_of_8x_budget_fits_small_pool(model, policy):
    config = CompressionConfig(policy=policy, budget=BUDGET, window=4, interval=INTERVAL)
    gen = 8 * BUDGET
    per_slot = -(-(BUDGET + INTERVAL) // PAGE) + 1  # budget + interval + one page
    cache = paged_cache_for(
        TINY, config, batch=BATCH, max_len=PROMPT + gen, prompt_len=PROMPT, page_size=PAGE
    )
    assert cache.num_pages == BATCH * per_slot
    prompt = jax.random.randint(jax.random.key(0), (BATCH, PROMPT), 0, TINY.vocab_size)
    tokens, cache, stats = greedy_generate(
        model, cache, prompt, gen_len=gen, config=config, chunk=32
    )
    assert tokens.shape == (BATCH, gen)
    total = PROMPT + gen - 1  # the last generated token is never fed back
    np.testing.assert_array_equal(cache.next_pos_b, [total] * BATCH)
    assert stats.tokens_evicted == BATCH * total - sum(stats.final_lengths)
    assert stats.tokens_evicted > 0
    assert all(BUDGET <= n <= BUDGET + INTERVAL for n in stats.final_lengths)
    assert stats.peak_pages <= BATCH * per_slot
    dense_pages = BATCH * -(-total // PAGE)
    assert stats.peak_pages * 4 <= dense_pages


def test_generation_in_too_small_pool_raises(model):
    config = CompressionConfig(policy="streaming", budget=BUDGET, window=4, interval=INTERVAL)
    per_slot = -(-(BUDGET + INTERVAL) // PAGE) + 1
    cache = paged_cache_for(
        TINY,
        config,
        batch=BATCH,
        max_len=PROMPT + 40,
        prompt_len=PROMPT,
        page_size=PAGE,
        num_pages=BATCH * (per_slot - 3),
    )
    prompt = jnp.zeros((BATCH, PROMPT), jnp.int32)
    with pytest.raises(PoolExhaustedError, match="pool exhausted"):
        greedy_generate(model, cache, prompt, gen_len=40, config=config, chunk=32)


def test_exhausted_pool_is_flagged_and_raises():
    cache = PagedKVCache.create(
        num_layers=1,
        batch=2,
        num_pages=3,
        page_size=2,
        max_pages_per_slot=4,
        num_kv_heads=1,
        head_dim=2,
    )
    step = jax.jit(lambda c, m: c.begin_step(m)[0].end_step())
    cache = step(cache, jnp.array([[1, 1, 1], [1, 1, 0]], bool))  # 2 pages + 1 page
    check_overflow(cache)
    table_before = np.asarray(cache.page_table)
    cache = step(cache, jnp.array([[1, 0, 0], [1, 0, 0]], bool))  # slot 0: 4th token, fits
    # Slot 1 needed a second page and none was left: flagged, nothing stored, table unchanged.
    np.testing.assert_array_equal(cache.overflow_b, [False, True])
    np.testing.assert_array_equal(cache.lengths_b, [4, 2])
    np.testing.assert_array_equal(cache.page_table[1], table_before[1])
    with pytest.raises(PoolExhaustedError, match=r"slots \[1\]"):
        check_overflow(cache)
    # A slot whose own page table is full is refused the same way.
    cache = step(cache, jnp.array([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], bool))
    np.testing.assert_array_equal(cache.overflow_b, [True, True])
    np.testing.assert_array_equal(cache.lengths_b, [4, 2])
