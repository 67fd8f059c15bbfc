"""Format 3, stage 1: which exponent class each element is in, and where the classes are cut.

Whether a published element changes depends mostly on the size of its last bit, i.e. on the old
value's exponent (an Adam step of size ~lr flips the bf16 rounding with probability ~lr / ulp).
A format-3 entry therefore splits its leaf's elements into at most `MAX_CUTS + 1` classes of
consecutive old exponents; its `context` cuts are the exponents where classes start. Any valid
cuts decode, so the choice is the encoder's: the split with the least mask entropy
`sum n * H2(k / n)` over the classes (`best_cuts`, one dynamic program over many leaves at once),
or, with a slack, the leaf's last cuts while they stay near the bound of one class per exponent
(`keeps_cuts`): a new cut costs both ends of a link a pass over the leaf. Five classes keep all
but ~0.02 B per change of what all 256 exponents give on the bench's updates.

The next stage (`order.py`) turns the classes into each changed element's position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "CUT_SLACK",
    "MAX_CUTS",
    "best_cuts",
    "choose_cuts",
    "class_mask_bits",
    "class_of",
    "cut_counts",
    "exponent_histogram",
    "exponent_key",
    "keeps_cuts",
    "max_exponent",
]

MAX_CUTS = 4
# How much more mask bits than one class per exponent (the bound no split beats; the best of at
# most 5 classes is ~2-4% above it) a leaf's last cuts may cost and still be kept: `choose_cuts`'
# default `slack`, `CodecConfig.cut_slack`'s. 0: the best cuts every version (the smallest patch).
CUT_SLACK = 0.0
# (shift, mask) of the exponent field in each floating dtype's bit pattern.
EXPONENT_FIELDS = {
    "bfloat16": (7, 0xFF),
    "float16": (10, 0x1F),
    "float32": (23, 0xFF),
    "float8_e4m3fn": (3, 0xF),
    "float8_e5m2": (2, 0x1F),
}


def exponent_key(bits: np.ndarray, dtype: str) -> np.ndarray | None:
    """The exponent field of each element's bits as uint8 (flat); None for non-float dtypes."""
    if dtype not in EXPONENT_FIELDS:
        return None
    shift, mask = EXPONENT_FIELDS[dtype]
    key = (bits.reshape(-1) >> shift).astype(np.uint8)  # keeps the low 8 bits
    if mask != 0xFF:  # bf16 and fp32: the sign bit is the only one above the exponent
        key &= mask
    return key


def max_exponent(dtype: str) -> int:
    """The largest exponent field value of `dtype`; 0 for dtypes without one (no cuts)."""
    return EXPONENT_FIELDS[dtype][1] if dtype in EXPONENT_FIELDS else 0


HISTOGRAM_BLOCK = 1 << 20  # elements per `bincount` in `exponent_histogram`


def exponent_histogram(bits: np.ndarray, dtype: str) -> np.ndarray | None:
    """How many elements of `bits` hold each exponent field value (int64[256]); None for
    non-float dtypes."""
    if dtype not in EXPONENT_FIELDS:
        return None
    # In blocks: `bincount` widens its input to int64, 8 bytes per element of a whole leaf.
    flat, hist = bits.reshape(-1), np.zeros(256, np.int64)
    for lo in range(0, flat.size, HISTOGRAM_BLOCK):
        hist += np.bincount(exponent_key(flat[lo : lo + HISTOGRAM_BLOCK], dtype), minlength=256)
    return hist


def class_of(key: np.ndarray, cuts: list[int]) -> np.ndarray:
    """The class (number of cuts <= key) of each exponent key, as uint8."""
    table = np.searchsorted(cuts, np.arange(256), side="right").astype(np.uint8)
    return table[key]


def binary_entropy_bits(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """`n * H2(k / n)` elementwise for `0 <= k <= n` (0 where n == 0 or k in {0, n}), as
    `n log n - k log k - (n - k) log (n - k)`: no division, no special cases."""
    n, k = np.asarray(n, np.float64), np.asarray(k, np.float64)
    return _xlog2x(n) - _xlog2x(k) - _xlog2x(n - k)


def _xlog2x(x: np.ndarray) -> np.ndarray:
    """`x * log2(x)`, 0 at 0 (`x >= 0`)."""
    return x * np.log2(np.maximum(x, np.finfo(np.float64).tiny))


def class_mask_bits(n_c: np.ndarray, k_c: np.ndarray) -> float:
    """`sum_c n_c * H2(k_c / n_c)` bits: the empirical cost of a mask with `k_c` of the `n_c`
    elements of each context class c set, coded at each class's own rate (zeroth order within a
    class). One class gives the plain mask entropy `n * H2(k / n)`."""
    return float(binary_entropy_bits(n_c, k_c).sum())


def choose_cuts(
    old_bits: np.ndarray,
    changed_old: np.ndarray,
    dtype: str,
    *,
    sample: int = 1 << 16,
    counts: np.ndarray | None = None,
    prefer: list[int] | None = None,
    slack: float = CUT_SLACK,
) -> list[int]:
    """At most `MAX_CUTS` exponents where context classes start, minimising the mask entropy.

    `changed_old`: the old bits of the changed elements (their exponents are counted exactly);
    `counts`: the leaf's exponent histogram (`exponent_histogram` of `old_bits`, or the one a
    `ContextCache` holds), else estimated from an evenly strided sample of `old_bits`. A
    dynamic program over the exponents present picks the split into consecutive ranges with the
    least `sum n * H2(k / n)` (`best_cuts`); [] (flat order) for non-float dtypes or when nothing
    is gained. `prefer`: cuts to keep (the leaf's last ones) while they cost at most `slack` more
    than one class per exponent (`keeps_cuts`).
    """
    nk = cut_counts(old_bits, changed_old, dtype, sample=sample, counts=counts)
    if nk is None:
        return []
    if keeps_cuts(*nk, prefer, slack):
        return list(prefer)
    return best_cuts([nk])[0]


def cut_counts(
    old_bits: np.ndarray | None,
    changed_old: np.ndarray,
    dtype: str,
    *,
    sample: int = 1 << 16,
    counts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """`(n_c, k_c)`, float64[256]: the leaf's elements and changes per exponent, as
    `choose_cuts` counts them; None where no cut applies (non-float dtype, no change).
    `old_bits` is read only when `counts` is None."""
    if dtype not in EXPONENT_FIELDS or changed_old.size == 0:
        return None
    if counts is not None:
        n_c = np.asarray(counts, np.float64)
    else:
        old = old_bits.reshape(-1)
        stride = max(1, old.size // sample)
        n_c = np.bincount(exponent_key(old[::stride], dtype), minlength=256) * (
            old.size / -(-old.size // stride)
        )
    k_c = np.bincount(exponent_key(changed_old, dtype), minlength=256).astype(np.float64)
    return np.maximum(n_c, k_c), k_c  # a sample may miss a class the changes show


def keeps_cuts(n_c: np.ndarray, k_c: np.ndarray, prefer: list[int] | None, slack: float) -> bool:
    """Whether `prefer` costs at most `slack` more mask bits than one class per exponent (the
    bound no split beats): a new cut costs both ends of a link a pass over the leaf
    (`ContextCache`), and kept cuts skip the dynamic program. Never for `slack == 0`."""
    if not slack > 0 or prefer is None or len(prefer) > MAX_CUTS:
        return False
    n_cum, k_cum = np.cumsum(n_c), np.cumsum(k_c)
    at = np.asarray(prefer, np.int64) - 1  # the last exponent below each cut
    n_r = np.diff(np.concatenate([[0.0], n_cum[at], [n_cum[-1]]]))
    k_r = np.diff(np.concatenate([[0.0], k_cum[at], [k_cum[-1]]]))
    kept = binary_entropy_bits(n_r, k_r).sum() + 8 * len(prefer)
    return bool(kept <= class_mask_bits(n_c, k_c) * (1 + slack))


def best_cuts(cases: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[list[int]]:
    """The least-cost cuts (`choose_cuts`) of each leaf's `(n_c, k_c)` (`cut_counts`), by one
    dynamic program over all of them: the exponents present in each leaf, left-aligned and
    padded with empty ones (which no split ending at the last present exponent uses)."""
    if not cases:
        return []
    n_c = np.stack([n for n, _ in cases])
    k_c = np.stack([k for _, k in cases])
    present = n_c > 0
    sizes = present.sum(axis=1)  # [L]
    width = int(sizes.max())
    exps = np.argsort(~present, axis=1, kind="stable")[:, :width]  # present exponents first
    live = np.arange(width) < sizes[:, None]
    n_cum = np.zeros((len(cases), width + 1))
    k_cum = np.zeros((len(cases), width + 1))
    np.cumsum(np.take_along_axis(n_c, exps, axis=1) * live, axis=1, out=n_cum[:, 1:])
    np.cumsum(np.take_along_axis(k_c, exps, axis=1) * live, axis=1, out=k_cum[:, 1:])
    # seg[l, a, b]: exponents a..b-1 of leaf l as one class (b > a).
    seg = binary_entropy_bits(
        n_cum[:, None, :] - n_cum[:, :, None], k_cum[:, None, :] - k_cum[:, :, None]
    )
    seg[:, ~np.triu(np.ones((width + 1, width + 1), bool), 1)] = np.inf
    best, back = [seg[:, 0, :]], []  # best[s][l, b]: exponents 0..b-1 in s + 1 ranges
    for _ in range(MAX_CUTS):
        total = best[-1][:, :, None] + seg
        back.append(total.argmin(axis=1))
        best.append(total.min(axis=1))
    rows = np.arange(len(cases))
    # Fewer ranges unless more save at least a byte (each cut costs header bytes); ties: fewer.
    costs = np.stack([x[rows, sizes] for x in best], axis=1) + 8 * np.arange(MAX_CUTS + 1)
    out = []
    for row, ranges in enumerate(costs.argmin(axis=1).tolist()):
        end, cuts = int(sizes[row]), []
        for j in range(ranges, 0, -1):
            end = int(back[j - 1][row, end])
            cuts.append(int(exps[row, end]))
        out.append(sorted(cuts))
    return out
