"""Compaction (gather kept tokens to the slot's front pages) as a Mosaic TPU Pallas kernel.

The pool stays in HBM (`memory_space=ANY`, aliased to the output); the new lengths, page table
and kept indices are scalar-prefetched into SMEM. One program per (row, kv head) walks j upwards
and issues a synchronous HBM->HBM DMA of token `keep[j]` to slot j; kept indices increase, so a
token is read before it can be overwritten. A production version would batch the copies into
runs of contiguous tokens; this one is the simple, obviously ordered form. Tested on CPU under
`pltpu.force_tpu_interpret_mode()`. SMEM holds `B * K * J` kept indices: chunk rows for large J.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Int, Shaped


def _kernel(len_ref, pt_ref, keep_ref, pages_in_ref, o_ref, *, page_size):
    del pages_in_ref  # aliased to o_ref
    b, kh = pl.program_id(0), pl.program_id(1)

    def body(j, carry):
        src = keep_ref[b, kh, j]
        src_page, src_off = pt_ref[b, src // page_size], src % page_size
        dst_page, dst_off = pt_ref[b, j // page_size], j % page_size
        pltpu.sync_copy(o_ref.at[src_page, src_off, kh], o_ref.at[dst_page, dst_off, kh])
        return carry

    jax.lax.fori_loop(0, len_ref[b], body, 0)


@jax.jit
def compact_pages_tpu(
    pages: Shaped[Array, "P L K ..."],
    page_table_bm: Int[Array, "B M"],
    keep_bks: Int[Array, "B K J"],
    new_len_b: Int[Array, " B"],
) -> Shaped[Array, "P L K ..."]:
    """The pool with each row's kept tokens moved to its front, in place (see `reference.py`)."""
    p, page_size, kh = pages.shape[:3]
    flat = pages.reshape(p, page_size, kh, -1)
    b = keep_bks.shape[0]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, kh),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
    )
    out = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
    )(new_len_b, page_table_bm, keep_bks, flat)
    return out.reshape(pages.shape)
