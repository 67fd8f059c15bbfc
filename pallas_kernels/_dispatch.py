"""Which implementation an op runs: the XLA reference or a Pallas kernel.

The target platform is the default device's when one is set (`with jax.default_device(d)`, how a
program is compiled ahead of time for a TPU topology from a CPU host), else the default backend.
`impl="auto"` picks the Mosaic kernel on TPU and the XLA reference on CPU and on GPU: the
Triton-lowered GPU kernels (Pallas Triton is deprecated from JAX 0.11) have not run on a GPU, so
they are opt-in (`impl="pallas_gpu"` or the environment) and warn when compiled for one. The
environment variable `SPARSERL_KERNEL_IMPL` (xla, pallas_tpu, pallas_gpu) overrides "auto".

A kernel runs in interpret mode when the target is not its platform (CPU tests). Compiled for its
platform, a kernel runs only on the shapes its `unsupported_reason` accepts; any other shape goes
to the XLA reference with one log line per (op, reason) (`choose_impl`), so a program never
reaches a kernel its compiler rejects.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Literal

import jax

Impl = Literal["auto", "xla", "pallas_tpu", "pallas_gpu"]
Concrete = Literal["xla", "pallas_tpu", "pallas_gpu"]
IMPLS: tuple[str, ...] = ("auto", "xla", "pallas_tpu", "pallas_gpu")
KERNEL_IMPL_ENV = "SPARSERL_KERNEL_IMPL"
KERNEL_PLATFORM = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}

logger = logging.getLogger("pallas_kernels")
_LOGGED: set[tuple[str, str]] = set()


def target_platform() -> str:
    """ "tpu", "gpu" or "cpu": the default device's platform if set, else the default backend."""
    dev = jax.config.jax_default_device
    if dev is None:
        platform = jax.default_backend()
    else:
        platform = dev if isinstance(dev, str) else dev.platform
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def resolve_impl(impl: Impl, *, platform: str | None = None) -> Concrete:
    """The implementation `impl` names on `platform` (default: `target_platform()`)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl  # type: ignore[return-value]
    env = os.environ.get(KERNEL_IMPL_ENV, "").strip()
    if env:
        if env not in IMPLS[1:]:
            raise ValueError(f"{KERNEL_IMPL_ENV}={env!r}; expected one of {IMPLS[1:]}")
        return env  # type: ignore[return-value]
    return "pallas_tpu" if (platform or target_platform()) == "tpu" else "xla"


def interpret_needed(which: Concrete, *, platform: str | None = None) -> bool:
    """Whether kernel `which` must run in interpret mode: the target is not its platform."""
    return KERNEL_PLATFORM[which] != (platform or target_platform())


def choose_impl(
    op: str,
    impl: Impl,
    unsupported: Callable[[Concrete], str | None],
    *,
    platform: str | None = None,
) -> Concrete:
    """`resolve_impl`, then the XLA path when the chosen kernel cannot compile these shapes.

    `unsupported(which)` returns why kernel `which` cannot be compiled for the shapes at hand
    (None if it can); it is consulted only when the kernel would be compiled, not interpreted.
    """
    platform = platform or target_platform()
    which = resolve_impl(impl, platform=platform)
    if which == "xla" or interpret_needed(which, platform=platform):
        return which
    reason = unsupported(which)
    if reason is not None:
        if (op, reason) not in _LOGGED:
            _LOGGED.add((op, reason))
            logger.warning("%s: %s cannot compile these shapes (%s); using XLA", op, which, reason)
        return "xla"
    if which == "pallas_gpu":
        warnings.warn(
            f"{op}: the Pallas Triton GPU kernels are deprecated from JAX 0.11 and have not been "
            "run on a GPU; impl='xla' is the default there",
            UserWarning,
            stacklevel=3,
        )
    return which


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0
