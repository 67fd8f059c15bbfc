"""Tiny, prime-ish configurations so shape bugs surface, and exact tree comparisons."""

from __future__ import annotations

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
