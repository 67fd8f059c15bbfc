"""A `PagedKVCache` seen by some of its slots, and written back: how the rollout engine's prefill
runs a few slots at a time over the one cache. The pools, the free stack and the counters are
shared by all slots and pass through whole (updated in place by the step); the per-slot state
is gathered and scattered."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparserl_jax.kvcache.paged import PagedKVCache

# Per-slot fields with the slot first, and those with the slot second (after the layer).
ROW_FIELDS = ("num_pages_b", "lengths_b", "next_pos_b", "new_counts_b", "evicted_b", "overflow_b")
LAYER_ROW_FIELDS = ("q_window", "evict_pos")


def _layer_rows(cache: PagedKVCache, fn) -> dict:
    return {f: None if getattr(cache, f) is None else fn(f) for f in LAYER_ROW_FIELDS}


def slot_rows(cache: PagedKVCache, rows_g: jax.Array, cols: int) -> PagedKVCache:
    """The cache seen by slots `rows_g` only, their page table cut to its first `cols` pages:
    the pools (and H2O's mass) are the same arrays, updated in place by the step."""
    fields = {f: getattr(cache, f)[rows_g] for f in ROW_FIELDS}
    fields |= _layer_rows(cache, lambda f: getattr(cache, f)[:, rows_g])
    return dataclasses.replace(cache, page_table=cache.page_table[rows_g, :cols], **fields)


def set_slot_rows(cache: PagedKVCache, sub: PagedKVCache, rows_g: jax.Array, cols: int):
    """`cache` with the per-slot state of `sub` written back to slots `rows_g` (an index out
    of range writes nothing) and its shared state (pools, free stack, counters) taken whole."""
    fields = {f: getattr(cache, f).at[rows_g].set(getattr(sub, f), mode="drop") for f in ROW_FIELDS}
    fields |= _layer_rows(
        cache, lambda f: getattr(cache, f).at[:, rows_g].set(getattr(sub, f), mode="drop")
    )
    table = cache.page_table.at[rows_g, :cols].set(sub.page_table, mode="drop")
    return dataclasses.replace(sub, page_table=table, **fields)


def merge_slot_rows(cache: PagedKVCache, sub: PagedKVCache, fill_s: jax.Array, cols: int):
    """`cache` with the per-slot state of `sub` (the same slots, its page table cut to `cols`
    pages) taken for the filled slots only, and its shared state taken whole (a slot not
    filled holds more pages than `cols` may show: `sub` flags it, and that is dropped)."""

    def pick(new, old):
        return jnp.where(fill_s.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)

    fields = {f: pick(getattr(sub, f), getattr(cache, f)) for f in ROW_FIELDS}
    fields |= _layer_rows(cache, lambda f: jax.vmap(pick)(getattr(sub, f), getattr(cache, f)))
    table = cache.page_table.at[:, :cols].set(pick(sub.page_table, cache.page_table[:, :cols]))
    return dataclasses.replace(sub, page_table=table, **fields)
