"""Format 3, stage 2: each changed element's position in the context order.

The context order lists a leaf's elements of class 0 (`classes.py`: old exponent below the first
cut) in flat order, then those of class 1, and so on. A format-3 entry sends its changed
positions as gaps between their ranks in that order: within a class the gaps follow that class's
own change rate, and classes of high and low change rates no longer mix. The encoder ranks
(`context_order`), the decoder selects (`context_select`); both are one vectorised pass over the
changes of a leaf (`_Ranges`).

`ContextCache` is what each end of a link keeps across versions: every leaf's class bitmaps and
exponent histogram, updated from each committed version's changes, so a version costs passes
over its changes, not over the leaf (except for a cut it did not hold), and the publisher need
not read a leaf's old bits from its device at all in steady state.

The next stage (`values.py`) codes the changed values in this order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from sparserl_jax.sync.classes import (
    EXPONENT_FIELDS,
    MAX_CUTS,
    class_of,
    exponent_histogram,
    exponent_key,
)

__all__ = ["ContextCache", "OldBits", "context_order", "context_rank", "context_select"]

# A leaf's old bits, or a function that returns them (read only where they are needed).
OldBits = np.ndarray | Callable[[], np.ndarray]


def _bits(old: OldBits) -> np.ndarray:
    return (old() if callable(old) else old).reshape(-1)


class _Ranges:
    """Rank/select in context order over a leaf's class bitmaps.

    Class j (old exponent in `[cuts[j-1], cuts[j])`) is a bitmap packed into uint64 words (bit b
    of word w: element 64w + b); `words` lays the classes' bitmaps end to end, class 0 first.
    The context position of an element is then the number of set bits before its bit in that
    concatenation: the classes are disjoint and cover the leaf, so every member of a lower class
    comes first (the last class's padding bits past the leaf lie at the very end and are never
    ranked or selected). `before[g]`, the set bits in words `0..g-1` (one popcount cumsum over
    `(cuts + 1) / 64` words per element), makes rank and select one vectorised pass over the
    changes of the whole leaf, whatever class each is in.
    """

    def __init__(self, below: Sequence[np.ndarray], numel: int):
        """`below[j]`: the packed `exponent < cuts[j]` words of the leaf (`below_words`)."""
        self.numel = numel
        self.below = list(below)  # padding bits past the leaf are 0

    @classmethod
    def of(cls, old_bits: np.ndarray, dtype: str, cuts: list[int]) -> _Ranges:
        """The ranges of `old_bits` (one exponent pass, one packed compare per cut)."""
        key = exponent_key(old_bits, dtype)
        return cls([below_words(key, t) for t in cuts], key.size)

    @functools.cached_property
    def _directory(self) -> tuple[np.ndarray, np.ndarray, int]:
        """`(words, before, words per class)`: see the class docstring."""
        m, nw = len(self.below), -(-self.numel // 64)
        words = np.empty((m + 1, nw), np.uint64)
        if m == 0:
            words[0] = ~np.uint64(0)
        else:
            words[0] = self.below[0]
            for j in range(1, m):
                np.invert(self.below[j - 1], out=words[j])
                words[j] &= self.below[j]
            np.invert(self.below[m - 1], out=words[m])
        words = words.reshape(-1)
        before = np.zeros(words.size + 1, np.int64)
        np.cumsum(np.bitwise_count(words), dtype=np.int64, out=before[1:])
        return words, before, nw

    @property
    def starts(self) -> np.ndarray:
        """The context position where each class starts, and `numel` last."""
        _, before, nw = self._directory
        return np.append(before[: len(self.below) * nw + 1 : nw], self.numel)

    def rank(self, cls: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Context positions of the elements at flat `index`, of classes `cls`."""
        words, before, nw = self._directory
        g = cls.astype(np.int64) * nw + (index >> 6)
        return before[g] + np.bitwise_count(words[g] & _LOW_MASKS[index & 63])

    def select(self, pos: np.ndarray) -> np.ndarray:
        """Flat indices of the elements at context positions `pos` (each in `[0, numel)`)."""
        words, before, nw = self._directory
        g = np.searchsorted(before, pos, side="right") - 1  # the word holding bit `pos`
        return (g % nw) * 64 + _select_in_word(words[g], pos - before[g])


def below_words(key: np.ndarray, cut: int) -> np.ndarray:
    """`key < cut` packed little-endian into uint64 words (bit j of word w: element 64w + j);
    the padding bits past the last element are 0."""
    nbytes = -(-key.size // 8)
    out = np.zeros(-(-nbytes // 8) * 8, np.uint8)
    out[:nbytes] = np.packbits(key < cut, bitorder="little")
    return out.view("<u8")


# Bit n of a word (`_BITS`) and the bits before it (`_LOW_MASKS`), as uint64, `0 <= n <= 63`.
_BITS = np.uint64(1) << np.arange(64, dtype=np.uint64)
_LOW_MASKS = _BITS - np.uint64(1)


def _select_bytes() -> np.ndarray:
    """[byte, k]: the position of the k-th set bit of the byte (0 where it has fewer)."""
    table = np.zeros((256, 8), np.uint8)
    for v in range(256):
        bits = [b for b in range(8) if v >> b & 1]
        table[v, : len(bits)] = bits
    return table


_SELECT_BYTE = _select_bytes()


def _select_in_word(word: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The position of the k-th set bit (from 0) of each uint64 `word`; k < popcount(word).

    Halves the word three times (is the bit above the low 32, 16, 8 bits?), then a byte table;
    counts and shifts stay uint8 (3x faster than int64 arithmetic here).
    """
    k = k.astype(np.uint8)
    b = np.zeros(word.size, np.uint8)
    for step in (32, 16, 8):
        count = np.bitwise_count(word & np.uint64((1 << step) - 1))
        up = count <= k  # the bit lies above the low `step` bits
        k -= count * up
        shift = up.astype(np.uint8) * np.uint8(step)
        word = word >> shift.astype(np.uint64)
        b += shift
    return b.astype(np.int64) + _SELECT_BYTE[word.astype(np.uint8), k]


def context_order(
    old_bits: OldBits,
    dtype: str,
    cuts: list[int],
    index: np.ndarray,
    ranges: _Ranges | None = None,
    *,
    changed_old: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`(order, pos)`: the stable sort of `index` (unique flat indices) by class, and the
    context positions of `index[order]` (rising when `index` is sorted). `changed_old`:
    `old_bits` at `index`, when the caller holds them; `ranges`: the leaf's classes for `cuts`
    if held (`ContextCache.ranges`), else built from `old_bits` (read only then, or for
    `changed_old`).

    Position = (number of elements in lower classes) + (number in the same class before it).
    With no cuts the order is the flat order.
    """
    index = np.asarray(index, np.int64)
    if not cuts or index.size == 0:
        return np.arange(index.size), index.copy()
    changed_old = _bits(old_bits)[index] if changed_old is None else changed_old
    cls = class_of(exponent_key(changed_old, dtype), cuts)
    order = np.argsort(cls, kind="stable")  # a radix sort of small ints
    ranges = ranges if ranges is not None else _Ranges.of(_bits(old_bits), dtype, cuts)
    pos = ranges.rank(cls[order], index[order])
    return order, pos


def context_rank(
    old_bits: np.ndarray, dtype: str, cuts: list[int], index: np.ndarray
) -> np.ndarray:
    """Positions in context order (`context_order`) of the elements at flat `index` (unique)."""
    order, pos = context_order(old_bits, dtype, cuts, index)
    out = np.empty_like(pos)
    out[order] = pos
    return out


def context_select(
    old_bits: OldBits,
    dtype: str,
    cuts: list[int],
    pos: np.ndarray,
    ranges: _Ranges | None = None,
) -> np.ndarray:
    """The inverse of `context_rank`: flat indices of the elements at context positions `pos`
    (each in `[0, numel)`); `ranges` as in `context_order`."""
    pos = np.asarray(pos, np.int64)
    if not cuts or pos.size == 0:
        return pos.copy()
    ranges = ranges if ranges is not None else _Ranges.of(_bits(old_bits), dtype, cuts)
    return ranges.select(pos)


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
    """Each leaf's packed `exponent < cut` bitmaps, exponent histogram and last cuts, kept across
    versions on one side of a link.

    Building a leaf's context costs a pass over its old bits per cut (`_Ranges.of`); between two
    versions only the changed elements can move between classes, so a publisher or receiver that
    keeps the bitmaps of the cuts it used updates them in O(changes) (`advance`) and rebuilds
    only a cut it has not held (the encoder picks cuts per version; most repeat). The holder
    owns the invariant: the bitmaps describe the bits the next patch is coded against. So it
    calls `advance` with every changed element of a leaf once the version that changed them is
    committed, and `drop` for a leaf replaced whole (a dense entry, an anchor) or when in doubt;
    `ranges` only ever adds bitmaps of the bits it is given. At most `max_cuts` bitmaps per leaf
    (the least recently used go first): up to `max_cuts / 8` bytes per element on the host.
    `last_cuts`: the cuts of each leaf's last sparse entry (the encoder's: kept while nearly as
    good, `CodecConfig.cut_slack`); a preference only, never needed to decode.
    """

    def __init__(self, max_cuts: int = MAX_CUTS + 2):
        if max_cuts < MAX_CUTS:
            raise ValueError(
                f"max_cuts must be >= {MAX_CUTS} (the cuts of one entry), got {max_cuts}"
            )
        self.max_cuts = max_cuts
        self.last_cuts: dict[str, list[int]] = {}
        self._leaves: dict[str, _Held] = {}
        self._hist: dict[str, np.ndarray] = {}  # name -> exponent histogram (int64[256])
        self._dtypes: dict[str, str] = {}
        self._clock = 0

    def _bind(self, name: str, dtype: str) -> None:
        if self._dtypes.get(name, dtype) != dtype:
            self.drop(name)
        self._dtypes[name] = dtype

    def histogram(self, name: str, old_bits: OldBits, dtype: str) -> np.ndarray | None:
        """Leaf `name`'s exponent histogram (`exponent_histogram` of its current bits,
        `old_bits`, read only the first time), kept by `advance`; None for non-float dtypes."""
        if dtype not in EXPONENT_FIELDS:
            return None
        self._bind(name, dtype)
        if name not in self._hist:
            self._hist[name] = exponent_histogram(_bits(old_bits), dtype)
        return self._hist[name]

    def ranges(self, name: str, old_bits: OldBits, numel: int, dtype: str, cuts: list[int]):
        """The `_Ranges` of leaf `name` (`numel` elements; its current bits: `old_bits`, read
        only for a cut not held) for `cuts`."""
        if not cuts:  # flat order: no classes to hold
            return _Ranges([], numel)
        self._bind(name, dtype)
        held = self._leaves.get(name)
        if held is None:
            held = self._leaves[name] = _Held(self.max_cuts, -(-numel // 64))
        self._clock += 1
        missing = [t for t in cuts if t not in held.slot]
        if missing:
            key = exponent_key(_bits(old_bits), dtype)
            for t in missing:
                held.put(t, below_words(key, t), keep=cuts)
        for t in cuts:
            held.used[held.slot[t]] = self._clock
        return _Ranges([held.words[held.slot[t]] for t in cuts], numel)

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
        """Forget leaf `name`'s bitmaps, histogram and cuts (every leaf's when None)."""
        if name is None:
            self._leaves.clear()
            self._hist.clear()
            self._dtypes.clear()
            self.last_cuts.clear()
        else:
            self._leaves.pop(name, None)
            self._hist.pop(name, None)
            self._dtypes.pop(name, None)
            self.last_cuts.pop(name, None)
