"""Compaction (gather kept tokens to the slot's front pages) as a Pallas GPU kernel.

GPU lowering: **Pallas Triton** (`jax.experimental.pallas.triton.CompilerParams`), deprecated
from JAX 0.11 in favour of Mosaic GPU; kept on Triton until the page-table-indexed copies are
ported. Runs on CPU with `interpret=True`; bit-exact against XLA on an H100 (docs/results.md).

In place (the pool is aliased to the output): one program per (row, kv head) walks j = 0, 1, ...
upwards and copies token `keep[j]` to slot j. Kept indices increase, so `keep[j] >= j`: a token
is always read before anything overwrites it, and programs touch disjoint (pages, head) cells.
Reads go through the output ref, i.e. the buffer being compacted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Int, Shaped

from pallas_kernels._dispatch import is_pow2


def unsupported_reason(trailing: int) -> str | None:
    """Why Triton would reject the copied row (a power-of-two extent), or None."""
    if not is_pow2(trailing):
        return f"trailing size {trailing} is not a power of two (Triton block extents)"
    return None


def _kernel(len_ref, pt_ref, keep_ref, pages_in_ref, o_ref, *, page_size):
    del pages_in_ref  # aliased to o_ref
    b, kh = pl.program_id(0), pl.program_id(1)

    def split(i):  # (page-table column, offset); i >= 0, so truncating division is floor's
        # lax.div / lax.rem, not // and %: jnp's floor-mod sign fix-up fails to lower to Triton
        # (`AssertionError: ('i32', 'i1')` in `_mod`, JAX 0.11.2 on an H100).
        page = jnp.int32(page_size)
        return jax.lax.div(i, page), jax.lax.rem(i, page)

    def body(j, carry):
        (src_col, src_off), (dst_col, dst_off) = split(keep_ref[b, kh, j]), split(j)
        src_page, dst_page = pt_ref[b, src_col], pt_ref[b, dst_col]
        o_ref[dst_page, dst_off, kh, :] = o_ref[src_page, src_off, kh, :]
        return carry

    jax.lax.fori_loop(0, len_ref[b], body, 0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def compact_pages_gpu(
    pages: Shaped[Array, "P L K ..."],
    page_table_bm: Int[Array, "B M"],
    keep_bks: Int[Array, "B K J"],
    new_len_b: Int[Array, " B"],
    *,
    interpret: bool = False,
) -> Shaped[Array, "P L K ..."]:
    """The pool with each row's kept tokens moved to its front, in place (see `reference.py`)."""
    p, page_size = pages.shape[:2]
    kh = keep_bks.shape[1]
    # Either layout (`[P, L, K, ...]` or lane-dense `[P, L, K * F]`) as `[P, L, K, F]` (F: H for
    # K/V, 1 for H2O's mass): free on a GPU.
    flat = pages.reshape(p, page_size, kh, -1)
    b = keep_bks.shape[0]
    out = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        grid=(b, kh),
        input_output_aliases={3: 0},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
    )(new_len_b, page_table_bm, keep_bks, flat)
    return out.reshape(pages.shape)
