"""Sparse mode: the engine on a compressing cache equals the reference loop
(`sparserl_jax.testing.greedy_generate`).

`testing.greedy_generate` (prefill, then decode + `compress` each step) is the reference: the
engine, greedy, with one slot per request, must produce the same tokens and evict the same
number of tokens; with fewer slots than requests (continuous batching) every request still
gets its full completion and the pool is never exceeded.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.kvcache import CompressionConfig, paged_cache_for
from sparserl_jax.rollout import RolloutConfig, RolloutEngine
from sparserl_jax.testing import greedy_generate, tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [9, 10, 11, 12, 13], [11, 12, 13, 14, 15]]
GEN = 30


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["rkv", "h2o"])
def test_sparse_greedy_equals_reference_loop(policy):
    model = tiny_model(seed=5)
    kv = CompressionConfig(policy=policy, budget=12, window=3, interval=4)
    cfg = RolloutConfig(
        num_slots=len(PROMPTS),
        max_prompt_len=5,
        max_new_tokens=GEN,
        temperature=0.0,
        chunk_steps=7,
        kv=kv,
        page_size=4,
    )
    res = RolloutEngine(model, cfg).generate(PROMPTS)
    cache = paged_cache_for(
        model.cfg, kv, batch=len(PROMPTS), max_len=5 + GEN, prompt_len=5, page_size=4
    )
    ref, _, stats = greedy_generate(model, cache, jnp.asarray(PROMPTS), gen_len=GEN, config=kv)
    np.testing.assert_array_equal(res.completion_ids, np.asarray(ref))
    assert res.tokens_evicted.sum() > 0
    # The reference keeps decoding the last token, so it may evict once more.
    assert res.tokens_evicted.sum() <= stats.tokens_evicted
    assert res.stats["kv_peak_bytes"] <= cfg.pool_pages * stats.page_bytes
    # Tokens kept at the peak, all slots: budget + one interval of new tokens before compaction.
    assert res.stats["kv_peak_tokens"] == stats.peak_tokens == len(PROMPTS) * (12 + 4)


@pytest.mark.slow
def test_sparse_continuous_batching_bounded_by_pool():
    model = tiny_model(seed=5)
    kv = CompressionConfig(policy="rkv", budget=12, window=3, interval=4)
    cfg = RolloutConfig(
        num_slots=2,
        max_prompt_len=5,
        max_new_tokens=GEN,
        temperature=1.0,
        chunk_steps=5,
        kv=kv,
        page_size=4,
        n_samples=2,
    )
    dense_cfg = dataclasses.replace(cfg, kv=None)
    res = RolloutEngine(model, cfg).generate(PROMPTS)
    dense = RolloutEngine(model, dense_cfg).generate(PROMPTS)
    assert (res.completion_lens == GEN).all() and (res.tokens_evicted > 0).all()
    assert np.isfinite(res.sampler_logprobs).all() and (res.sampler_logprobs <= 0).all()
    assert cfg.pool_pages < dense_cfg.pool_pages
    assert 0 < res.stats["kv_peak_bytes"] < dense.stats["kv_peak_bytes"]
    # The first tokens come before any eviction, so they match the dense run exactly.
    np.testing.assert_array_equal(res.completion_ids[:, :4], dense.completion_ids[:, :4])
