"""The eviction record: when each cached position left the cache, so a learner can replay it.

A sparse sampler decodes token i attending only to the keys still in its cache at that moment.
`PagedKVCache.evict_pos` (kept when asked for: `RolloutConfig.record_evictions`) holds, per
slot, for every absolute position j, the first query position that no longer sees key j: key
j is visible to query i exactly when `j <= i < evict_pos[j]`. A key never evicted holds `NEVER`.
The record is `[Y', B, K', T]` int32: Y' = layers and K' = KV heads where the compression
chooses per layer / per KV head (`CompressionConfig.granularity`), 1 where it does not (one
choice is shared); T = the longest sequence (prompt + completion).

Compaction keeps the chosen tokens in position order (`policies.select_tokens` returns them
increasing, `compact_pages` writes them to the front), so the stored entry j of a slot is its
j-th position still alive (below `next_pos` and not evicted): the record needs no copy of the
positions in the pages. A compression after the step that stored position p - 1 (`next_pos` =
p) evicts with `evict_pos = p`: query p - 1 saw the key, query p does not. SnapKV's compression
of the prompt runs before the first decode step: its evictions hold the prompt's length.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

NEVER = np.iinfo(np.int32).max  # a key that stays in the cache to the end of its sequence


def record_shape(granularity: str, *, layers: int, kv_heads: int, max_len: int):
    """`(Y', K', T)` of one slot's record for a compression `granularity` (module docstring)."""
    per_layer = granularity in ("layer", "head")
    per_head = granularity == "head"
    return (layers if per_layer else 1, kv_heads if per_head else 1, max_len)


def empty_record(shape: tuple[int, int, int], batch: int) -> Int[Array, "Y B K T"]:
    """The record of `batch` slots of `shape` = (Y', K', T), nothing evicted."""
    y, k, t = shape
    return jnp.full((y, batch, k, t), NEVER, jnp.int32)


def checked_record(evict_pos_bykt, tokens_shape: tuple[int, int]) -> Int[Array, "B Y K T"]:
    """`evict_pos_bykt` as int32, refused in one line unless it is `[B, Y, K, T]` for tokens
    `[B, T]` (what a learner replays: `RolloutResult.evictions`)."""
    ev = None if evict_pos_bykt is None else jnp.asarray(evict_pos_bykt, jnp.int32)
    if ev is None or ev.ndim != 4 or ev.shape[::3] != tuple(tokens_shape):
        raise ValueError(
            "eviction replay needs the sampler's eviction record [B, Y, K, T] for tokens "
            f"{tuple(tokens_shape)}, got {None if ev is None else ev.shape} "
            "(rollout.record_evictions)"
        )
    return ev


def record_evictions(
    evict_ybkt: Int[Array, "Y B K T"],
    keep_ybkj: Int[Array, "Y B K J"],
    next_pos_b: Int[Array, " B"],
    rows_b: Bool[Array, " B"],
) -> Int[Array, "Y B K T"]:
    """The record after rows `rows_b` kept the stored entries `keep_ybkj` (indices into each
    row's stored entries, as `select_tokens` returns them) and dropped the others: a position
    alive before and not kept is evicted at `next_pos_b`. Other rows are unchanged."""
    y, b, k, t = evict_ybkt.shape
    # Where the record shares one choice, every layer / KV head made it: take the first.
    keep_ybkj = keep_ybkj[:y, :, :k]
    pos_t = jnp.arange(t, dtype=jnp.int32)
    alive = (pos_t[None, None, None, :] < next_pos_b[None, :, None, None]) & (evict_ybkt == NEVER)
    rank = jnp.cumsum(alive.astype(jnp.int32), axis=-1) - 1  # the stored entry of a position
    # kept[j]: stored entry j is kept (a row holds at most t entries; positions not alive have
    # rank -1, clipped to 0, and are masked below).
    width = max(t, int(keep_ybkj.shape[-1]))
    index = jnp.arange(y * b * k, dtype=jnp.int32).reshape(y, b, k, 1)
    kept = jnp.zeros((y * b * k, width), bool).at[index, keep_ybkj].set(True)
    kept = jnp.take_along_axis(kept.reshape(y, b, k, width), jnp.maximum(rank, 0), axis=-1)
    gone = alive & ~kept & rows_b[None, :, None, None]
    return jnp.where(gone, next_pos_b[None, :, None, None], evict_ybkt)


def reset_rows(evict_ybkt: Int[Array, "Y B K T"], rows_b: Bool[Array, " B"]):
    """Rows starting a new sequence: nothing evicted yet."""
    return jnp.where(rows_b[None, :, None, None], NEVER, evict_ybkt)
