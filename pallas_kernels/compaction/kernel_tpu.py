"""Compaction (gather kept tokens to the slot's front pages) as a Mosaic TPU Pallas kernel.

The pool stays in HBM (`memory_space=ANY`, aliased to the output) in the lane-dense layout the
rollout cache stores, `[P, L, C]` with `C = K * F` (F: H for K/V, 1 for H2O's mass); the new
lengths and the flattened page table and kept indices are scalar-prefetched into SMEM. Mosaic
tiles the last two dims of an HBM ref and a DMA may only start on a tile boundary there, so a
token row cannot be copied on its own: every DMA moves a whole page `[L, C]`. One program per
row walks its destination pages upwards; for each it reads the page, then for each (head, slot)
reads the source token's page (only when it differs from the last one read: one head's sources
rise), picks the token's row and the head's lanes by masks (on the values' bits, so every dtype
is copied exactly), and writes the page back once. Kept indices increase, so the sources of
destination page d lie in pages >= d: none is overwritten before it is read. Slots past the row's
new length keep what they held.

A `[P, L, K, F]` pool is accepted too but relaid out on TPU (its (K, F) minor dims are tiled
otherwise); the cache never passes one.

Supported when compiled (`unsupported_reason`): any page size, head dim and dtype (bf16, fp32,
int32 checked by AOT compiles for v5e / v5p / v6e). The SMEM tables take M + 1 + K * J int32
per row: a batch whose tables exceed `SMEM_BUDGET_BYTES` is compacted in blocks of rows, one call
per block on the same (aliased) pool, since rows never touch each other's pages; only a single
row too large for SMEM goes to XLA. Any shape runs in interpret mode (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Int, Shaped

from pallas_kernels.paged_attention.kernel_tpu import SMEM_BUDGET_BYTES


def rows_per_call(max_pages: int, kv_heads: int, keep_len: int) -> int:
    """How many rows' scalar tables fit `SMEM_BUDGET_BYTES` (0: not even one)."""
    return SMEM_BUDGET_BYTES // (4 * (max_pages + 1 + kv_heads * keep_len))


def unsupported_reason(max_pages: int, kv_heads: int, keep_len: int) -> str | None:
    """Why Mosaic cannot compile the kernel (one row's SMEM tables too large), or None."""
    if rows_per_call(max_pages, kv_heads, keep_len) < 1:
        words = max_pages + 1 + kv_heads * keep_len
        return (
            f"one row's scalar tables ({4 * words} bytes) exceed "
            f"SMEM_BUDGET_BYTES={SMEM_BUDGET_BYTES}"
        )
    return None


def _bits(x: jax.Array) -> jax.Array:
    """int32 bits of a block (floats through fp32, which holds bf16 exactly)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return x.astype(jnp.int32)


def _from_bits(x: jax.Array, dtype) -> jax.Array:
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.float32).astype(dtype)
    return x.astype(dtype)


def _kernel(
    len_ref,
    pt_ref,
    keep_ref,
    pages_in_ref,
    o_ref,
    src_ref,
    dst_ref,
    *,
    page_size,
    num_heads,
    max_pages,
    keep_len,
):
    del pages_in_ref  # aliased to o_ref
    b = pl.program_id(0)
    n = len_ref[b]
    shape = dst_ref.shape  # [L, C]
    slot = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    head = jax.lax.broadcasted_iota(jnp.int32, shape, 1) // (shape[1] // num_heads)

    def page(d, carry):
        dst = pt_ref[b * max_pages + d]
        pltpu.sync_copy(o_ref.at[dst], dst_ref)
        acc = _bits(dst_ref[...])

        def token(t, state):
            acc, last = state
            k, i = t // page_size, t % page_size  # head-major: each head's sources rise
            j = d * page_size + i
            live = j < n
            src = keep_ref[(b * num_heads + k) * keep_len + jnp.minimum(j, keep_len - 1)]
            col = jnp.clip(src // page_size, 0, max_pages - 1)
            src_page = jnp.maximum(pt_ref[b * max_pages + col], 0)

            @pl.when(live & (src_page != last))
            def _read():
                pltpu.sync_copy(o_ref.at[src_page], src_ref)

            row = jnp.sum(
                jnp.where(slot == src % page_size, _bits(src_ref[...]), 0), axis=0, keepdims=True
            )
            acc = jnp.where((slot == i) & (head == k) & live, row, acc)
            return acc, jnp.where(live, src_page, last)

        acc, _ = jax.lax.fori_loop(0, num_heads * page_size, token, (acc, jnp.int32(-1)))
        dst_ref[...] = _from_bits(acc, dst_ref.dtype)
        pltpu.sync_copy(dst_ref, o_ref.at[dst])
        return carry

    jax.lax.fori_loop(0, (n + page_size - 1) // page_size, page, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "rows"))
def compact_pages_tpu(
    pages: Shaped[Array, "P L K ..."],
    page_table_bm: Int[Array, "B M"],
    keep_bks: Int[Array, "B K J"],
    new_len_b: Int[Array, " B"],
    *,
    interpret: bool = False,
    rows: int | None = None,
) -> Shaped[Array, "P L K ..."]:
    """The pool with each row's kept tokens moved to its front, in place (see `reference.py`).

    `interpret`: run in Pallas' HLO interpreter (any platform), as the api does off a TPU.
    `rows`: rows per call (default: as many as SMEM holds, `rows_per_call`).
    """
    b, kh, j = keep_bks.shape
    rows = rows or rows_per_call(page_table_bm.shape[1], kh, j)
    if rows < 1:
        raise ValueError(unsupported_reason(page_table_bm.shape[1], kh, j))
    for lo in range(0, b, rows):
        hi = min(b, lo + rows)
        pages = _compact_call(
            pages, page_table_bm[lo:hi], keep_bks[lo:hi], new_len_b[lo:hi], interpret=interpret
        )
    return pages


def _compact_call(pages, page_table_bm, keep_bks, new_len_b, *, interpret: bool):
    """One `pallas_call` over all the given rows."""
    p, page_size = pages.shape[:2]
    kh = keep_bks.shape[1]
    flat = pages.reshape(p, page_size, -1)  # lane-dense: [P, L, K * F]
    b = keep_bks.shape[0]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM(flat.shape[1:], flat.dtype)] * 2,
    )
    out = pl.pallas_call(
        functools.partial(
            _kernel,
            page_size=page_size,
            num_heads=kh,
            max_pages=page_table_bm.shape[1],
            keep_len=keep_bks.shape[2],
        ),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        input_output_aliases={3: 0},
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(new_len_b, page_table_bm.reshape(-1), keep_bks.reshape(-1), flat)
    return out.reshape(pages.shape)
