"""Synthetic token data: walks of a fixed random sparse bigram chain.

Every token is followed by one of 4 fixed successors, uniformly, so a model's next-token loss
really falls (towards log 4) and its updates are real optimizer updates, with no data to read.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def chain(vocab: int, seed: int) -> np.ndarray:
    """`[V, 4]` successors: each token is followed by one of 4 fixed tokens, uniformly."""
    return np.random.default_rng(seed).integers(0, vocab, (vocab, 4))


def shifted(succ: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A copy of `succ` with `fraction` of its rows given fresh successors."""
    rng = np.random.default_rng(seed)
    out = succ.copy()
    rows = rng.random(succ.shape[0]) < fraction
    out[rows] = rng.integers(0, succ.shape[0], (int(rows.sum()), succ.shape[1]))
    return out


def walk(succ: np.ndarray, shape: tuple[int, ...], length: int, rng: np.random.Generator):
    """int32 token sequences `[*shape, length]` from random start tokens, drawn from `rng`."""
    tok = np.empty((*shape, length), np.int32)
    tok[..., 0] = rng.integers(0, succ.shape[0], shape)
    for t in range(1, length):
        tok[..., t] = succ[tok[..., t - 1], rng.integers(0, succ.shape[1], shape)]
    return tok


def sample(succ: np.ndarray, shape: tuple[int, ...], length: int, seed: int) -> np.ndarray:
    """int32 token sequences `[*shape, length]` walked from random start tokens."""
    return walk(succ, shape, length, np.random.default_rng(seed))


def stream(vocab: int, batch: int, length: int, seed: int) -> Iterator[np.ndarray]:
    """Endless `[batch, length]` batches of `chain(vocab, seed)`, one generator drawing both the
    chain and every walk (so batch k depends on all the batches before it)."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab, (vocab, 4))  # == chain(vocab, seed)
    while True:
        yield walk(succ, (batch,), length, rng)
