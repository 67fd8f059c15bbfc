"""Byte planes: how the patch codec lays out multi-byte gaps and values.

Plane p of a uint array holds byte p of every element (little-endian), so the mostly-zero high
bytes of small gaps and of XOR deltas form long runs an entropy stage compresses well.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["byte_planes", "entropy_bytes", "from_planes", "uint_dtype"]


def uint_dtype(size: int) -> np.dtype:
    """The little-endian unsigned integer dtype of `size` bytes."""
    return np.dtype(f"<u{size}")


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


def entropy_bytes(planes: Sequence[np.ndarray], sample: int = 1 << 16) -> float:
    """Zeroth-order entropy of each byte plane, in bytes: what an entropy coder can reach.

    Estimated from an evenly strided sample of at most `sample` bytes per plane.
    """
    total = 0.0
    for plane in planes:
        counts = np.bincount(plane[:: max(1, plane.size // sample)], minlength=256)
        p = counts[counts > 0] / counts.sum()
        total += float(-(p * np.log2(p)).sum()) * plane.size / 8
    return total
