"""R-KV's redundancy scored in blocks of slots (`policies.rkv_redundancy`) equals the scoring of
all slots at once (`redundancy_scores` over each layer's gathered keys), whatever the block."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.reference import gather_pages
from sparserl_jax.kvcache import CompressionConfig, PagedKVCache
from sparserl_jax.kvcache.policies import candidate_mask, redundancy_scores, rkv_redundancy


@pytest.mark.parametrize("block", [1, 2, 3, 5, 8])
def test_blocked_redundancy_equals_all_slots_at_once(block):
    b, m, pl, layers = 5, 3, 4, 2
    cache = PagedKVCache.create(
        num_layers=layers,
        batch=b,
        num_pages=b * m + 1,
        page_size=pl,
        max_pages_per_slot=m,
        num_kv_heads=2,
        head_dim=8,
    )
    k_pages = jax.random.normal(jax.random.key(0), cache.k_pages.shape)
    # Pages handed out shuffled; the last row holds only two pages.
    table = np.random.default_rng(0).permutation(b * m + 1)[: b * m].reshape(b, m)
    table[-1, -1] = -1
    lengths = np.array([12, 9, 11, 5, 8], np.int32)
    cache = dataclasses.replace(
        cache, k_pages=k_pages, page_table=jnp.asarray(table), lengths_b=jnp.asarray(lengths)
    )
    kv = CompressionConfig(policy="rkv", budget=6, window=2)
    valid_bs = candidate_mask(cache.lengths_b, cache.capacity, kv.window)
    got = jnp.stack([rkv_redundancy(cache, valid_bs, kv, y, block=block) for y in range(layers)])
    want = jnp.stack(
        [
            redundancy_scores(
                gather_pages(cache.split_heads(k_pages)[y], cache.page_table),
                valid_bs,
                threshold=kv.rkv_sim_threshold,
                retain_last=kv.rkv_retain_last,
            )
            for y in range(layers)
        ]
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
