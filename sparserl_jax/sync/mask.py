"""The compute-visible mask of PULSESync and the bit-pattern state digest.

PULSE (arXiv 2602.03839) sends only the weights whose *published* value changed: with fp32 master
weights the published state is `bf16(master)`, and about 99% of the per-step Adam updates do not
move a bf16 value. The mask here compares **bit patterns**, not values:

    mask_i = bits(bf16(master_new))_i != bits(sent)_i          (uint16 inequality)

where `sent` is the last *sent* published state (never a re-cast of an older master). Unlike an
IEEE `!=`, this sees a +0 -> -0 flip and does not re-send an unchanged NaN every step, so the
receiver can hold exactly the publisher's bits (checked by the state digest).

Every leaf of a parameter tree is handled by its bit pattern: floating leaves are cast to the
publish dtype (bf16 by default; fp32 leaves can be kept fp32 by `publish_dtype=None`), integer and
bool leaves are published as they are. Bits are kept as unsigned ints of the same width (`uint8`,
`uint16`, `uint32`), so the codec never does float arithmetic on weights.

Everything here is elementwise or a reduction, jitted, and keeps the input sharding: on a sharded
array each device works on its own shard and only scalars are all-reduced.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jaxtyping import Array, Shaped

# A block of a leaf: (its start along each axis, the whole leaf's shape).
Box = tuple[tuple[int, ...], tuple[int, ...]]

BITS_DTYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}

# Two independent 32-bit lanes; each lane sums an injective-per-position hash of every element.
DIGEST_SEEDS = (0x9E3779B9, 0x7F4A7C15)
_MUL_BITS = 0x85EBCA6B
_MUL_INDEX = 0x27D4EB2F


def bits_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The unsigned integer dtype that holds the bit pattern of `dtype`."""
    size = jnp.dtype(dtype).itemsize
    if size not in BITS_DTYPES:
        raise ValueError(
            f"dtype {jnp.dtype(dtype).name} has itemsize {size}; PULSESync handles itemsizes "
            f"{sorted(BITS_DTYPES)} (64-bit leaves are not supported)"
        )
    return jnp.dtype(BITS_DTYPES[size])


def published_dtype(dtype: jnp.dtype, publish_dtype: jnp.dtype | None) -> jnp.dtype:
    """The dtype a leaf is published in: floating leaves -> `publish_dtype`, others unchanged."""
    dtype = jnp.dtype(dtype)
    if publish_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        return jnp.dtype(publish_dtype)
    return dtype


def to_bits(x: Shaped[Array, "..."], publish_dtype: jnp.dtype | None = jnp.bfloat16) -> Array:
    """Cast to the published dtype (round-to-nearest-even for bf16) and view as unsigned bits."""
    pdt = published_dtype(x.dtype, publish_dtype)
    if pdt == jnp.bool_:
        return x.astype(jnp.uint8)
    return lax.bitcast_convert_type(x.astype(pdt), bits_dtype(pdt))


def from_bits(bits: Shaped[Array, "..."], dtype: jnp.dtype) -> Array:
    """Inverse of `to_bits` for an already-published dtype."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return bits != 0
    return lax.bitcast_convert_type(bits, dtype)


@functools.partial(jax.jit, static_argnames=("publish_dtype",))
def publish_bits(tree, publish_dtype: jnp.dtype | None = jnp.bfloat16):
    """Bits of the published state of a master tree (same structure, same shardings)."""
    return jax.tree.map(lambda x: to_bits(x, publish_dtype), tree)


@functools.partial(jax.jit, static_argnames=("publish_dtype",))
def visible_delta(master, sent_bits, publish_dtype: jnp.dtype | None = jnp.bfloat16):
    """`bits(publish(master)) XOR sent_bits`, leaf by leaf.

    Nonzero exactly where the published bit pattern changed (the visible mask), and it carries the
    new bits as `sent ^ delta`. One elementwise pass; the output keeps each leaf's sharding.
    """
    return jax.tree.map(lambda m, s: to_bits(m, publish_dtype) ^ s, master, sent_bits)


@functools.partial(jax.jit, static_argnames=("publish_dtype",))
def visible_mask(master, sent_bits, publish_dtype: jnp.dtype | None = jnp.bfloat16):
    """The visible mask per leaf (bool, same sharding) and its count per leaf (int32 scalars).

    `mask = bits(publish(master)) != sent_bits`: exact for +0/-0, NaN payloads, inf, subnormals.
    The counts are reductions over the sharded mask; nothing is gathered to one device.
    """
    masks = jax.tree.map(lambda m, s: to_bits(m, publish_dtype) != s, master, sent_bits)
    counts = jax.tree.map(lambda k: jnp.sum(k, dtype=jnp.int32), masks)
    return masks, counts


def packable(x: jax.Array) -> bool:
    """Whether a leaf's mask can be packed 8 per byte along its last axis within every shard."""
    if x.ndim == 0 or x.shape[-1] % 8:
        return False
    return x.sharding.shard_shape(x.shape)[-1] % 8 == 0


def pack_bits(mask):
    """A boolean array packed 8 per byte along its last axis, which must be a multiple of 8.

    Little bit order, as `np.packbits(..., bitorder="little")`: bit b of byte q is element 8q + b.
    """
    k = mask.reshape(*mask.shape[:-1], mask.shape[-1] // 8, 8).astype(jnp.uint8)
    out = k[..., 0]
    for b in range(1, 8):
        out = out | (k[..., b] << b)
    return out


def unpack_bits(packed):
    """Inverse of `pack_bits`: `[..., M]` uint8 -> `[..., 8M]` bool."""
    bits = packed[..., None] >> jnp.arange(8, dtype=jnp.uint8).reshape((1,) * packed.ndim + (8,))
    return (bits & 1).reshape(*packed.shape[:-1], -1).astype(jnp.bool_)


def _bitmap(changed, pack: bool):
    return pack_bits(changed) if pack else changed.astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("pack", "shardings"))
def changed_bitmap(new_bits, sent_bits, *, pack: tuple, shardings: tuple):
    """Packed `new_bits != sent_bits` per leaf (see `visible_bitmap`), laid out as `shardings`."""
    leaves, treedef = jax.tree.flatten(new_bits)
    sent = treedef.flatten_up_to(sent_bits)
    out = []
    for n, s, p, sh in zip(leaves, sent, pack, shardings, strict=True):
        bm = _bitmap(n != s, p)
        # Keep the master's layout, so bitmap shard k describes element shard k.
        out.append(lax.with_sharding_constraint(bm, sh) if isinstance(sh, NamedSharding) else bm)
    return jax.tree.unflatten(treedef, out)


def visible_bitmap(master, sent_bits, publish_dtype: jnp.dtype | None = jnp.bfloat16):
    """The visible mask per leaf, packed 8 elements per byte (little bit order) where `pack`.

    Packing runs along the last axis, so within a shard local byte q, bit b is local flat element
    `8q + b`; a packed mask is 1/16 of the bf16 bytes, which makes the host-side scan cheap.
    Unpackable leaves (last axis not a multiple of 8 per shard) get one uint8 (0/1) per element.
    Returns `(bitmaps, packed, new_bits)`: `packed` a tuple of bools in leaf order, `new_bits` the
    published bits of `master`. Two jitted passes (publish, then compare bits): on XLA:CPU this is
    faster than one fusion with two outputs.
    """
    leaves = jax.tree.leaves(master)
    pack = tuple(packable(x) for x in leaves)
    shardings = tuple(x.sharding for x in leaves)
    new_bits = publish_bits(master, publish_dtype)
    bitmaps = changed_bitmap(new_bits, sent_bits, pack=pack, shardings=shardings)
    return bitmaps, pack, new_bits


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser (a bijection on uint32)."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def element_hash(index, bits, lane: int):
    """Per-element digest term of one lane: `fmix32((bits * C1) ^ (index * C2 + seed))`.

    Works on jnp and np uint32 arrays alike (wrapping arithmetic). For a fixed index the map from
    bits to hash is injective (C1 odd, fmix32 a bijection), so a single wrong element always changes
    every lane.
    """
    seed = np.uint32(DIGEST_SEEDS[lane])
    return _fmix32((bits * np.uint32(_MUL_BITS)) ^ (index * np.uint32(_MUL_INDEX) + seed))


def _leaf_digest(bits, *, local: bool = False, box: Box | None = None):
    """The two digest lanes of a leaf's bits; `local`: the array lives on one device. `box`:
    the bits are the block `box` of a larger leaf, hashed at their indices in that leaf (so the
    digests of a leaf's blocks add up to the leaf's)."""
    starts, shape = (0,) * bits.ndim, bits.shape
    if box is not None:
        starts, shape = box
    if math.prod(shape) >= 2**32:
        raise ValueError(f"leaf with {math.prod(shape)} elements exceeds the 2**32 element limit")
    b32 = bits.astype(jnp.uint32)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for axis in range(bits.ndim - 1, -1, -1):
        at = lax.broadcasted_iota(jnp.uint32, bits.shape, axis) + jnp.uint32(starts[axis])
        index = index + at * np.uint32(stride)
        stride *= shape[axis]
    return lane_sums(tuple(element_hash(index, b32, k) for k in range(2)), local=local)


@functools.partial(jax.jit, static_argnames=("shape",))
def _block_digest_jit(bits, starts, *, shape: tuple[int, ...]):
    return _leaf_digest(to_bits(bits, None), local=True, box=(starts, shape))


def block_digest(bits: jax.Array, starts: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    """The digest lanes of one block (bits or values, on one device) of a leaf of `shape`,
    starting at `starts`:
    its elements hashed at their indices in the leaf. One program per block shape (the starts
    are an argument), run where the block lives."""
    return _block_digest_jit(bits, np.asarray(starts, np.uint32), shape=tuple(shape))


def _add_lanes(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def lane_sums(lanes: tuple, *, local: bool) -> Array:
    """`[sum(lane) mod 2**32 for lane in lanes]` (uint32 arrays of one shape) as one array.

    `local` (the lanes live on one device): one variadic reduction, so XLA:CPU hashes and sums
    every lane in a single loop; a `jnp.sum` per lane ran ~5x slower than that (the hash was not
    fused into both). Sharded lanes keep one `jnp.sum` each: the SPMD partitioner all-reduces
    those, but all-gathers the partial results of a variadic reduction.
    """
    if not local:
        return jnp.stack([jnp.sum(x, dtype=jnp.uint32) for x in lanes])
    zeros = tuple(np.uint32(0) for _ in lanes)
    dims = tuple(range(lanes[0].ndim))
    return jnp.stack(lax.reduce(lanes, zeros, _add_lanes, dims))


@jax.jit
def leaf_digests(bits_tree):
    """Per-leaf 64-bit digest (two uint32 lane sums) of a bits tree, computed where it lives.

    `digest = [sum_i element_hash(i, bits_i, lane) mod 2**32 for lane in (0, 1)]`, i the flat
    C-order index in the *global* array. The sum is order-free, so each shard reduces locally and
    only two scalars cross devices; it is also additive, so a publisher can update it in O(changed).
    """
    return jax.tree.map(_leaf_digest, bits_tree)


def digest_update(
    digest: np.ndarray, index: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray
) -> np.ndarray:
    """Update a leaf digest for elements at flat `index` changing from `old_bits` to `new_bits`.

    `sum += h(i, new) - h(i, old)` per lane, mod 2**32; the same arithmetic as `element_hash`,
    written with in-place numpy ops (this runs on every changed element of every publish).
    """
    n = index.size
    out = np.array(digest, dtype=np.uint32)
    if n == 0:
        return out
    ki = index.astype(np.uint32)
    ki *= np.uint32(_MUL_INDEX)
    b = np.concatenate([new_bits.astype(np.uint32), old_bits.astype(np.uint32)])
    b *= np.uint32(_MUL_BITS)
    h, t = np.empty_like(b), np.empty_like(b)
    for lane in range(2):
        np.add(ki, np.uint32(DIGEST_SEEDS[lane]), out=h[:n])
        h[n:] = h[:n]
        h ^= b
        for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
            np.right_shift(h, shift, out=t)
            h ^= t
            if mul is not None:
                h *= np.uint32(mul)
        delta = int(np.sum(h[:n], dtype=np.uint32)) - int(np.sum(h[n:], dtype=np.uint32))
        out[lane] = (int(out[lane]) + delta) % 2**32
    return out


def counts_to_host(counts: Mapping) -> dict:
    """Device count scalars -> Python ints (one transfer per leaf, a scalar each)."""
    return {k: int(v) for k, v in counts.items()}
