"""Pure-jnp compaction: kept tokens move to the front of the slot's own pages.

For every row b, kv head k and `j < new_len_b[b]`, logical token j of (b, k) becomes the old
logical token `keep_bks[b, k, j]`:

    pages[pt[b, j // L], j % L, k] <- old_pages[pt[b, i // L], i % L, k],  i = keep_bks[b, k, j]

Indices must be strictly increasing along j (they are sorted positions), so `i >= j`: an
in-place kernel that walks j upwards never overwrites a token it has yet to read. Everything past
`new_len` is left untouched (the caller returns those pages to the free stack). Per-head indices
let R-KV select per KV head; per-sequence or per-layer selection broadcasts one set over k.
Trailing dims after K (`...`, e.g. H for K/V, none for H2O's score pool) are carried along.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped


def compact_pages_reference(
    pages: Shaped[Array, "P L K ..."],
    page_table_bm: Int[Array, "B M"],
    keep_bks: Int[Array, "B K J"],
    new_len_b: Int[Array, " B"],
) -> Shaped[Array, "P L K ..."]:
    """The pool with each row's kept tokens gathered to its front (see the module docstring)."""
    p, pl, kh = pages.shape[:3]
    rest = pages.shape[3:]
    b, _, j = keep_bks.shape
    flat = pages.reshape((p * pl, kh) + rest)

    def flat_index(idx_bkj):
        page = jnp.take_along_axis(
            page_table_bm[:, None, :], jnp.clip(idx_bkj // pl, 0, page_table_bm.shape[1] - 1), 2
        )
        return jnp.maximum(page, 0) * pl + idx_bkj % pl

    # Whole token rows ([K, ...]) are gathered and written, indexed by token alone: an index
    # over (token, head) makes XLA view the pool as [tokens * K, ...], a relayout (a copy of the
    # whole pool) on TPU, whose tiles span the minor dims. Head k of destination j takes head k
    # of its own source token.
    src_bkj = flat_index(keep_bks)
    vals_bjk = jnp.stack([flat[src_bkj[:, k]][:, :, k] for k in range(kh)], axis=2)
    dst_j = jnp.arange(j, dtype=jnp.int32)
    dst_bj = flat_index(jnp.broadcast_to(dst_j[None, None, :], (b, 1, j)))[:, 0]
    # Out-of-range index + mode="drop" skips the writes past new_len.
    dst_bj = jnp.where(dst_j[None, :] < new_len_b[:, None], dst_bj, p * pl)
    flat = flat.at[dst_bj].set(vals_bjk, mode="drop")
    return flat.reshape(pages.shape)
