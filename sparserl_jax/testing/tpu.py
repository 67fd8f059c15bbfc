"""Ahead-of-time TPU compiles in tests, from a CPU host with libtpu installed.

`topology(name)` gives a TPU topology to compile against, or skips the test when libtpu or the
topology is missing, and fails it instead when `SPARSERL_REQUIRE_TPU_AOT` is set (as `make
test-tpu-aot` does, so CI cannot skip silently). `no_persistent_cache()` keeps such executables
out of JAX's persistent compilation cache: compiled for a topology without a client, they cannot
be read back from it, and every hit would warn.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import jax
import pytest

__all__ = ["REQUIRE_ENV", "no_persistent_cache", "topology", "unavailable"]

REQUIRE_ENV = "SPARSERL_REQUIRE_TPU_AOT"


def unavailable(reason: str):
    """Skip the calling test, or fail it when `SPARSERL_REQUIRE_TPU_AOT` is set."""
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set but {reason}")
    pytest.skip(reason)


def topology(name: str):
    """The description of TPU topology `name` (e.g. "v5p:2x2x1"), or `unavailable`."""
    if importlib.util.find_spec("libtpu") is None:
        unavailable("libtpu is not installed (pip install -e '.[tpu]', or `make test-tpu-aot`)")
    from jax.experimental import topologies  # needs the TPU plugin: only once libtpu is there

    # Compiling touches no chip: let several processes (pytest workers, benchmarks) load libtpu
    # at once instead of failing on its single-process lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    try:
        return topologies.get_topology_desc(name, "tpu")
    except Exception as e:  # no TPU plugin / unknown topology in this jax
        unavailable(f"TPU topology {name} is unavailable: {e}")


@contextlib.contextmanager
def no_persistent_cache() -> Iterator[None]:
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
