"""Compression between decode chunks: score, select, compact, free the emptied pages.

`compress(cache, config)` is jittable. A row is compressed when it holds more than `budget`
tokens and the batch step counter is a multiple of `interval` (Sparse-RL's `steps % 128`). Its
kept tokens (see `policies.select_tokens`) are gathered into its front pages by the compaction
kernel, its length becomes `budget` (its next absolute position does not change), and the pages
past `ceil(budget / page_size)` go back on the free stack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from pallas_kernels import compact_pages
from pallas_kernels.paged_attention.reference import layer_pages
from sparserl_jax.kvcache import allocator
from sparserl_jax.kvcache.config import CompressionConfig
from sparserl_jax.kvcache.evictions import record_evictions
from sparserl_jax.kvcache.paged import PagedKVCache, cdiv_arr
from sparserl_jax.kvcache.policies import layer_scores, select_tokens


def should_compress(cache: PagedKVCache, config: CompressionConfig) -> Bool[Array, " B"]:
    """Rows due for compression now: length > budget and the step counter on the interval."""
    on_interval = (cache.steps % config.interval) == 0
    return (cache.lengths_b > config.budget) & on_interval


def compress(
    cache: PagedKVCache,
    config: CompressionConfig,
    *,
    force: bool = False,
    any_due: Callable[[jax.Array], jax.Array] = jnp.any,
) -> PagedKVCache:
    """Compress the rows that are due (every row above budget when `force`). `any_due` decides
    whether to run at all (the rollout engine's data shards decide together, so that every
    device runs the same program: `rollout.shards.any_slot`)."""
    if config.policy == "none" or cache.capacity <= config.budget:
        return cache  # no row can exceed the budget: statically a no-op
    due_b = cache.lengths_b > config.budget
    if not force:
        due_b = should_compress(cache, config)
    return jax.lax.cond(
        any_due(due_b), lambda c: compress_rows(c, config, due_b), lambda c: c, cache
    )


def compress_rows(
    cache: PagedKVCache, config: CompressionConfig, rows_b: Bool[Array, " B"]
) -> PagedKVCache:
    """Compress exactly the rows in `rows_b` (each must hold more than `budget` tokens).

    Layer by layer, in a loop over layers (`lax.fori_loop`: one layer's scoring is live at a
    time, where unrolled XLA scheduled every layer's query preparation at once): score the layer
    on the pools as the previous layer's compaction left them, select, compact its K, V (and
    mass) in place. Per sequence one selection, from the scores summed over layers (in layer
    order), serves every layer."""
    new_len_b = jnp.where(rows_b, config.budget, cache.lengths_b)
    # Rows not compressed write nothing (compaction writes only j < its new length).
    write_len_b = jnp.where(rows_b, config.budget, 0)
    layers = cache.k_pages.shape[0]

    def select(scores_bks):
        return select_tokens(scores_bks[None], cache.lengths_b, config)[0]

    def pools_of(c):
        return c.k_pages, c.v_pages, c.attn_mass

    def with_pools(pools):
        k, v, mass = pools
        return dataclasses.replace(cache, k_pages=k, v_pages=v, attn_mass=mass)

    shared = None
    if config.granularity == "sequence":
        b, k, s = cache.page_table.shape[0], cache.kv_heads, cache.capacity
        shared = select(
            jax.lax.fori_loop(
                0,
                layers,
                lambda y, acc: acc + layer_scores(cache, config, y),
                jnp.zeros((b, k, s), jnp.float32),
            )
        )

    def compact(pool, y, keep_bkj):
        # The layer's pages through the whole pool (`layer_pages`: no slice of it), so the call
        # updates the pool in place (the kernel aliases it); compacting `pool[y]` and stacking
        # the layers would build a new pool.
        flat, table = layer_pages(pool, cache.page_table, y)
        flat = compact_pages(flat, table, keep_bkj, write_len_b, impl=cache.impl, mesh=cache.mesh)
        return flat.reshape(pool.shape)

    record = shared is None and cache.evict_pos is not None

    def layer(y, carry):
        pools, keeps = carry
        keep_bkj = (
            shared if shared is not None else select(layer_scores(with_pools(pools), config, y))
        )
        pools = tuple(None if p is None else compact(p, y, keep_bkj) for p in pools)
        if record:
            keeps = jax.lax.dynamic_update_index_in_dim(keeps, keep_bkj, y, 0)
        return pools, keeps

    keeps = None
    if record:
        b, k = cache.page_table.shape[0], cache.kv_heads
        keeps = jnp.zeros((layers, b, k, config.budget), jnp.int32)
    pools, keeps = jax.lax.fori_loop(0, layers, layer, (pools_of(cache), keeps))
    cache = with_pools(pools)
    keep_ybkj = shared[None] if shared is not None else keeps
    evict_pos = cache.evict_pos
    if evict_pos is not None:
        evict_pos = record_evictions(evict_pos, keep_ybkj, cache.next_pos_b, rows_b)
    stack, top, page_table, num_pages_b = allocator.release(
        cache.free_stack,
        cache.free_top,
        cache.page_table,
        cache.num_pages_b,
        cdiv_arr(new_len_b, cache.page_size),
    )
    return dataclasses.replace(
        cache,
        evict_pos=evict_pos,
        page_table=page_table,
        num_pages_b=num_pages_b,
        free_stack=stack,
        free_top=top,
        lengths_b=new_len_b,
        evicted_b=cache.evicted_b + (cache.lengths_b - new_len_b),
    )


def release_slots(cache: PagedKVCache, done_b: Bool[Array, " B"]) -> PagedKVCache:
    """Finished sequences give all their pages back; their slots start empty."""
    keep_b = jnp.where(done_b, 0, cache.num_pages_b)
    stack, top, page_table, num_pages_b = allocator.release(
        cache.free_stack, cache.free_top, cache.page_table, cache.num_pages_b, keep_b
    )
    zero = jnp.zeros_like(cache.lengths_b)
    return dataclasses.replace(
        cache,
        page_table=page_table,
        num_pages_b=num_pages_b,
        free_stack=stack,
        free_top=top,
        lengths_b=jnp.where(done_b, zero, cache.lengths_b),
        next_pos_b=jnp.where(done_b, zero, cache.next_pos_b),
        evicted_b=jnp.where(done_b, zero, cache.evicted_b),
        overflow_b=cache.overflow_b & ~done_b,
    )
