"""The receiver's context for format-3 patches: exponent keys, context order, ordered bit line.

A receiver holds the old bits of every leaf exactly, so a patch may code what it sends relative
to them. Whether a published element changes depends mostly on the size of its last bit, i.e. on
the old value's exponent (an Adam step of size ~lr flips the bf16 rounding with probability
~lr / ulp). Format 3 therefore:

- orders each leaf's elements by `exponent_key(old)` (a uint8 both sides compute; stable, so
  flat order within a key) and codes changed positions as their ranks in that *context order*:
  within one exponent class the gaps follow that class's own change rate, and the classes of
  high and low change rates no longer mix (`context_rank` / `context_select`);
- can send values as signed steps on the *ordered integer line* of the bit patterns
  (`to_line` / `from_line`): most changes are one ulp up or down.

`entropy_bound` is the empirical cost of a patch given this context, the yardstick of the codec.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "context_rank",
    "context_select",
    "entropy_bound",
    "exponent_key",
    "from_line",
    "to_line",
]

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
    return ((bits.reshape(-1) >> shift) & mask).astype(np.uint8)


def _class_starts(key: np.ndarray) -> np.ndarray:
    """Where each key's run starts in context order (257 entries, the last is `key.size`)."""
    # bincount widens its input to int64: counting byte pairs as uint16 halves that work.
    pairs = np.bincount(key[: key.size & ~1].view("<u2"), minlength=1 << 16).reshape(256, 256)
    counts = pairs.sum(axis=0) + pairs.sum(axis=1)  # [high byte, low byte]
    if key.size & 1:
        counts[key[-1]] += 1
    starts = np.zeros(257, np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


class _ClassBits:
    """Rank/select dictionaries of single key classes of one leaf, sharing scratch buffers."""

    def __init__(self, key: np.ndarray):
        self.key = key
        self.hit = np.empty(key.size, bool)
        self.buf = np.zeros(-(-key.size // 64) * 8, np.uint8)

    def __call__(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """`key == c` packed into uint64 words (bit j of word w: element 64w + j) and the number
        of set bits before each word (`words.size + 1` entries). One cheap pass over the keys
        per class instead of a sort of the whole leaf."""
        np.equal(self.key, c, out=self.hit)
        packed = np.packbits(self.hit, bitorder="little")
        if packed.size == self.buf.size:
            words = packed.view("<u8")
        else:  # pad to whole words (the padding stays zero)
            self.buf[: packed.size] = packed
            words = self.buf.view("<u8")
        before = np.zeros(words.size + 1, np.int64)
        np.cumsum(np.bitwise_count(words), out=before[1:])
        return words, before


def _low_mask(n: np.ndarray) -> np.ndarray:
    """`2**n - 1` as uint64 for `0 <= n <= 63`."""
    return (np.uint64(1) << n.astype(np.uint64)) - np.uint64(1)


def context_rank(key: np.ndarray | None, index: np.ndarray) -> np.ndarray:
    """Positions in context order of the elements at flat `index` (unique).

    The context order lists the elements with key 0 in flat order, then those with key 1, and so
    on: position = (number of elements with a smaller key) + (number with the same key before
    it). With `key=None` the order is the flat order.
    """
    index = np.asarray(index, np.int64)
    if key is None or index.size == 0:
        return index.copy()
    starts = _class_starts(key)
    k = key[index]
    pos = np.empty(index.size, np.int64)
    class_bits = _ClassBits(key)
    for c in np.unique(k).tolist():  # python ints: c + 1 must not wrap at 255
        sel = k == c
        words, before = class_bits(c)
        i = index[sel]
        w = i >> 6
        same_before = np.bitwise_count(words[w] & _low_mask(i & 63)).astype(np.int64)
        pos[sel] = starts[c] + before[w] + same_before
    return pos


def context_select(key: np.ndarray | None, pos: np.ndarray) -> np.ndarray:
    """The inverse of `context_rank`: flat indices of the elements at context positions `pos`
    (each in `[0, key.size)`)."""
    pos = np.asarray(pos, np.int64)
    if key is None or pos.size == 0:
        return pos.copy()
    starts = _class_starts(key)
    cls = np.searchsorted(starts, pos, side="right") - 1
    out = np.empty(pos.size, np.int64)
    class_bits = _ClassBits(key)
    for c in np.unique(cls).tolist():
        sel = cls == c
        r = pos[sel] - starts[c]  # rank within class c
        words, before = class_bits(c)
        w = np.searchsorted(before, r, side="right") - 1  # the word holding the r-th member
        word, j = words[w], (r - before[w]).astype(np.uint64)
        # The j-th set bit of `word`: the largest b with popcount(word & (2**b - 1)) <= j.
        b = np.zeros(w.size, np.int64)
        for step in (32, 16, 8, 4, 2, 1):
            take = np.bitwise_count(word & _low_mask(b + step)) <= j
            b += np.where(take, step, 0)
        out[sel] = w * 64 + b
    return out


def to_line(bits: np.ndarray, itemsize: int) -> np.ndarray:
    """Bit patterns (sign-magnitude floats) as int64 on the ordered line; a bijection.

    +0 -> 0, the smallest positive subnormal -> 1, ..., -0 -> -1, the largest negative
    subnormal -> -2, ...: adjacent representable values are adjacent integers, so a one-ulp change
    is a step of 1 (NaN and inf patterns sit beyond the finite values; ints map the same way).
    """
    top = 1 << (8 * itemsize - 1)
    b = bits.astype(np.int64)
    return np.where(b >= top, top - 1 - b, b)


def from_line(line: np.ndarray, itemsize: int) -> np.ndarray:
    """The inverse of `to_line`; `line` must lie in `[-2**(8w-1), 2**(8w-1))`."""
    top = 1 << (8 * itemsize - 1)
    out = np.where(line < 0, top - 1 - line, line)
    return out.astype(np.dtype(f"<u{itemsize}"))


def _entropy_bits(counts: np.ndarray) -> float:
    counts = counts[counts > 0]
    n = counts.sum()
    return float(-(counts * np.log2(counts / n)).sum()) if n else 0.0


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
    mask_bits = 0.0
    for n, k in zip(n_c[n_c > 0], k_c[n_c > 0], strict=True):
        if 0 < k < n:
            mask_bits += _entropy_bits(np.array([k, n - k]))
    step = to_line(new[changed], itemsize) - to_line(old[changed], itemsize)
    # (class, step) as one int64: steps lie in (-2**32, 2**32).
    _, joint = np.unique(
        (key[changed].astype(np.int64) << 34) + step + (1 << 33), return_counts=True
    )
    value_bits = _entropy_bits(joint) - _entropy_bits(k_c)
    return mask_bits / 8, max(value_bits, 0.0) / 8
