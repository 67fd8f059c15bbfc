"""Test oracles for the rollout engine: the step-by-step greedy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def stepwise_greedy(model, prompts, steps: int) -> np.ndarray:
    """Reference: append argmax of the dense forward one token at a time (one jitted forward on
    rows padded to a fixed width; padding sits after the prefix, so causality hides it)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    lens = np.array([len(p) for p in prompts])
    seq = np.zeros((len(prompts), lens.max() + steps), np.int32)
    for i, p in enumerate(prompts):
        seq[i, : len(p)] = p
    for t in range(steps):
        logits = np.asarray(forward(state, jnp.asarray(seq)))
        rows = np.arange(len(prompts))
        seq[rows, lens + t] = logits[rows, lens + t - 1].argmax(-1)
    return np.stack([seq[i, lens[i] : lens[i] + steps] for i in range(len(prompts))])
