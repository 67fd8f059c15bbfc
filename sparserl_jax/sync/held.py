"""What each end of a format-3 link keeps across versions: every leaf's class bitmaps and
exponent histogram (`ContextCache`).

Building a leaf's context costs a pass over its old bits per cut (`context.below_words`);
between two versions only the changed elements can move between classes, so the publisher and
every receiver keep what they built and update it from each committed version's changes.
"""

from __future__ import annotations

import numpy as np

from sparserl_jax.sync.context import (
    _BITS,
    _EXPONENT,
    MAX_CUTS,
    _Ranges,
    below_words,
    exponent_histogram,
    exponent_key,
)

__all__ = ["ContextCache"]


class _Held:
    """One leaf's held `exponent < cut` bitmaps: row `slot[cut]` of `words` per cut held."""

    def __init__(self, slots: int, nw: int):
        self.words = np.empty((slots, nw), np.uint64)  # pages are touched only when written
        self.slot: dict[int, int] = {}  # cut -> row
        self.used = [0] * slots  # the clock of each row's last use (0: free)

    def __bool__(self) -> bool:
        return bool(self.slot)

    def put(self, cut: int, words: np.ndarray, keep: list[int]) -> None:
        """Hold `cut`'s words in a free row, else in the least recently used row not in `keep`."""
        free = [r for r in range(len(self.used)) if r not in self.slot.values()]
        if free:
            row = free[0]
        else:
            row = min((r for t, r in self.slot.items() if t not in keep), key=self.used.__getitem__)
            del self.slot[next(t for t, r in self.slot.items() if r == row)]
        self.words[row] = words
        self.slot[cut] = row

    def advance(self, index: np.ndarray, key: np.ndarray, was: np.ndarray | None) -> None:
        """Elements `index` (sorted, unique) now have exponent `key` (before: `was`, or what the
        bitmaps say when None): flip their bit in every held bitmap whose side they changed."""
        cuts = np.fromiter(self.slot, np.int64, len(self.slot))
        rows = np.fromiter(self.slot.values(), np.int64, len(self.slot))
        w, bit = index >> 6, _BITS[index & 63]
        if was is None:
            below = (self.words[rows[:, None], w[None, :]] & bit) != 0
        else:
            below = was[None, :] < cuts[:, None]
        r, c = np.nonzero((key[None, :] < cuts[:, None]) != below)  # row-major: words rise per row
        if r.size == 0:
            return
        flat = rows[r] * self.words.shape[1] + w[c]
        # Several flips may share a word: OR their (distinct) bits per word, then XOR once.
        first = _run_starts(flat)
        self.words.reshape(-1)[flat[first]] ^= np.bitwise_or.reduceat(bit[c], first)


def _run_starts(x: np.ndarray) -> np.ndarray:
    """Where each run of equal adjacent values of a non-empty `x` starts."""
    starts = np.empty(x.size, bool)
    starts[0] = True
    np.not_equal(x[1:], x[:-1], out=starts[1:])
    return np.flatnonzero(starts)


class ContextCache:
    """Each leaf's packed `exponent < cut` bitmaps and exponent histogram, kept across versions
    on one side of a link.

    Building a leaf's context costs a pass over its old bits per cut (`_Ranges.of`); between two
    versions only the changed elements can move between classes, so a publisher or receiver that
    keeps the bitmaps of the cuts it used updates them in O(changes) (`advance`) and rebuilds
    only a cut it has not held (the encoder picks cuts per version; most repeat). The holder
    owns the invariant: the bitmaps describe the bits the next patch is coded against. So it
    calls `advance` with every changed element of a leaf once the version that changed them is
    committed, and `drop` for a leaf replaced whole (a dense entry, an anchor) or when in doubt;
    `ranges` only ever adds bitmaps of the bits it is given. At most `max_cuts` bitmaps per leaf
    (the least recently used go first): up to `max_cuts / 8` bytes per element on the host.
    """

    def __init__(self, max_cuts: int = MAX_CUTS + 2):
        if max_cuts < MAX_CUTS:
            raise ValueError(
                f"max_cuts must be >= {MAX_CUTS} (the cuts of one entry), got {max_cuts}"
            )
        self.max_cuts = max_cuts
        self._leaves: dict[str, _Held] = {}
        self._hist: dict[str, np.ndarray] = {}  # name -> exponent histogram (int64[256])
        self._dtypes: dict[str, str] = {}
        self._clock = 0

    def _bind(self, name: str, dtype: str) -> None:
        if self._dtypes.get(name) != dtype:
            self.drop(name)
        self._dtypes[name] = dtype

    def histogram(self, name: str, old_bits: np.ndarray, dtype: str) -> np.ndarray | None:
        """Leaf `name`'s exponent histogram (`exponent_histogram` of its current bits,
        `old_bits`), counted once and then kept by `advance`; None for non-float dtypes."""
        if dtype not in _EXPONENT:
            return None
        self._bind(name, dtype)
        if name not in self._hist:
            self._hist[name] = exponent_histogram(old_bits, dtype)
        return self._hist[name]

    def ranges(self, name: str, old_bits: np.ndarray, dtype: str, cuts: list[int]) -> _Ranges:
        """The `_Ranges` of leaf `name` (its current bits: `old_bits`) for `cuts`."""
        old = old_bits.reshape(-1)
        if not cuts:  # flat order: no classes to hold
            return _Ranges([], old.size)
        self._bind(name, dtype)
        held = self._leaves.get(name)
        if held is None:
            held = self._leaves[name] = _Held(self.max_cuts, -(-old.size // 64))
        self._clock += 1
        missing = [t for t in cuts if t not in held.slot]
        if missing:
            key = exponent_key(old, dtype)
            for t in missing:
                held.put(t, below_words(key, t), keep=cuts)
        for t in cuts:
            held.used[held.slot[t]] = self._clock
        return _Ranges([held.words[held.slot[t]] for t in cuts], old.size)

    def advance(
        self, name: str, index: np.ndarray, new_bits: np.ndarray, old_bits: np.ndarray | None = None
    ) -> None:
        """Elements `index` (sorted unique flat indices) of leaf `name` now hold `new_bits`.

        `old_bits`: what they held before, if known: then only the elements whose exponent moved
        are looked at, and the histogram is kept (without them it is dropped, recounted on use).
        """
        held, hist = self._leaves.get(name), self._hist.get(name)
        if (not held and hist is None) or index.size == 0:
            return
        if index.size > 1 and not np.all(index[1:] > index[:-1]):
            raise ValueError("advance needs sorted unique indices")
        dtype = self._dtypes[name]
        key = exponent_key(np.asarray(new_bits), dtype)
        if old_bits is None:
            self._hist.pop(name, None)
            was = None
        else:
            was = exponent_key(np.asarray(old_bits), dtype)
            moved = np.flatnonzero(was != key)  # most changes keep their exponent
            if moved.size == 0:
                return
            index, key, was = index[moved], key[moved], was[moved]
            if hist is not None:
                hist -= np.bincount(was, minlength=256)
                hist += np.bincount(key, minlength=256)
        if held:
            held.advance(index, key, was)

    def drop(self, name: str | None = None) -> None:
        """Forget leaf `name`'s bitmaps and histogram (every leaf's when None)."""
        if name is None:
            self._leaves.clear()
            self._hist.clear()
            self._dtypes.clear()
        else:
            self._leaves.pop(name, None)
            self._hist.pop(name, None)
            self._dtypes.pop(name, None)
