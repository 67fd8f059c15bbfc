"""Byte planes and gaps: how the patch codecs lay out positions and multi-byte values.

Sorted positions travel as gaps `p[k] - p[k-1] - 1` (with `p[-1] = -1`) at the narrowest width
of `GAP_WIDTHS` that holds the largest one. Plane p of a uint array holds byte p of every element
(little-endian), so the mostly-zero high bytes of small gaps and of XOR deltas form long runs an
entropy stage compresses well. Used by the PULSESync codec and the PULSELoCo payload.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "GAP_WIDTHS",
    "byte_planes",
    "entropy_bytes",
    "from_planes",
    "gap_width",
    "gaps_of",
    "positions_of",
    "uint_dtype",
]

GAP_WIDTHS = (1, 2, 4)


def uint_dtype(size: int) -> np.dtype:
    """The little-endian unsigned integer dtype of `size` bytes."""
    return np.dtype(f"<u{size}")


def gaps_of(positions: np.ndarray) -> np.ndarray:
    """`p[k] - p[k-1] - 1` with `p[-1] = -1` (int64) of strictly increasing positions."""
    return np.diff(np.asarray(positions, np.int64), prepend=-1) - 1


def positions_of(gaps: np.ndarray) -> np.ndarray:
    """The inverse of `gaps_of` (int64)."""
    return np.cumsum(np.asarray(gaps, np.int64) + 1) - 1


def gap_width(max_gap: int) -> int:
    """The narrowest of `GAP_WIDTHS` (bytes) that holds `max_gap`."""
    for w in GAP_WIDTHS:
        if max_gap < 1 << (8 * w):
            return w
    raise ValueError(f"gap {max_gap} needs more than 4 bytes")


def byte_planes(x: np.ndarray, width: int) -> list[np.ndarray]:
    """Little-endian byte planes of a uint array: plane p holds byte p of every element."""
    b = np.ascontiguousarray(x.astype(uint_dtype(width), copy=False)).view(np.uint8)
    return [b[p::width] for p in range(width)]


def from_planes(planes: Sequence[np.ndarray], width: int) -> np.ndarray:
    """The inverse of `byte_planes`."""
    out = np.empty((planes[0].size, width), np.uint8)
    for p, plane in enumerate(planes):
        out[:, p] = plane
    return out.reshape(-1).view(uint_dtype(width))


def entropy_bytes(x: np.ndarray, width: int, sample: int = 1 << 16) -> float:
    """Zeroth-order entropy of the byte planes of uint array `x` (`byte_planes(x, width)`), in
    bytes: what an entropy coder can reach.

    Estimated from an evenly strided sample of at most `sample` elements.
    """
    x = x.astype(uint_dtype(width), copy=False)
    picked = x[:: max(1, x.size // sample)]
    if width == 2 and picked.size > 1 << 14:
        # One histogram of the 16-bit values counts both planes: half the counting, but a
        # fixed cost (65,536 bins) that a plane histogram per byte beats on fewer values.
        joint = np.bincount(picked, minlength=1 << 16).reshape(256, 256)  # [high, low]
        counts = [joint.sum(axis=0), joint.sum(axis=1)]
    else:
        by = np.ascontiguousarray(picked).view(np.uint8).reshape(-1, width)
        counts = [np.bincount(by[:, p], minlength=256) for p in range(width)]
    total = 0.0
    for c in counts:
        p = c[c > 0] / c.sum()
        total += float(-(p * np.log2(p)).sum()) * x.size / 8
    return total
