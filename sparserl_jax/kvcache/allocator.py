"""A free-page stack that works inside `jit`: an int32 array and a top index.

`stack[:top]` are the free pages; pops take from the top, pushes write at the top. All batch
operations are vectorised with fixed shapes (per-slot counts become masks and exclusive prefix
sums), so they trace once and never leave the device.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def init_free_stack(num_pages: int) -> tuple[Int[Array, " P"], Int[Array, ""]]:
    """All pages free; pages are handed out in increasing order (page 0 first)."""
    return jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32), jnp.int32(num_pages)


def allocate(
    stack_p: Int[Array, " P"],
    top: Int[Array, ""],
    page_table_bm: Int[Array, "B M"],
    num_pages_b: Int[Array, " B"],
    need_b: Int[Array, " B"],
    *,
    max_new: int,
) -> tuple[Int[Array, "B M"], Int[Array, " B"], Int[Array, ""], Bool[Array, " B"]]:
    """Give slot b `need_b[b]` more pages, appended to its page table.

    First come, first served in slot order: a slot whose request does not fit (the free stack is
    short, or its page table is full) gets nothing and is reported in `ok_b = False`; the caller
    must not store into it. `max_new` is a static bound on any `need_b`.

    Returns the page table, pages per slot, the new top and `ok_b`.
    """
    b, m = page_table_bm.shape
    fits_slot_b = num_pages_b + need_b <= m
    want_b = jnp.where(fits_slot_b, need_b, 0)
    cum_b = jnp.cumsum(want_b)
    ok_b = fits_slot_b & ((need_b == 0) | (cum_b <= top))
    grant_b = jnp.where(ok_b, need_b, 0)
    start_b = jnp.cumsum(grant_b) - grant_b
    j = jnp.arange(max_new, dtype=jnp.int32)
    take_bj = j[None, :] < grant_b[:, None]
    stack_pos_bj = top - 1 - (start_b[:, None] + j[None, :])
    pages_bj = stack_p[jnp.clip(stack_pos_bj, 0, stack_p.shape[0] - 1)]
    # Columns past the grant point outside the table; mode="drop" skips them.
    col_bj = jnp.where(take_bj, num_pages_b[:, None] + j[None, :], m)
    rows_bj = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], col_bj.shape)
    page_table_bm = page_table_bm.at[rows_bj, col_bj].set(pages_bj, mode="drop")
    return page_table_bm, num_pages_b + grant_b, top - jnp.sum(grant_b), ok_b


def release(
    stack_p: Int[Array, " P"],
    top: Int[Array, ""],
    page_table_bm: Int[Array, "B M"],
    num_pages_b: Int[Array, " B"],
    keep_pages_b: Int[Array, " B"],
) -> tuple[Int[Array, " P"], Int[Array, ""], Int[Array, "B M"], Int[Array, " B"]]:
    """Slot b keeps its first `keep_pages_b[b]` pages and pushes the rest onto the stack.

    Released table entries become -1. Returns the stack, the new top, the page table and the
    pages per slot.
    """
    b, m = page_table_bm.shape
    keep_b = jnp.minimum(keep_pages_b, num_pages_b)
    count_b = num_pages_b - keep_b
    start_b = jnp.cumsum(count_b) - count_b
    j = jnp.arange(m, dtype=jnp.int32)
    drop_bj = (j[None, :] >= keep_b[:, None]) & (j[None, :] < num_pages_b[:, None])
    pos_bj = top + start_b[:, None] + (j[None, :] - keep_b[:, None])
    pos_bj = jnp.where(drop_bj, pos_bj, stack_p.shape[0])
    stack_p = stack_p.at[pos_bj].set(page_table_bm, mode="drop")
    page_table_bm = jnp.where(drop_bj, -1, page_table_bm)
    return stack_p, top + jnp.sum(count_b), page_table_bm, keep_b
