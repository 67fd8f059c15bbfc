"""Format 3, stage 3: the changed values, in context order, as byte planes.

A sparse entry sends its values one of three ways, chosen per entry by measured byte-plane
entropy (`code_values`): the new bits, `new ^ old` (XOR: the receiver holds the old bits
exactly; HF TRL's proposal), or signed steps on the *ordered integer line* of the bit patterns
(`to_line` / `from_line`): most Adam updates move a bf16 value one ulp up or down, so the sign
bits go packed in stream `s` and `|step| - 1` (mostly 0) in the value planes. `from_steps`
inverts the steps on the receiver.

`entropy_bound` is the codec's yardstick: the empirical cost of a patch given the full
(leaf, exponent) context.
"""

from __future__ import annotations

import functools

import numpy as np

from sparserl_jax.sync.classes import class_mask_bits, exponent_key
from sparserl_jax.sync.header import corrupt_unless
from sparserl_jax.sync.planes import byte_planes, entropy_bytes, uint_dtype

__all__ = ["VALUE_MODES", "code_values", "entropy_bound", "from_line", "from_steps", "to_line"]

VALUE_MODES = ("auto", "new", "xor", "step")
# Values sampled per entry to choose its mode: on the bench's updates the chosen mode's estimate
# is 40-50% below the next one at both learning rates, far beyond this sample's error.
MODE_SAMPLE = 1 << 12


def code_values(
    old: np.ndarray, new: np.ndarray, itemsize: int, *, values: str, entropy: bool
) -> tuple[str, dict[str, np.ndarray]]:
    """`(mode, streams)` of one entry's changed values (`old` and `new` bits, in context order):
    value planes `v0..` and, for steps, the sign stream `s`. `values`: "auto" (the smallest by
    sampled byte-plane entropy; `entropy=False`, no entropy stage: new bits, never larger) or the
    mode to use."""
    candidates = {
        "new": lambda: (new, None),
        "xor": lambda: (old ^ new, None),
        "step": functools.cache(lambda: _steps(old, new, itemsize)),
    }
    if values != "auto":
        mode = values
    elif not entropy:
        mode = "new"
    else:
        cost = {}
        for m, make in candidates.items():
            vals, signs = make()
            sign_bytes = 0 if signs is None else signs.size
            cost[m] = entropy_bytes(vals, itemsize, MODE_SAMPLE) + sign_bytes
        mode = min(cost, key=cost.get)  # ties: the first, "new"
    vals, signs = candidates[mode]()
    streams = {} if signs is None else {"s": signs}
    streams.update((f"v{p}", plane) for p, plane in enumerate(byte_planes(vals, itemsize)))
    return mode, streams


def _steps(old: np.ndarray, new: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """(`|step| - 1`, sign bits packed little-endian) of `new - old` on the ordered line."""
    step = to_line(new, itemsize) - to_line(old, itemsize)  # never 0: the bits differ
    signs = np.packbits(step < 0, bitorder="little")
    return (np.abs(step) - 1).astype(uint_dtype(itemsize)), signs


def from_steps(
    old: np.ndarray, mags: np.ndarray, signs: np.ndarray, itemsize: int, what: str
) -> np.ndarray:
    """The new bits of `old` moved by the steps (`_steps`) `mags` and packed `signs`;
    `CorruptPatchError` naming `what` for non-zero sign padding or a step off the bit patterns."""
    neg = np.unpackbits(np.asarray(signs), bitorder="little")
    corrupt_unless(not neg[old.size :].any(), f"{what}: sign stream padding is not zero")
    mag = mags.astype(np.int32 if itemsize < 4 else np.int64) + 1  # as `to_line`
    line = to_line(old, itemsize) + np.where(neg[: old.size] != 0, -mag, mag)
    top = 1 << (8 * itemsize - 1)
    corrupt_unless(
        bool(np.all((line >= -top) & (line < top))),
        f"{what}: a step leaves the range of bit patterns",
    )
    return from_line(line, itemsize)


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
