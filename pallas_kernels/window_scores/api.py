"""Window scoring: dispatch between the XLA reference and the Pallas kernels."""

from __future__ import annotations

import contextlib

from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import Impl, interpret_needed, resolve_impl
from pallas_kernels.window_scores.reference import window_scores_reference


def window_scores(
    q_bwnh: Float[Array, "B W N H"],
    k_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    num_queries_b: Int[Array, " B"],
    *,
    impl: Impl = "auto",
) -> Float[Array, "B K S"]:
    """SnapKV importance of every kept key, `[B, K, M * L]` (see `reference.py`)."""
    which = resolve_impl(impl)
    if which == "xla":
        return window_scores_reference(q_bwnh, k_pages, page_table_bm, lengths_b, num_queries_b)
    if which == "pallas_gpu":
        from pallas_kernels.window_scores import kernel_gpu

        return kernel_gpu.window_scores_gpu(
            q_bwnh,
            k_pages,
            page_table_bm,
            lengths_b,
            num_queries_b,
            interpret=interpret_needed(),
        )
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.window_scores import kernel_tpu

    ctx = pltpu.force_tpu_interpret_mode() if interpret_needed() else contextlib.nullcontext()
    with ctx:
        return kernel_tpu.window_scores_tpu(
            q_bwnh, k_pages, page_table_bm, lengths_b, num_queries_b
        )
