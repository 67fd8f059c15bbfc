"""Counting the programs JAX builds: how many XLA executables a piece of code cost.

Every jit cache miss ends in one executable, compiled by XLA or loaded from the persistent
compilation cache; JAX times both under the `/jax/core/compile/backend_compile_duration` event and
hands it to the listeners registered with the public `jax.monitoring` API (the event name has been
stable across jax 0.4 to 0.10; `jax._src.dispatch.BACKEND_COMPILE_EVENT`). One process-wide
listener, installed on first use, tallies them by the jitted function's name, so a benchmark can
print the compilations of each step and a test can bound those of a call sequence.

    with CompileCount() as c:
        receiver.apply(blob)
    c.total, c.by_name   # {"jit__scatter_first": 1, ...}
"""

from __future__ import annotations

import collections
import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()
_installed = False


def _listener(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _counts[str(kwargs.get("fun_name", "?"))] += 1


def install() -> None:
    """Register the listener (idempotent; a `jax.monitoring` listener cannot be removed)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def compile_counts() -> dict[str, int]:
    """Executables built in this process since `install()`, by jitted function name."""
    install()
    with _lock:
        return dict(_counts)


class CompileCount:
    """Executables built between `__enter__` and `__exit__` (or now, while still open)."""

    def __enter__(self) -> CompileCount:
        self._start = compile_counts()
        self._end: dict[str, int] | None = None
        return self

    def __exit__(self, *exc) -> None:
        self._end = compile_counts()

    @property
    def by_name(self) -> dict[str, int]:
        end = compile_counts() if self._end is None else self._end
        diff = {k: v - self._start.get(k, 0) for k, v in end.items()}
        return {k: v for k, v in diff.items() if v}

    @property
    def total(self) -> int:
        return sum(self.by_name.values())
