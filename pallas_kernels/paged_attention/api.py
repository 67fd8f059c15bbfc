"""Paged decode attention: dispatch between the XLA reference and the Pallas kernels."""

from __future__ import annotations

import contextlib

from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import Impl, interpret_needed, resolve_impl
from pallas_kernels.paged_attention.reference import (
    paged_decode_attention_reference,
    probs_from_logits,
)


def paged_decode_attention(
    q_bnh: Float[Array, "B N H"],
    k_pages: Float[Array, "P L K H"],
    v_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    *,
    return_probs: bool = False,
    impl: Impl = "auto",
) -> tuple[Float[Array, "B N H"], Float[Array, "B N S"] | None]:
    """One pre-scaled decode query per row against its first `lengths_b[b]` paged keys.

    Returns fp32 outputs `[B, N, H]` and, with `return_probs`, the per-key softmax
    probabilities `[B, N, M * L]` (zero past the length) that H2O accumulates. See
    `reference.py` for the layout. `impl`: "auto" (XLA on CPU, the backend's kernel on TPU/GPU),
    "xla", "pallas_tpu" or "pallas_gpu" (interpret mode when run on a CPU).
    """
    which = resolve_impl(impl)
    if which == "xla":
        return paged_decode_attention_reference(
            q_bnh, k_pages, v_pages, page_table_bm, lengths_b, return_probs=return_probs
        )
    if which == "pallas_gpu":
        from pallas_kernels.paged_attention import kernel_gpu

        out, lse, logits = kernel_gpu.paged_decode_attention_gpu(
            q_bnh,
            k_pages,
            v_pages,
            page_table_bm,
            lengths_b,
            return_logits=return_probs,
            interpret=interpret_needed(),
        )
    else:
        from jax.experimental.pallas import tpu as pltpu

        from pallas_kernels.paged_attention import kernel_tpu

        ctx = pltpu.force_tpu_interpret_mode() if interpret_needed() else contextlib.nullcontext()
        with ctx:
            out, lse, logits = kernel_tpu.paged_decode_attention_tpu(
                q_bnh, k_pages, v_pages, page_table_bm, lengths_b, return_logits=return_probs
            )
    probs = probs_from_logits(logits, lse, lengths_b) if return_probs else None
    return out, probs
