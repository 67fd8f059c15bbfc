"""Which implementation an op runs: the XLA reference or a Pallas kernel.

`impl="auto"` picks the XLA reference on CPU and the backend's kernel on TPU / GPU. The
environment variable `SPARSERL_KERNEL_IMPL` (xla, pallas_tpu, pallas_gpu) overrides "auto", so a
whole run can be forced onto one path without touching code. A Pallas kernel asked for on a CPU
runs in interpret mode (slow, for tests and debugging).
"""

from __future__ import annotations

import os
from typing import Literal

import jax

Impl = Literal["auto", "xla", "pallas_tpu", "pallas_gpu"]
IMPLS: tuple[str, ...] = ("auto", "xla", "pallas_tpu", "pallas_gpu")
KERNEL_IMPL_ENV = "SPARSERL_KERNEL_IMPL"


def resolve_impl(impl: Impl) -> Literal["xla", "pallas_tpu", "pallas_gpu"]:
    """The concrete implementation for `impl` on the default backend."""
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        env = os.environ.get(KERNEL_IMPL_ENV, "").strip()
        if env:
            if env not in IMPLS[1:]:
                raise ValueError(f"{KERNEL_IMPL_ENV}={env!r}; expected one of {IMPLS[1:]}")
            return env  # type: ignore[return-value]
        backend = jax.default_backend()
        if backend == "tpu":
            return "pallas_tpu"
        if backend in ("gpu", "cuda", "rocm"):
            return "pallas_gpu"
        return "xla"
    return impl  # type: ignore[return-value]


def interpret_needed() -> bool:
    """Kernels run in interpret mode when no accelerator is the default backend."""
    return jax.default_backend() == "cpu"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
