"""Compaction: dispatch between the XLA reference and the Pallas kernels."""

from __future__ import annotations

from jax.sharding import Mesh
from jaxtyping import Array, Int, Shaped

from pallas_kernels._dispatch import (
    Concrete,
    Impl,
    by_platform,
    choose_impl,
    local_kv_heads,
    on_mesh,
    pool_dims,
)
from pallas_kernels.compaction import kernel_gpu, kernel_tpu
from pallas_kernels.compaction.reference import compact_pages_reference


def compact_pages(
    pages: Shaped[Array, "P L K ..."] | Shaped[Array, "P L KF"],
    page_table_bm: Int[Array, "B M"],
    keep_bks: Int[Array, "B K J"],
    new_len_b: Int[Array, " B"],
    *,
    impl: Impl = "auto",
    mesh: Mesh | None = None,
) -> Shaped[Array, "P L K ..."]:
    """Each row's kept tokens gathered to the front of its pages (see `reference.py`); the
    pool `[P, L, K, ...]` or lane-dense `[P, L, K * F]` (`_dispatch.pool_dims`).

    `impl` and `mesh` as in `paged_decode_attention` (decided for the platform the program is
    lowered for); shapes the chosen kernel cannot compile run on XLA.
    """
    b, kh, j = keep_bks.shape

    def unsupported(which: Concrete) -> str | None:
        if which == "pallas_tpu":
            local = local_kv_heads(mesh, kh)
            return kernel_tpu.unsupported_reason(page_table_bm.shape[1], local, j)
        return kernel_gpu.unsupported_reason(pool_dims(pages.shape, kv_heads=kh)[3])

    def build(which: Concrete, interpret: bool):
        if which == "xla":
            return compact_pages_reference

        def kernel(pg, pt, keep, new_len):
            if which == "pallas_gpu":
                return kernel_gpu.compact_pages_gpu(pg, pt, keep, new_len, interpret=interpret)
            return kernel_tpu.compact_pages_tpu(pg, pt, keep, new_len, interpret=interpret)

        def run(*args):
            in_head_dims = (2, None, 1, None)
            return on_mesh(
                kernel, args, mesh=mesh, kv_heads=kh, in_head_dims=in_head_dims, out_head_dims=2
            )

        return run

    return by_platform(
        lambda platform: choose_impl("compact_pages", impl, unsupported, platform=platform),
        build,
        (pages, page_table_bm, keep_bks, new_len_b),
        mesh=mesh,
    )
