"""Compaction (gather kept tokens to the slot's front pages) as a Mosaic TPU Pallas kernel.

The pool stays in HBM (`memory_space=ANY`, aliased to the output); the new lengths and the
flattened page table and kept indices are scalar-prefetched into SMEM. One program per (row, kv
head) walks j upwards and issues a synchronous HBM->HBM DMA of token `keep[j]` to slot j; kept
indices increase, so a token is read before it can be overwritten. A production version would
batch the copies into runs of contiguous tokens; this one is the simple, obviously ordered form.

Mosaic tiles the last two dims of an HBM ref and a DMA may only start on a tile boundary there,
so the pool is viewed as `[P, L, K, 1, F]` (F the trailing dims, H for K/V, 1 for H2O's mass):
page, offset and head are then untiled leading dims. On TPU that view is a relayout of the pool
in and out of the kernel (XLA inserts the copies); storing the pools in the kernel's layout would
remove them.

Supported when compiled (`unsupported_reason`): any page size, head dim and dtype (bf16, fp32,
int32 checked by AOT compiles for v5e / v5p / v6e), as long as the SMEM tables
(B * (M + 1 + K * J) int32) fit `SMEM_BUDGET_BYTES`; larger ones go to XLA. Any shape runs in
interpret mode (CPU tests).
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Int, Shaped

from pallas_kernels.paged_attention.kernel_tpu import SMEM_BUDGET_BYTES


def unsupported_reason(batch: int, max_pages: int, kv_heads: int, keep_len: int) -> str | None:
    """Why Mosaic cannot compile the kernel (SMEM tables too large), or None if it can."""
    words = batch * (max_pages + 1 + kv_heads * keep_len)
    if 4 * words > SMEM_BUDGET_BYTES:
        return f"scalar tables of {4 * words} bytes exceed SMEM_BUDGET_BYTES={SMEM_BUDGET_BYTES}"
    return None


def _kernel(
    len_ref, pt_ref, keep_ref, pages_in_ref, o_ref, *, page_size, num_heads, max_pages, keep_len
):
    del pages_in_ref  # aliased to o_ref
    b, kh = pl.program_id(0), pl.program_id(1)

    def body(j, carry):
        src = keep_ref[(b * num_heads + kh) * keep_len + j]
        src_page, src_off = pt_ref[b * max_pages + src // page_size], src % page_size
        dst_page, dst_off = pt_ref[b * max_pages + j // page_size], j % page_size
        pltpu.sync_copy(o_ref.at[src_page, src_off, kh], o_ref.at[dst_page, dst_off, kh])
        return carry

    jax.lax.fori_loop(0, len_ref[b], body, 0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def compact_pages_tpu(
    pages: Shaped[Array, "P L K ..."],
    page_table_bm: Int[Array, "B M"],
    keep_bks: Int[Array, "B K J"],
    new_len_b: Int[Array, " B"],
    *,
    interpret: bool = False,
) -> Shaped[Array, "P L K ..."]:
    """The pool with each row's kept tokens moved to its front, in place (see `reference.py`).

    `interpret`: run in Pallas' HLO interpreter (any platform), as the api does off a TPU.
    """
    p, page_size = pages.shape[:2]
    kh = keep_bks.shape[1]
    # [P, L, K, 1, F] from either layout: the kv head is a leading (untiled) dim, so a DMA may
    # start at any head.
    flat = pages.reshape(p, page_size, kh, 1, -1)
    b = keep_bks.shape[0]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, kh),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
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
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
    )(new_len_b, page_table_bm.reshape(-1), keep_bks.reshape(-1), flat)
    return out.reshape(pages.shape)
