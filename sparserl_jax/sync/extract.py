"""Changed-element extraction from (possibly sharded) delta arrays, shard by shard on the host.

The visible mask is computed and bit-packed on device (`mask.visible_bitmap`); here each
addressable shard is read where it lives (on CPU `np.asarray(shard.data)` is a zero-copy view),
its set bits are found with one vectorised `np.flatnonzero` over the packed bytes plus
`np.unpackbits` of the hit bytes, and local positions are mapped to *global* flat C-order
indices. Old and new bits are read at those positions only. No shard is gathered.

`extract_changes` needs fully addressable arrays (single-controller publishing); a publisher per
process walks only its own shards with `shard_changes` (`Publisher(shards=True)`). On GPU/TPU
reading a shard copies it to the host; a device-side compaction would avoid that and is not
written yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class LeafChanges:
    """Changed elements of one leaf: sorted global flat `index`, `delta = new ^ old`, `old` bits."""

    index: np.ndarray
    delta: np.ndarray
    old: np.ndarray

    @functools.cached_property
    def new(self) -> np.ndarray:  # computed once: the codec reads it several times
        return self.old ^ self.delta

    @property
    def count(self) -> int:
        return int(self.index.size)


def _local_positions(bitmap: np.ndarray, packed: bool) -> np.ndarray:
    """Sorted flat element positions set in a (packed, little bit order) bitmap shard."""
    # `flatnonzero` takes numpy's fast path on bool input: ~3x faster than on uint8.
    hit = np.flatnonzero(bitmap != 0)
    if not packed or hit.size == 0:
        return hit
    bits = np.flatnonzero(np.unpackbits(bitmap[hit], bitorder="little").view(bool))
    return hit[bits >> 3] * 8 + (bits & 7)  # row-major over hit bytes: stays sorted


def global_index(local: np.ndarray, starts: tuple, local_shape, global_shape) -> np.ndarray:
    """Flat indices in the whole array of the flat positions `local` of its block starting at
    `starts` with shape `local_shape`."""
    if tuple(local_shape) == tuple(global_shape):
        return local.astype(np.int64)
    if all(st == 0 for st in starts[1:]) and tuple(local_shape[1:]) == tuple(global_shape[1:]):
        # Sharded along the leading axis only: a shard is one contiguous flat range.
        row = int(np.prod(global_shape[1:], dtype=np.int64))
        return local.astype(np.int64) + starts[0] * row
    multi = np.unravel_index(local, local_shape)
    shifted = tuple(m.astype(np.int64) + st for m, st in zip(multi, starts, strict=True))
    return np.ravel_multi_index(shifted, global_shape).astype(np.int64)


def primary_shards(arr: jax.Array, *, local: bool = False) -> list:
    """The addressable shards with `replica_id == 0` (each element of the array is in exactly
    one such shard over all processes), in the order of their starts. `local`: the array may
    span processes (a process then walks only the shards it holds)."""
    if not local and not arr.is_fully_addressable:
        raise NotImplementedError(
            "PULSESync extraction needs a fully addressable array; got one spanning processes "
            f"(sharding {arr.sharding}). Publish from a single controller, or publish each "
            "process's shards (`Publisher(shards=True)`, `sync.parts`)."
        )
    shards = [s for s in arr.addressable_shards if s.replica_id == 0]
    return sorted(shards, key=lambda s: tuple(sl.start or 0 for sl in s.index))


def shard_start(shard) -> tuple[int, ...]:
    """Where a shard starts along each axis of its array."""
    return tuple(sl.start or 0 for sl in shard.index)


def shard_changes(bitmap, old, new, *, packed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted local flat positions set in one shard's bitmap, with the old and new bits there
    (`bitmap`, `old`, `new`: the same shard of the three arrays, `jax.Shard`s)."""
    last = old.index[-1].start or 0 if old.index else 0
    bm_last = bitmap.index[-1].start or 0 if bitmap.index else 0
    if last != bm_last * (8 if packed else 1):
        raise ValueError(f"bitmap shard {bitmap.index} does not match element shard {old.index}")
    local = _local_positions(np.asarray(bitmap.data).reshape(-1), packed)
    ovals = np.asarray(old.data).reshape(-1)[local]
    return local, ovals, np.asarray(new.data).reshape(-1)[local]


def extract_changes(bitmap: jax.Array, old: jax.Array, new: jax.Array, *, packed: bool):
    """Sorted global flat indices set in `bitmap`, with the old and new bits there.

    `bitmap` comes from `mask.visible_bitmap` (same layout as `old`/`new`, packed 8 per byte along
    the last axis when `packed`); `old` is the last sent bits, `new` the newly published bits.
    """
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"old {old.shape}/{old.dtype} and new {new.shape}/{new.dtype} differ")
    if all(len(x.sharding.device_set) == 1 for x in (bitmap, old, new)):  # no shards to walk
        local = _local_positions(np.asarray(bitmap).reshape(-1), packed)
        ovals = np.asarray(old).reshape(-1)[local]
        return LeafChanges(
            local.astype(np.int64), ovals ^ np.asarray(new).reshape(-1)[local], ovals
        )
    maps = {s.device: s for s in bitmap.addressable_shards}
    news = {s.device: s for s in new.addressable_shards}
    parts_i, parts_o, parts_n = [], [], []
    for shard in primary_shards(old):
        local, ovals, nvals = shard_changes(
            maps[shard.device], shard, news[shard.device], packed=packed
        )
        if local.size == 0:
            continue
        parts_i.append(global_index(local, shard_start(shard), shard.data.shape, old.shape))
        parts_o.append(ovals)
        parts_n.append(nvals)
    if not parts_i:
        empty = np.zeros((0,), np.dtype(old.dtype))
        return LeafChanges(np.zeros((0,), np.int64), empty, empty.copy())
    index = np.concatenate(parts_i)
    ovals, nvals = np.concatenate(parts_o), np.concatenate(parts_n)
    if index.size > 1 and not np.all(index[1:] > index[:-1]):
        # Shards split a non-leading axis: their flat ranges interleave.
        order = np.argsort(index, kind="stable")
        index, ovals, nvals = index[order], ovals[order], nvals[order]
    return LeafChanges(index, ovals ^ nvals, ovals)


def host_bits(bits: jax.Array) -> np.ndarray:
    """The full array on the host (used for dense tensors and anchors only)."""
    return np.asarray(bits)


def box_name(leaf: str, starts: tuple[int, ...]) -> str:
    """The tensor name of the block of leaf `leaf` that starts at `starts` (a part's tensor)."""
    return f"{leaf}#{','.join(str(int(s)) for s in starts)}"


def parse_box_name(name: str) -> tuple[str, tuple[int, ...]]:
    """`box_name`'s inverse: (leaf, starts). Raises ValueError on a name it did not write."""
    leaf, sep, tail = name.rpartition("#")
    try:
        starts = tuple(int(s) for s in tail.split(",")) if tail else ()
    except ValueError:
        starts = None
    if not sep or starts is None or any(s < 0 for s in starts):
        raise ValueError(f"{name!r} is not a block name (`<leaf>#<start>,<start>,...`)")
    return leaf, starts
