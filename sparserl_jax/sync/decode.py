"""PULSESync patch decoding: `decode` turns a blob (any format, 1-3) into a validated `Patch`.

It checks everything (structure, checksums, sizes, offsets, index ranges and order) and raises
`CorruptPatchError`/`TruncatedPatchError` before returning anything; every size it reads is
bounded (by the manifest's shapes or a configured maximum) before it allocates or inflates. The
layout is `codec`'s (and `docs/sync_format.md`); `codec` re-exports what is here.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np

from sparserl_jax.sync.errors import CorruptPatchError, TruncatedPatchError
from sparserl_jax.sync.header import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    TensorSpec,
    bucket_table,
    manifest_digest,
    parse_spec,
    read_header,
    stream_sizes,
    streams_of,
)
from sparserl_jax.sync.header import corrupt_unless as _check
from sparserl_jax.sync.header import is_uint as _int
from sparserl_jax.sync.order import ContextCache, context_select
from sparserl_jax.sync.planes import from_planes, positions_of, uint_dtype
from sparserl_jax.sync.values import from_steps

__all__ = ["Patch", "TensorPatch", "decode", "state_digest"]


@dataclasses.dataclass(frozen=True)
class TensorPatch:
    """A decoded, validated tensor entry. `bits` are values (new or XOR) or the dense array;
    `old`: a format-3 sparse entry's old bits at `index` (what it was coded against)."""

    spec: TensorSpec
    encoding: Literal["unchanged", "sparse", "dense"]
    index: np.ndarray | None = None
    bits: np.ndarray | None = None
    xor: bool = False
    old: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Patch:
    """A decoded patch: header fields plus one `TensorPatch` per manifest entry (in order)."""

    kind: Literal["patch", "anchor"]
    base_version: int | None
    new_version: int
    state_digest: str
    leaf_digests: dict[str, np.ndarray]
    tensors: dict[str, TensorPatch]
    run_id: str | None = None
    base_digest: str | None = None
    format: int = FORMAT_VERSION


def state_digest(specs: Sequence[TensorSpec], leaf_digests: Mapping[str, np.ndarray]) -> str:
    """blake2b-128 over every leaf's name, dtype, shape and two digest lanes, in manifest order."""
    h = hashlib.blake2b(digest_size=16)
    for s in specs:
        lanes = np.asarray(leaf_digests[s.name], np.uint32)
        h.update(f"{s.name}|{s.dtype}|{','.join(map(str, s.shape))}|".encode())
        h.update(lanes.astype("<u4").tobytes())
    return h.hexdigest()


def _split_bucket(
    blob, start: int, meta: dict, b: int, compression: str, names: tuple[str, ...]
) -> dict[str, bytes]:
    size, streams = meta["size"], meta["streams"]
    stored = bytes(blob[start : start + size])
    _check(
        hashlib.blake2b(stored, digest_size=16).hexdigest() == meta.get("checksum"),
        f"bucket {b}: checksum mismatch (payload bytes corrupted)",
    )
    out, pos = {}, 0
    dctx = None
    for k, (s, raw) in zip(names, streams, strict=True):
        chunk = stored[pos : pos + s]
        pos += s
        if compression == "none" or raw == 0:
            _check(s == raw, f"bucket {b} stream {k}: stored {s} != raw {raw} bytes")
            out[k] = chunk
            continue
        if dctx is None:
            import zstandard

            dctx = zstandard.ZstdDecompressor()
        out[k] = inflate(chunk, raw, f"bucket {b} stream {k}", dctx)
    return out


def inflate(frame: bytes, raw: int, what: str, dctx=None) -> bytes:
    """One zstd frame that must inflate to exactly `raw` bytes (`CorruptPatchError` otherwise).

    The frame's own size claim is checked before anything is allocated: given a size in its
    header, `decompress` allocates that much whatever `max_output_size` says. `dctx`: a
    `zstandard.ZstdDecompressor` to reuse (one is made when None).
    """
    import zstandard

    try:
        claimed = zstandard.frame_content_size(frame)  # -1: not stated
    except Exception as e:  # zstandard.ZstdError and friends
        raise CorruptPatchError(f"{what}: zstd frame invalid: {e}") from e
    said = "states no size" if claimed == -1 else f"claims {claimed} bytes"
    _check(claimed == raw, f"{what}: zstd frame {said}, the manifest allows {raw}")
    try:
        dctx = dctx or zstandard.ZstdDecompressor()
        data = dctx.decompress(frame, max_output_size=raw)
    except Exception as e:  # zstandard.ZstdError and friends
        raise CorruptPatchError(f"{what}: zstd frame invalid: {e}") from e
    _check(len(data) == raw, f"{what}: {len(data)} bytes, expected {raw}")
    return data


def base_bits_of(s: TensorSpec, old_bits) -> np.ndarray:
    """A leaf's old bits (a format-3 entry's context) as a flat uint array, checked against `s`:
    any shape with its element count, its dtype's width (ValueError otherwise)."""
    old_bits = np.asarray(old_bits)
    if old_bits.size != s.numel or old_bits.dtype.itemsize != s.itemsize:
        raise ValueError(f"base bits of {s.name}: {old_bits.shape}/{old_bits.dtype} != {s}")
    return old_bits.reshape(-1).view(uint_dtype(s.itemsize))


def _sparse_v3_values(
    s: TensorSpec,
    pos: np.ndarray,
    vals: np.ndarray,
    signs,
    mode: str,
    old_full,
    cuts: list,
    context: ContextCache | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat-sorted (index, new bits, old bits) of a format-3 sparse entry, given the leaf's old
    bits: the codec's stages 4 and 5 (`order.py`, `values.py`) inverted."""
    old_full = base_bits_of(s, old_full)
    ranges = None if context is None else context.ranges(s.name, old_full, s.numel, s.dtype, cuts)
    index = context_select(old_full, s.dtype, cuts, pos, ranges)
    old = old_full[index]
    if mode == "new":
        new = vals
    elif mode == "xor":
        new = old ^ vals
    else:
        new = from_steps(old, vals, signs, s.itemsize, f"tensor {s.name}")
    order = np.argsort(index, kind="stable")
    return index[order], new[order], old[order]


def decode(
    blob: bytes,
    *,
    expect: Sequence[TensorSpec] | None = None,
    base: Callable[[str], np.ndarray] | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_decoded_bytes: int | None = None,
    context: ContextCache | None = None,
) -> Patch:
    """Parse and fully validate a patch. Nothing is returned unless every check passes.

    `expect`: the receiver's manifest; the patch must list exactly these tensors in this order.
    `base(name)`: the receiver's current bits of a leaf on the host (any shape with its element
    count, its dtype's width); a format-3 patch is coded against them, so decoding one needs
    both `expect` and `base` (ValueError otherwise), and its sparse tensors come back as flat
    sorted indices with the *new* bits (`xor=False`). Every size read from the blob is bounded
    before it is used: `header_len` by `max_header_bytes`, each stream's raw size by the
    manifest's shapes (`expect`'s when given), their sum by `max_decoded_bytes` (None: no cap
    beyond the manifest), each zstd frame's claim by its stream's raw size. `context`: the
    receiver's `ContextCache` for `base`'s bits (format 3), used and extended, never advanced.
    """
    header = read_header(blob, max_header_bytes=max_header_bytes)
    fmt = header["format"]
    kind, base_v, new = header["kind"], header.get("base_version"), header.get("new_version")
    _check(_int(new), f"bad new_version {new!r}")
    if kind == "anchor":
        _check(base_v is None, f"anchor with base_version {base_v!r}")
    else:
        _check(_int(base_v) and base_v < new, f"bad base_version {base_v!r} for {new}")
    compression = header.get("compression")
    _check(compression in ("zstd", "none"), f"compression {compression!r} unknown")
    tensors, buckets = header.get("tensors"), header.get("buckets")
    _check(isinstance(tensors, list) and isinstance(buckets, list), "manifest or buckets missing")
    contextual = fmt >= 3 and kind == "patch"
    if contextual:  # tensors are the receiver's: named by the manifest digest only
        if expect is None or base is None:
            raise ValueError("decoding a format-3 patch needs expect= and base= (the receiver's)")
        _check(
            header["manifest"] == manifest_digest(expect) and len(tensors) == len(expect),
            f"manifest does not match the receiver's tensors (digest {header['manifest']}, "
            f"{len(tensors)} entries; the receiver has {manifest_digest(expect)}, {len(expect)})",
        )
        for i, e in enumerate(tensors):
            _check(isinstance(e, dict), f"manifest entry {i} is not an object")
        specs = list(expect)
    else:
        specs = [parse_spec(e, i) for i, e in enumerate(tensors)]
    _check(len({s.name for s in specs}) == len(specs), "duplicate tensor names in manifest")
    if expect is not None and list(expect) != specs:
        got = {(s.name, s.shape, s.dtype) for s in specs}
        want = {(s.name, s.shape, s.dtype) for s in expect}
        raise CorruptPatchError(
            f"manifest does not match the receiver's tensors: unexpected {sorted(got - want)[:3]}, "
            f"missing {sorted(want - got)[:3]}"
        )
    names = streams_of(fmt)
    need = stream_sizes(tensors, specs, kind, len(buckets), fmt)
    total = sum(sum(n.values()) for n in need)
    _check(
        max_decoded_bytes is None or total <= max_decoded_bytes,
        f"patch decodes to {total} bytes, more than the maximum of {max_decoded_bytes}",
    )
    for b, meta in enumerate(buckets):
        _, table = bucket_table(meta, b, fmt)
        for k, (_, raw), n in zip(names, table, need[b].values(), strict=True):
            _check(raw == n, f"bucket {b} stream {k}: header says {raw} raw bytes, its tensors {n}")

    pos = PREFIX_BYTES + int.from_bytes(blob[4:8], "little")
    end = pos + sum(m["size"] for m in buckets)
    if len(blob) < end:
        raise TruncatedPatchError(f"patch has {len(blob)} bytes, its header describes {end}")
    _check(len(blob) == end, f"patch has {len(blob) - end} trailing bytes")
    streams = []
    for b, meta in enumerate(buckets):
        streams.append(_split_bucket(blob, pos, meta, b, compression, names))
        pos += meta["size"]

    used = [dict.fromkeys(names, 0) for _ in buckets]

    def take(entry: dict, name: str, k: str, n: int) -> np.ndarray:
        b = entry["bucket"]
        off = used[b][k] if fmt >= 3 else entry["offsets"].get(k)
        # Segments must tile each stream in manifest order: no gaps, no overlaps, no leftovers.
        _check(off == used[b][k] and _int(off), f"tensor {name}: stream {k} offset {off!r} != "
               f"{used[b][k]}")  # fmt: skip
        data = streams[b][k]
        _check(off + n <= len(data), f"tensor {name}: stream {k} too short")
        used[b][k] = off + n
        return np.frombuffer(data, np.uint8, count=n, offset=off)

    out: dict[str, TensorPatch] = {}
    digests: dict[str, np.ndarray] = {}
    for entry, s in zip(tensors, specs, strict=True):
        d = entry.get("digest")
        _check(
            isinstance(d, list) and len(d) == 2 and all(_int(v) and v < 2**32 for v in d),
            f"tensor {s.name}: bad digest {d!r}",
        )
        digests[s.name] = np.asarray(d, np.uint32)
        enc = entry["encoding"]
        if enc == "unchanged":
            out[s.name] = TensorPatch(s, "unchanged")
        elif enc == "dense":
            raw = take(entry, s.name, "d", s.numel * s.itemsize)
            bits = raw.view(uint_dtype(s.itemsize)).reshape(s.shape)
            out[s.name] = TensorPatch(s, "dense", bits=bits)
        else:  # sparse; nnz, gap_width and values were checked by stream_sizes
            nnz, width, mode = entry["nnz"], entry["gap_width"], entry["values"]
            gaps = from_planes([take(entry, s.name, f"g{p}", nnz) for p in range(width)], width)
            vals = from_planes(
                [take(entry, s.name, f"v{p}", nnz) for p in range(s.itemsize)], s.itemsize
            )
            index = positions_of(gaps)
            if contextual:  # positions in context order, values in that order
                signs = take(entry, s.name, "s", (nnz + 7) // 8) if mode == "step" else None
                _check(index[-1] < s.numel, f"tensor {s.name}: positions out of [0, {s.numel})")
                old_full = base(s.name)
                cuts = entry["context"]  # checked by stream_sizes
                index, bits, old = _sparse_v3_values(
                    s, index, vals, signs, mode, old_full, cuts, context
                )
                out[s.name] = TensorPatch(s, "sparse", index=index, bits=bits, old=old)
                continue
            _check(
                index[-1] < s.numel and (nnz == 1 or bool(np.all(index[1:] > index[:-1]))),
                f"tensor {s.name}: indices out of range [0, {s.numel})",
            )
            out[s.name] = TensorPatch(s, "sparse", index=index, bits=vals, xor=mode == "xor")
    for b, u in enumerate(used):
        for k in names:
            _check(
                u[k] == len(streams[b][k]),
                f"bucket {b} stream {k}: {len(streams[b][k]) - u[k]} unused bytes",
            )
    _check(
        state_digest(specs, digests) == header.get("state_digest"),
        "state digest does not match the per-leaf digests",
    )
    return Patch(
        kind,
        base_v,
        new,
        header["state_digest"],
        digests,
        out,
        run_id=header["run_id"],
        base_digest=header["base_digest"],
        format=fmt,
    )
