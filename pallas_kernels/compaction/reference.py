"""Pure-jnp compaction: kept tokens move to the front of the slot's own pages.

For every row b, kv head k and `j < new_len_b[b]`, logical token j of (b, k) becomes the old
logical token `keep_bks[b, k, j]`:

    pages[pt[b, j // L], j % L, k] <- old_pages[pt[b, i // L], i % L, k],  i = keep_bks[b, k, j]

Indices must be strictly increasing along j (they are sorted positions), so `i >= j`: an
in-place kernel that walks j upwards never overwrites a token it has yet to read. Everything past
`new_len` is left untouched (the caller returns those pages to the free stack). Per-head indices
let R-KV select per KV head; per-sequence or per-layer selection broadcasts one set over k.
Trailing dims after K (`...`, e.g. H for K/V, none for H2O's score pool) are carried along; a
lane-dense pool `[P, L, K * F]` (`_dispatch.pool_dims`) is taken as it is.
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
    b, kh, j = keep_bks.shape
    p, pl = pages.shape[:2]
    # Token rows of K * F: on TPU a lane-dense pool's free view; a `[P, L, K, F]` pool's
    # relayout. Indexing by (token, head) instead would view the pool as `[tokens * K, F]`, a
    # relayout (a copy of the whole pool) on TPU for either layout.
    flat = pages.reshape(p * pl, -1)
    f = flat.shape[1] // kh

    def flat_index(idx_bkj):
        page = jnp.take_along_axis(
            page_table_bm[:, None, :], jnp.clip(idx_bkj // pl, 0, page_table_bm.shape[1] - 1), 2
        )
        return jnp.maximum(page, 0) * pl + idx_bkj % pl

    # Whole token rows are gathered and written, indexed by token alone; head k of destination
    # j takes head k's lanes of its own source token.
    src_bkj = flat_index(keep_bks)
    vals_bjc = jnp.concatenate(
        [flat[src_bkj[:, k]][:, :, k * f : (k + 1) * f] for k in range(kh)], axis=2
    )
    dst_j = jnp.arange(j, dtype=jnp.int32)
    dst_bj = flat_index(jnp.broadcast_to(dst_j[None, None, :], (b, 1, j)))[:, 0]
    # Out-of-range index + mode="drop" skips the writes past new_len.
    dst_bj = jnp.where(dst_j[None, :] < new_len_b[:, None], dst_bj, p * pl)
    flat = flat.at[dst_bj].set(vals_bjc, mode="drop")
    return flat.reshape(pages.shape)
