"""Compaction: dispatch between the XLA reference and the Pallas kernels."""

from __future__ import annotations

import contextlib
import math

from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Int, Shaped

from pallas_kernels._dispatch import Concrete, Impl, choose_impl, interpret_needed
from pallas_kernels.compaction import kernel_gpu, kernel_tpu
from pallas_kernels.compaction.reference import compact_pages_reference


def compact_pages(
    pages: Shaped[Array, "P L K ..."],
    page_table_bm: Int[Array, "B M"],
    keep_bks: Int[Array, "B K J"],
    new_len_b: Int[Array, " B"],
    *,
    impl: Impl = "auto",
) -> Shaped[Array, "P L K ..."]:
    """Each row's kept tokens gathered to the front of its pages (see `reference.py`).

    `impl` as in `paged_decode_attention`; shapes the chosen kernel cannot compile run on XLA.
    """
    b, kh, j = keep_bks.shape

    def unsupported(which: Concrete) -> str | None:
        if which == "pallas_tpu":
            return kernel_tpu.unsupported_reason(b, page_table_bm.shape[1], kh, j)
        return kernel_gpu.unsupported_reason(math.prod(pages.shape[3:]))

    which = choose_impl("compact_pages", impl, unsupported)
    if which == "xla":
        return compact_pages_reference(pages, page_table_bm, keep_bks, new_len_b)
    if which == "pallas_gpu":
        return kernel_gpu.compact_pages_gpu(
            pages, page_table_bm, keep_bks, new_len_b, interpret=interpret_needed(which)
        )
    interpret = interpret_needed(which)
    with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
        return kernel_tpu.compact_pages_tpu(pages, page_table_bm, keep_bks, new_len_b)
