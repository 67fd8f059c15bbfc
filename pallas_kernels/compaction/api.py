"""Compaction: dispatch between the XLA reference and the Pallas kernels."""

from __future__ import annotations

import contextlib

from jaxtyping import Array, Int, Shaped

from pallas_kernels._dispatch import Impl, interpret_needed, resolve_impl
from pallas_kernels.compaction.reference import compact_pages_reference


def compact_pages(
    pages: Shaped[Array, "P L K ..."],
    page_table_bm: Int[Array, "B M"],
    keep_bks: Int[Array, "B K J"],
    new_len_b: Int[Array, " B"],
    *,
    impl: Impl = "auto",
) -> Shaped[Array, "P L K ..."]:
    """Each row's kept tokens gathered to the front of its pages (see `reference.py`)."""
    which = resolve_impl(impl)
    if which == "xla":
        return compact_pages_reference(pages, page_table_bm, keep_bks, new_len_b)
    if which == "pallas_gpu":
        from pallas_kernels.compaction import kernel_gpu

        return kernel_gpu.compact_pages_gpu(
            pages, page_table_bm, keep_bks, new_len_b, interpret=interpret_needed()
        )
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.compaction import kernel_tpu

    ctx = pltpu.force_tpu_interpret_mode() if interpret_needed() else contextlib.nullcontext()
    with ctx:
        return kernel_tpu.compact_pages_tpu(pages, page_table_bm, keep_bks, new_len_b)
