"""The receiver's context for format-3 patches: exponent classes, context order, ordered line.

A receiver holds the old bits of every leaf exactly, so a patch may code what it sends relative
to them. Whether a published element changes depends mostly on the size of its last bit, i.e. on
the old value's exponent (an Adam step of size ~lr flips the bf16 rounding with probability
~lr / ulp). Format 3 therefore:

- splits each leaf's elements into at most `MAX_CUTS + 1` classes of consecutive old exponents
  (`cuts`: the exponents where a class starts, chosen per leaf by the encoder from the changes'
  exponents: `cuts.py`) and codes changed positions as
  their ranks in the *context order*:
  class 0 in flat order, then class 1, ... Within a class the gaps follow that class's own change
  rate, and the classes of high and low change rates no longer mix (`context_rank` /
  `context_select`). Five classes keep all but ~0.02 B per change of what all 256 exponents give
  on the bench's updates, at a quarter of the passes over the leaf;
- can send values as signed steps on the *ordered integer line* of the bit patterns
  (`to_line` / `from_line`): most changes are one ulp up or down.

`entropy_bound` is the empirical cost of a patch given the full (leaf, exponent) context, the
yardstick of the codec. `held.ContextCache` keeps each leaf's class bitmaps and exponent histogram
across versions on the publisher and on each receiver, so a version costs passes over its
changes, not over the leaf (except for a cut it did not hold).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from sparserl_jax.sync.planes import uint_dtype

__all__ = [
    "MAX_CUTS",
    "class_mask_bits",
    "class_of",
    "context_order",
    "exponent_histogram",
    "context_rank",
    "context_select",
    "entropy_bound",
    "exponent_key",
    "from_line",
    "max_exponent",
    "to_line",
]

MAX_CUTS = 4
# (shift, mask) of the exponent field in each floating dtype's bit pattern.
_EXPONENT = {
    "bfloat16": (7, 0xFF),
    "float16": (10, 0x1F),
    "float32": (23, 0xFF),
    "float8_e4m3fn": (3, 0xF),
    "float8_e5m2": (2, 0x1F),
}


def exponent_key(bits: np.ndarray, dtype: str) -> np.ndarray | None:
    """The exponent field of each element's bits as uint8 (flat); None for non-float dtypes."""
    if dtype not in _EXPONENT:
        return None
    shift, mask = _EXPONENT[dtype]
    key = (bits.reshape(-1) >> shift).astype(np.uint8)  # keeps the low 8 bits
    if mask != 0xFF:  # bf16 and fp32: the sign bit is the only one above the exponent
        key &= mask
    return key


def max_exponent(dtype: str) -> int:
    """The largest exponent field value of `dtype`; 0 for dtypes without one (no cuts)."""
    return _EXPONENT[dtype][1] if dtype in _EXPONENT else 0


def _binary_entropy_bits(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """`n * H2(k / n)` elementwise for `0 <= k <= n` (0 where n == 0 or k in {0, n}), as
    `n log n - k log k - (n - k) log (n - k)`: no division, no special cases."""
    n, k = np.asarray(n, np.float64), np.asarray(k, np.float64)
    return _xlog2x(n) - _xlog2x(k) - _xlog2x(n - k)


def _xlog2x(x: np.ndarray) -> np.ndarray:
    """`x * log2(x)`, 0 at 0 (`x >= 0`)."""
    return x * np.log2(np.maximum(x, np.finfo(np.float64).tiny))


def exponent_histogram(bits: np.ndarray, dtype: str) -> np.ndarray | None:
    """How many elements of `bits` hold each exponent field value (int64[256]); None for
    non-float dtypes."""
    key = exponent_key(bits, dtype)
    return None if key is None else np.bincount(key, minlength=256)


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


def class_of(key: np.ndarray, cuts: list[int]) -> np.ndarray:
    """The class (number of cuts <= key) of each exponent key, as uint8."""
    table = np.searchsorted(cuts, np.arange(256), side="right").astype(np.uint8)
    return table[key]


def context_order(
    old_bits: np.ndarray,
    dtype: str,
    cuts: list[int],
    index: np.ndarray,
    ranges: _Ranges | None = None,
    *,
    changed_old: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`(order, pos)`: the stable sort of `index` (unique flat indices) by class, and the
    context positions of `index[order]` (rising when `index` is sorted). `changed_old`:
    `old_bits` at `index`, when the caller holds them.

    The context order lists the elements of class 0 (old exponent below `cuts[0]`) in flat
    order, then those of class 1, and so on: position = (number of elements in lower classes) +
    (number in the same class before it). With no cuts the order is the flat order. `ranges`:
    the leaf's classes for `cuts` if held (`held.ContextCache.ranges`), else built from `old_bits`.
    """
    index = np.asarray(index, np.int64)
    if not cuts or index.size == 0:
        return np.arange(index.size), index.copy()
    old = old_bits.reshape(-1)
    changed_old = old[index] if changed_old is None else changed_old
    cls = class_of(exponent_key(changed_old, dtype), cuts)
    order = np.argsort(cls, kind="stable")  # a radix sort of small ints
    ranges = ranges if ranges is not None else _Ranges.of(old, dtype, cuts)
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
    old_bits: np.ndarray,
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
    ranges = ranges if ranges is not None else _Ranges.of(old_bits, dtype, cuts)
    return ranges.select(pos)


def to_line(bits: np.ndarray, itemsize: int) -> np.ndarray:
    """Bit patterns (sign-magnitude floats) as integers on the ordered line; a bijection.

    +0 -> 0, the smallest positive subnormal -> 1, ..., -0 -> -1, the largest negative
    subnormal -> -2, ...: adjacent representable values are adjacent integers, so a one-ulp change
    is a step of 1 (NaN and inf patterns sit beyond the finite values; ints map the same way).
    int32 for 1- and 2-byte items (a step between two of them still fits; one table lookup per
    element), else int64.
    """
    bits = np.asarray(bits)
    if itemsize < 4:
        return _line_tables(itemsize)[0][bits.astype(uint_dtype(itemsize), copy=False)]
    return _to_line(bits.astype(np.int64), itemsize)


def from_line(line: np.ndarray, itemsize: int) -> np.ndarray:
    """The inverse of `to_line`; `line` must lie in `[-2**(8w-1), 2**(8w-1))`."""
    if itemsize < 4:
        return _line_tables(itemsize)[1][np.asarray(line) + (1 << (8 * itemsize - 1))]
    return _from_line(np.asarray(line), itemsize)


def _to_line(b: np.ndarray, itemsize: int) -> np.ndarray:
    top = 1 << (8 * itemsize - 1)
    return np.where(b >= top, top - 1 - b, b)


def _from_line(line: np.ndarray, itemsize: int) -> np.ndarray:
    top = 1 << (8 * itemsize - 1)
    return np.where(line < 0, top - 1 - line, line).astype(uint_dtype(itemsize))


@functools.cache
def _line_tables(itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """`to_line` of every bit pattern (int32) and `from_line` of every line value (offset by
    `2**(8w-1)`), for 1- and 2-byte items: 256 KiB and 128 KiB for 2 bytes."""
    top = 1 << (8 * itemsize - 1)
    line = _to_line(np.arange(2 * top, dtype=np.int32), itemsize)
    back = np.empty(2 * top, uint_dtype(itemsize))
    back[line + top] = np.arange(2 * top)
    return line, back


def _entropy_bits(counts: np.ndarray) -> float:
    counts = counts[counts > 0]
    n = counts.sum()
    return float(-(counts * np.log2(counts / n)).sum()) if n else 0.0


def class_mask_bits(n_c: np.ndarray, k_c: np.ndarray) -> float:
    """`sum_c n_c * H2(k_c / n_c)` bits: the empirical cost of a mask with `k_c` of the `n_c`
    elements of each context class c set, coded at each class's own rate (zeroth order within a
    class). One class gives the plain mask entropy `n * H2(k / n)`."""
    return float(_binary_entropy_bits(n_c, k_c).sum())


def entropy_bound(old: np.ndarray, new: np.ndarray, dtype: str) -> tuple[float, float]:
    """Empirical bytes to code `old -> new` given the receiver's context, as (mask, values).

    mask: sum over exponent classes c of `n_c * H2(k_c / n_c)` bits (n_c elements, k_c changed);
    values: `k * H(step | c)` bits, the conditional entropy of the changed elements' steps on the
    ordered line. Both are zeroth-order within a class: what an ideal adaptive coder with the
    (leaf, exponent) context reaches on these updates.
    """
    old, new = old.reshape(-1), new.reshape(-1)
    itemsize = old.dtype.itemsize
    key = exponent_key(old, dtype)
    key = np.zeros(old.size, np.uint8) if key is None else key
    changed = old != new
    n_c = np.bincount(key, minlength=256)
    k_c = np.bincount(key[changed], minlength=256)
    mask_bits = class_mask_bits(n_c, k_c)
    step = to_line(new[changed], itemsize) - to_line(old[changed], itemsize)
    # (class, step) as one int64: steps lie in (-2**32, 2**32).
    _, joint = np.unique(
        (key[changed].astype(np.int64) << 34) + step + (1 << 33), return_counts=True
    )
    value_bits = _entropy_bits(joint) - _entropy_bits(k_c)
    return mask_bits / 8, max(value_bits, 0.0) / 8
