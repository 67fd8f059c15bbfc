"""Compaction: dispatch between the XLA reference and the Pallas kernels."""

from __future__ import annotations

import contextlib
import math

from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh
from jaxtyping import Array, Int, Shaped

from pallas_kernels._dispatch import (
    Concrete,
    Impl,
    choose_impl,
    interpret_needed,
    local_kv_heads,
    on_mesh,
)
from pallas_kernels.compaction import kernel_gpu, kernel_tpu
from pallas_kernels.compaction.reference import compact_pages_reference


def compact_pages(
    pages: Shaped[Array, "P L K ..."],
    page_table_bm: Int[Array, "B M"],
    keep_bks: Int[Array, "B K J"],
    new_len_b: Int[Array, " B"],
    *,
    impl: Impl = "auto",
    mesh: Mesh | None = None,
) -> Shaped[Array, "P L K ..."]:
    """Each row's kept tokens gathered to the front of its pages (see `reference.py`).

    `impl` and `mesh` as in `paged_decode_attention`; shapes the chosen kernel cannot compile
    run on XLA.
    """
    b, kh, j = keep_bks.shape

    def unsupported(which: Concrete) -> str | None:
        if which == "pallas_tpu":
            local = local_kv_heads(mesh, kh)
            return kernel_tpu.unsupported_reason(b, page_table_bm.shape[1], local, j)
        return kernel_gpu.unsupported_reason(math.prod(pages.shape[3:]))

    which = choose_impl("compact_pages", impl, unsupported)
    if which == "xla":
        return compact_pages_reference(pages, page_table_bm, keep_bks, new_len_b)
    interpret = interpret_needed(which)

    def kernel(pg, pt, keep, new_len):
        if which == "pallas_gpu":
            return kernel_gpu.compact_pages_gpu(pg, pt, keep, new_len, interpret=interpret)
        with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
            return kernel_tpu.compact_pages_tpu(pg, pt, keep, new_len)

    return on_mesh(
        kernel,
        (pages, page_table_bm, keep_bks, new_len_b),
        mesh=mesh,
        kv_heads=kh,
        in_head_dims=(2, None, 1, None),
        out_head_dims=2,
    )
