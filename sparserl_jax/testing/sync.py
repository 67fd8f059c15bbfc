"""Bit-pattern generators for the sync tests: every special value, sparse mutations, digests."""

import numpy as np

from sparserl_jax.sync.mask import element_hash

SPECIAL_BITS = {
    # +0, -0, +inf, -inf, quiet NaNs with payloads, signalling NaN, subnormals, 1.0, -max.
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x0001, 0x807F, 0x3F80],
    4: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC12345, 0xFF800001, 0x00000001,
        0x807FFFFF, 0x3F800000, 0xFF7FFFFF],
    1: [0, 1, 0x7F, 0x80, 0xFF],
}  # fmt: skip


def uint(itemsize: int) -> np.dtype:
    return np.dtype(f"<u{itemsize}")


def random_bits(rng, shape, itemsize: int, dtype: str) -> np.ndarray:
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(np.uint8)
    bits = rng.integers(0, 2 ** (8 * itemsize), shape, dtype=np.uint64).astype(uint(itemsize))
    special = np.array(SPECIAL_BITS[itemsize], uint(itemsize))
    pick = rng.random(shape) < 0.3
    bits[pick] = rng.choice(special, size=int(pick.sum()))
    return bits


def mutate(rng, old: np.ndarray, pattern: str, density: float, dtype: str) -> np.ndarray:
    """New bits from old ones: none, sparse random writes, sign flips, low-bit nudges, all."""
    new = old.copy()
    if pattern == "none" or old.size == 0:
        return new
    where = rng.random(old.shape) < (1.0 if pattern == "all" else density)
    if dtype == "bool":
        new[where] ^= np.uint8(1)
        return new
    top = np.array(1 << (8 * old.itemsize - 1), old.dtype)
    if pattern == "signs":
        new[where] ^= top  # +0 <-> -0, NaN sign, inf sign
    elif pattern == "nudge":
        new[where] ^= (rng.integers(1, 8, int(where.sum()))).astype(old.dtype)
    else:
        new[where] = random_bits(rng, (int(where.sum()),), old.itemsize, dtype)
    return new


def np_digest(bits: np.ndarray) -> np.ndarray:
    idx = np.arange(bits.size, dtype=np.uint32)
    b = bits.reshape(-1).astype(np.uint32)
    return np.array([np.sum(element_hash(idx, b, k), dtype=np.uint32) for k in range(2)], np.uint32)
