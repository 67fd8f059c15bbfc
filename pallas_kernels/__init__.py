"""Pallas kernels for the paged, compressible KV cache, one folder per op.

Each op has `reference.py` (pure jnp: the specification and the CPU path), its kernels
(`kernel_tpu.py`: Mosaic TPU; `kernel_gpu.py`: the Pallas Triton lowering, see the note there)
and `api.py`, which dispatches (`_dispatch.choose_impl`): on a TPU target the Mosaic kernel where
its `unsupported_reason` accepts the shapes, else the XLA reference (one log line); the Triton
kernels on GPU likewise; XLA on CPU. The target is the platform the program is lowered for
(`_dispatch.by_platform`), not the process's: a program traced on a CPU host and compiled for TPU
devices (by its shardings, a mesh or `jax.default_device`) holds the Mosaic kernels.

- `paged_attention`: one decode query per row against paged K/V (GQA), optionally returning the
  per-key probabilities H2O accumulates.
- `window_scores`: SnapKV/R-KV importance, the last w queries against all kept keys.
- `compaction`: gather each slot's kept tokens to the front of its pages.
"""

from pallas_kernels._dispatch import KERNEL_IMPL_ENV, Impl, resolve_impl
from pallas_kernels.compaction.api import compact_pages
from pallas_kernels.paged_attention.api import paged_decode_attention
from pallas_kernels.window_scores.api import window_scores

__all__ = [
    "KERNEL_IMPL_ENV",
    "Impl",
    "compact_pages",
    "paged_decode_attention",
    "resolve_impl",
    "window_scores",
]
