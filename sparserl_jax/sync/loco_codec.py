"""PULSELoCo payload codec: one replica's sent entries (positions and values) as one byte string.

    b"PLC1" | u8 value itemsize | u8 gap width | u8 number of cuts | u8 position mode
            | u32 count | u32 num_params | cuts (one byte each) | u32 stored size of each stream
            | streams

Positions are entropy-coded instead of travelling as int32 indices or the raw bitmask: the sorted
flat indices of the sent entries are ranked in the *context order* of `order.py` (the elements
grouped into at most five classes of their low-precision exponent in the receiver's θ, cuts
chosen per payload by `classes.choose_cuts`) and sent as gaps (`planes.gaps_of`) in byte planes
of the narrowest width that holds the largest (position mode 0), or, where that is smaller, as
the gate packed 8 entries to a byte in the same order (mode 1; zstd codes gaps within ~1.5% of
the gate's entropy at 2-15% density but drifts 10-30% above it from ~30%, where the packed gate
stays within 1%). Every replica holds the global θ bit for bit, so the receiver rebuilds the same
classes (`order.context_select`). The gate fires where |s| reaches about half a bf16 ulp of θ,
and the ulp is set by θ's exponent, so the classes separate entries of different firing rates.
Values follow as their bit patterns (uint16 for bf16 values, uint32 for fp32) in the same order,
in byte planes. Each stream (position streams, then value planes) is one zstd frame, or raw bytes
where zstd would not make it smaller (stored size == raw size).

`decode_payload` checks the structure, every size and the range of every position before it
inflates or returns anything, and raises `CorruptPatchError` / `TruncatedPatchError`.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from sparserl_jax.sync.classes import (
    MAX_CUTS,
    choose_cuts,
    class_mask_bits,
    exponent_key,
    max_exponent,
)
from sparserl_jax.sync.decode import inflate
from sparserl_jax.sync.errors import TruncatedPatchError
from sparserl_jax.sync.header import corrupt_unless as _check
from sparserl_jax.sync.order import context_rank, context_select
from sparserl_jax.sync.planes import (
    GAP_WIDTHS,
    byte_planes,
    from_planes,
    gap_width,
    gaps_of,
    positions_of,
    uint_dtype,
)

__all__ = [
    "Decoded",
    "Encoded",
    "MAGIC",
    "context_entropy_bits",
    "decode_payload",
    "encode_payload",
    "gate_entropy_bits",
]

MAGIC = b"PLC1"
_HEAD = struct.Struct("<4sBBBBII")
_SIZE = struct.Struct("<I")
VALUE_ITEMSIZES = (2, 4)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """An encoded payload and how its bytes split (header = the rest)."""

    blob: bytes
    position_bytes: int  # stored gap streams
    value_bytes: int  # stored value streams


@dataclasses.dataclass(frozen=True)
class Decoded:
    """A decoded payload: sorted flat indices (int64), their value bits, the stored split."""

    index: np.ndarray
    bits: np.ndarray
    position_bytes: int
    value_bytes: int


def _cuts(context: np.ndarray | None, dtype: str, index: np.ndarray) -> list[int]:
    if context is None or index.size == 0:
        return []
    return choose_cuts(context, context[index], dtype)


def encode_payload(
    index: np.ndarray,
    value_bits: np.ndarray,
    *,
    num_params: int,
    context: np.ndarray | None = None,
    context_dtype: str = "bfloat16",
    zstd_level: int = 1,
) -> Encoded:
    """Encode the entries at sorted unique flat `index` with values `value_bits` (uint16/uint32).

    `context`: the receiver's low-precision bits of θ (`[num_params]`, of `context_dtype`), or
    None for positions in flat order.
    """
    index = np.asarray(index, np.int64)
    value_bits = np.asarray(value_bits)
    itemsize = value_bits.dtype.itemsize
    if itemsize not in VALUE_ITEMSIZES or value_bits.shape != index.shape:
        raise ValueError(
            f"value bits must be uint16/uint32 aligned with index; got {value_bits.dtype}"
            f"{value_bits.shape} for {index.shape} indices"
        )
    if index.size and (index[0] < 0 or index[-1] >= num_params or np.any(np.diff(index) <= 0)):
        raise ValueError(f"index must be sorted, unique and in [0, {num_params})")
    if context is not None and context.shape != (num_params,):
        raise ValueError(f"context must have shape ({num_params},), got {context.shape}")
    cuts = _cuts(context, context_dtype, index)
    pos = context_rank(context, context_dtype, cuts, index) if cuts else index
    order = np.argsort(pos, kind="stable")
    pos = pos[order]
    gaps = gaps_of(pos)
    width = gap_width(int(gaps.max())) if gaps.size else 0
    by_gaps = [_deflate(x.tobytes(), zstd_level) for x in byte_planes(gaps, width or 1)][:width]
    # Where many entries fire, zstd codes the packed gate (nearly uniform bytes) closer to its
    # entropy than the gaps (few distinct small values, which its matcher handles poorly).
    mask = np.zeros(-(-num_params // 8) * 8, bool)
    mask[pos] = True
    by_mask = [_deflate(np.packbits(mask, bitorder="little").tobytes(), zstd_level)]
    mode = int(sum(map(len, by_mask)) < sum(map(len, by_gaps)))
    positions = by_mask if mode else by_gaps
    values = [
        _deflate(x.tobytes(), zstd_level)
        for x in byte_planes(value_bits[order].view(uint_dtype(itemsize)), itemsize)
    ]
    stored = positions + values
    head = _HEAD.pack(
        MAGIC, itemsize, 0 if mode else width, len(cuts), mode, index.size, num_params
    )
    sizes = b"".join(_SIZE.pack(len(x)) for x in stored)
    blob = b"".join([head, bytes(cuts), sizes, *stored])
    return Encoded(blob, sum(map(len, positions)), sum(map(len, values)))


def _deflate(raw: bytes, level: int) -> bytes:
    if not raw:
        return raw
    import zstandard

    frame = zstandard.ZstdCompressor(level=level).compress(raw)
    return frame if len(frame) < len(raw) else raw  # equal sizes mean "stored raw"


def decode_payload(
    blob: bytes,
    *,
    num_params: int,
    value_itemsize: int,
    context: np.ndarray | None = None,
    context_dtype: str = "bfloat16",
) -> Decoded:
    """The inverse of `encode_payload`: validated, entries sorted by flat index."""
    blob = bytes(blob)
    if len(blob) < _HEAD.size:
        raise TruncatedPatchError(f"loco payload: {len(blob)} bytes, shorter than its header")
    magic, itemsize, width, ncuts, mode, count, params = _HEAD.unpack_from(blob)
    _check(magic == MAGIC, f"loco payload: bad magic {magic!r}")
    _check(params == num_params, f"loco payload for {params} parameters, not {num_params}")
    _check(
        itemsize == value_itemsize,
        f"loco payload: value itemsize {itemsize}, expected {value_itemsize}",
    )
    _check(count <= num_params, f"loco payload: {count} entries exceed {num_params} parameters")
    _check(
        mode in (0, 1) and (width == 0) == (count == 0 or mode == 1)
        and (width == 0 or width in GAP_WIDTHS),
        f"loco payload: bad position mode {mode} / gap width {width} for {count} entries",
    )  # fmt: skip
    _check(ncuts <= MAX_CUTS, f"loco payload: {ncuts} cuts, at most {MAX_CUTS}")
    raws = [-(-num_params // 8)] if mode else [count] * width
    raws += [count] * itemsize
    table = _HEAD.size + ncuts + _SIZE.size * len(raws)
    if len(blob) < table:
        raise TruncatedPatchError(f"loco payload: {len(blob)} bytes, its tables need {table}")
    cuts = list(blob[_HEAD.size : _HEAD.size + ncuts])
    if cuts:
        _check(context is not None, "loco payload: context-coded, but no context was given")
        top = max_exponent(context_dtype)
        _check(
            all(0 < c <= top for c in cuts) and cuts == sorted(set(cuts)),
            f"loco payload: bad context cuts {cuts}",
        )
    sizes = [_SIZE.unpack_from(blob, _HEAD.size + ncuts + 4 * k)[0] for k in range(len(raws))]
    if len(blob) < table + sum(sizes):
        raise TruncatedPatchError(f"loco payload: {len(blob)} bytes, expected {table + sum(sizes)}")
    _check(
        len(blob) == table + sum(sizes),
        f"loco payload: {len(blob) - table - sum(sizes)} extra bytes",
    )
    planes, at = [], table
    for k, (size, raw) in enumerate(zip(sizes, raws, strict=True)):
        chunk = blob[at : at + size]
        at += size
        _check(size <= raw, f"loco payload stream {k}: {size} bytes, at most {raw}")
        data = chunk if size == raw else inflate(chunk, raw, f"loco payload stream {k}")
        planes.append(np.frombuffer(data, np.uint8))
    npos = len(raws) - itemsize
    bits = from_planes(planes[npos:], itemsize) if count else np.zeros(0, uint_dtype(itemsize))
    if mode:
        mask = np.unpackbits(planes[0], bitorder="little")
        pos = np.flatnonzero(mask[:num_params])
        _check(
            pos.size == count and not mask[num_params:].any(),
            f"loco payload: the packed positions hold {int(mask.sum())} entries, not {count}",
        )
    else:
        pos = positions_of(from_planes(planes[:npos], width)) if count else np.zeros(0, np.int64)
        _check(
            count == 0 or pos[-1] < num_params, f"loco payload: positions out of [0, {num_params})"
        )
    index = context_select(context, context_dtype, cuts, pos) if cuts else pos
    order = np.argsort(index, kind="stable")
    return Decoded(index[order], bits[order], sum(sizes[:npos]), sum(sizes[npos:]))


def gate_entropy_bits(count: int, num_params: int) -> float:
    """`P * H2(count / P)`: the empirical entropy of a gate with `count` of P entries set."""
    return class_mask_bits(np.array([num_params]), np.array([count]))


def context_entropy_bits(context: np.ndarray, index: np.ndarray, dtype: str = "bfloat16") -> float:
    """The gate's empirical entropy given the receiver's context: `sum_e n_e * H2(k_e / n_e)`
    over the exponents e of `context` (θ's low-precision bits), k_e of the n_e set. The bound
    for a coder that knows each exponent's firing rate (the payload's five classes approach it)."""
    key = exponent_key(context, dtype)
    n_e = np.bincount(key, minlength=256)
    k_e = np.bincount(key[np.asarray(index, np.int64)], minlength=256)
    return class_mask_bits(n_e, k_e)
