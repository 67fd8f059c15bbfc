"""Window scoring: dispatch between the XLA reference and the Pallas kernels."""

from __future__ import annotations

from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import (
    Concrete,
    Impl,
    by_platform,
    choose_impl,
    local_kv_heads,
    on_mesh,
    pool_dims,
)
from pallas_kernels.paged_attention.kernel_tpu import unsupported_reason as tpu_unsupported
from pallas_kernels.window_scores import kernel_gpu, kernel_tpu
from pallas_kernels.window_scores.reference import window_scores_reference


def window_scores(
    q_bwnh: Float[Array, "B W N H"],
    k_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    num_queries_b: Int[Array, " B"],
    *,
    impl: Impl = "auto",
    mesh: Mesh | None = None,
) -> Float[Array, "B K S"]:
    """SnapKV importance of every kept key, `[B, K, M * L]` (see `reference.py`).

    `impl` and `mesh` as in `paged_decode_attention` (decided for the platform the program is
    lowered for); shapes the chosen kernel cannot compile run on XLA.
    """
    b, w = q_bwnh.shape[:2]
    m = page_table_bm.shape[1]
    pages, page_size, kv_heads, head_dim = pool_dims(k_pages.shape, head_dim=q_bwnh.shape[-1])
    local_shape = (pages, page_size, local_kv_heads(mesh, kv_heads), head_dim)

    def unsupported(which: Concrete) -> str | None:
        if which == "pallas_tpu":
            return tpu_unsupported(local_shape, b, m, smem_words=b)
        return kernel_gpu.unsupported_reason(w, page_size, head_dim)

    def build(which: Concrete, interpret: bool):
        if which == "xla":
            return window_scores_reference

        def kernel(q, kp, pt, lens, nq):
            if which == "pallas_gpu":
                return kernel_gpu.window_scores_gpu(q, kp, pt, lens, nq, interpret=interpret)
            return kernel_tpu.window_scores_tpu(q, kp, pt, lens, nq, interpret=interpret)

        def run(*args):
            in_head_dims = (2, 2, None, None, None)
            return on_mesh(
                kernel,
                args,
                mesh=mesh,
                kv_heads=kv_heads,
                in_head_dims=in_head_dims,
                out_head_dims=1,
            )

        return run

    return by_platform(
        lambda platform: choose_impl("window_scores", impl, unsupported, platform=platform),
        build,
        (q_bwnh, k_pages, page_table_bm, lengths_b, num_queries_b),
        mesh=mesh,
    )
