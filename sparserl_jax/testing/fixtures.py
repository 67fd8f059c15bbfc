"""Tiny, prime-ish configurations so shape bugs surface, and exact tree comparisons."""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx

from sparserl_jax.models.config import ModelConfig
from sparserl_jax.models.presets import model_preset
from sparserl_jax.models.transformer import Transformer


def tiny_model_config(**overrides) -> ModelConfig:
    """A 2-layer GQA decoder small enough for CPU tests (vocab 67, D 48, 4 q / 2 kv heads): the
    `test-tiny` preset with `overrides` applied."""
    return model_preset("test-tiny", **overrides)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    return Transformer(tiny_model_config(**overrides), rngs=nnx.Rngs(seed))


def assert_trees_equal(a, b, *, what: str = "tree") -> None:
    """Bit-for-bit equality of two pytrees of arrays (NaNs compared by bit pattern)."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    if ta != tb:
        raise AssertionError(f"{what}: structures differ:\n{ta}\n{tb}")
    for (path, x), (_, y) in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        name = jax.tree_util.keystr(path)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise AssertionError(f"{what}{name}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}")
        xb = x.reshape(-1).view(np.uint8) if x.size else x
        yb = y.reshape(-1).view(np.uint8) if y.size else y
        if not np.array_equal(xb, yb):
            raise AssertionError(f"{what}{name}: values differ")


def length_reward(prompt: str, completion: str, answer: str) -> float:
    """A reward that differs between completions (their length in characters / 32), for tests
    whose rollouts must reach the weights: a random tiny model scores 0 on the task's own reward,
    so every advantage, and with it every policy gradient, would be 0.
    `data.reward_fn=sparserl_jax.testing.fixtures:length_reward`."""
    del prompt, answer
    return len(completion) / 32.0


def xla_flags_with_devices(devices: int | None) -> str:
    """This process's XLA_FLAGS with the fake CPU device count replaced by `devices` (dropped
    when None): a child process gets its own device count and keeps the other flags (the tests'
    compile settings and collective timeouts, tests/conftest.py)."""
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count=")
    ]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def child_env(compile_cache: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment for a `sparserl` child process of a test: one CPU device (XLA_FLAGS
    without a device count).

    `compile_cache`: a directory for JAX's persistent compilation cache, used unless one is set
    already (the test runs share `.jax_cache/` unless `SPARSERL_TEST_COMPILATION_CACHE=0`). A
    chain of runs of one config (stop, resume, compare) then compiles its programs once instead
    of once per process; a cached executable is the one XLA compiled for the same program, so
    results are unchanged.
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags_with_devices(None)
    if compile_cache is not None and "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return env
