"""PULSESync patch codec: sparse bit-pattern patches and dense anchors as one byte string.

Layout (full spec in `docs/sync_format.md`):

    b"PSYN" | u32le header_len | blake2b-128(header) | header | bucket 0 | bucket 1 | ...

Format 3 (`CodecConfig(format=3)`; the default writes format 2, and every format stays readable)
codes a sparse tensor against the receiver's old bits (`context.py`): changed
positions as gaps between their ranks in the *context order* (elements grouped into up to five
ranges of their old exponent, the `context` cuts of the entry), values in that order as new
bits, XOR or signed steps on the ordered bit line (sign bits packed in stream `s`, `|step| - 1`
in the value planes); its header is zstd-compressed JSON that names tensors only in anchors.
Decoding a format-3 patch needs the old bits (`base`).
The rest of this docstring describes what all formats share.

Each tensor is `unchanged`, `sparse` (sorted flat indices as gaps `idx[k] - idx[k-1] - 1`, stored
at the narrowest width 1/2/4 bytes fitting the largest gap, plus values as the new bits or as
`new ^ old`, which the receiver holds exactly) or `dense` (all bits; chosen when the sparse form
would not be smaller, and for anchors). Multi-byte gaps and values are split into byte planes so
that the mostly-zero high bytes compress (PULSE's "type downscaling", SparseRL-Sync's int16 gaps;
XOR values as in HF TRL's proposals). Tensors are packed into buckets of about `bucket_bytes`;
each bucket holds nine streams `g0..g3, v0..v3, d`, each optionally a zstd frame, and carries a
blake2b-128 checksum of its stored bytes. The header (`header.py`) carries the format version,
the publishing run's id, base and new version, the digest of the base state (patches), the
tensor manifest with offsets, per-leaf digests and the digest of the whole new state.

`decode` validates everything (structure, checksums, sizes, offsets, index ranges and order) and
raises `CorruptPatchError`/`TruncatedPatchError` before returning anything; every size it reads is
bounded (by the manifest's shapes or a configured maximum) before it allocates or inflates.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np

from sparserl_jax.sync.context import (
    choose_cuts,
    context_rank,
    context_select,
    exponent_key,
    from_line,
    to_line,
)
from sparserl_jax.sync.errors import CorruptPatchError, TruncatedPatchError
from sparserl_jax.sync.extract import LeafChanges
from sparserl_jax.sync.header import (
    FORMAT_VERSION,
    GAP_WIDTHS,
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    WRITABLE_FORMATS,
    TensorSpec,
    bucket_table,
    check_run_id,
    manifest_digest,
    pack_header,
    parse_spec,
    read_header,
    stream_sizes,
    streams_of,
)
from sparserl_jax.sync.header import ITEMSIZES as ITEMSIZES  # re-exported
from sparserl_jax.sync.header import corrupt_unless as _check
from sparserl_jax.sync.header import is_uint as _int
from sparserl_jax.sync.planes import byte_planes, entropy_bytes, from_planes, uint_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How patches are encoded.

    Attributes:
      bucket_bytes: raw (pre-compression) bytes per bucket; a tensor never spans buckets.
      compression: "zstd" (each stream one zstd frame) or "none".
      zstd_level: zstd level (1..22); 1, as grail: on these byte planes level 3 is ~3x slower and
        no smaller.
      values: "auto" (per tensor, the smallest of new bits, XOR and, in format 3, signed steps on
        the ordered line, by measured byte-plane entropy), "new", "xor" or "step" (format 3).
      format: wire format written: 2 (the default) or 3 (context-coded positions, value steps,
        compact header: 30-35% fewer bytes on the bench's updates, but 2-3x slower to encode and
        apply on a CPU host, and a receiver on an accelerator copies each touched leaf's old bits
        to the host to decode it). Choose 3 where the link, not the host, is the bottleneck.
    """

    bucket_bytes: int = 64 << 20
    compression: Literal["zstd", "none"] = "zstd"
    zstd_level: int = 1
    values: Literal["auto", "new", "xor", "step"] = "auto"
    format: int = 2

    def __post_init__(self):
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        if self.compression not in ("zstd", "none"):
            raise ValueError(f"compression {self.compression!r} unknown; expected zstd or none")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in 1..22, got {self.zstd_level}")
        if self.values not in ("auto", "new", "xor", "step"):
            raise ValueError(f"values {self.values!r} unknown; expected auto, new, xor or step")
        if self.format not in WRITABLE_FORMATS:
            raise ValueError(f"format {self.format!r} unknown; expected one of {WRITABLE_FORMATS}")
        if self.values == "step" and self.format < 3:
            raise ValueError("values 'step' needs format 3")


@dataclasses.dataclass(frozen=True)
class TensorPatch:
    """A decoded, validated tensor entry. `bits` are values (new or XOR) or the dense array."""

    spec: TensorSpec
    encoding: Literal["unchanged", "sparse", "dense"]
    index: np.ndarray | None = None
    bits: np.ndarray | None = None
    xor: bool = False


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


def _gap_width(max_gap: int) -> int:
    for w in GAP_WIDTHS:
        if max_gap < 1 << (8 * w):
            return w
    raise ValueError(f"gap {max_gap} needs more than 4 bytes")


def _steps(old: np.ndarray, new: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """(sign bits packed little-endian, `|step| - 1`) of `new - old` on the ordered line."""
    step = to_line(new, itemsize) - to_line(old, itemsize)  # never 0: the bits differ
    signs = np.packbits(step < 0, bitorder="little")
    return signs, (np.abs(step) - 1).astype(uint_dtype(itemsize))


def _value_mode(ch: LeafChanges, itemsize: int, config: CodecConfig, steps=None) -> str:
    """New bits, XOR or (`steps`: format 3's `_steps`) steps: with no entropy stage new bits are
    never larger, so send them."""
    if config.values != "auto":
        return config.values
    if config.compression == "none":
        return "new"
    cost = {
        "new": entropy_bytes(byte_planes(ch.new, itemsize)),
        "xor": entropy_bytes(byte_planes(ch.delta, itemsize)),
    }
    if steps is not None:
        signs, mags = steps
        cost["step"] = signs.size + entropy_bytes(byte_planes(mags, itemsize))
    return min(cost, key=cost.get)  # ties: the first, "new"


def _sparse_v3(s: TensorSpec, ch: LeafChanges, old_bits: np.ndarray, config: CodecConfig):
    """A format-3 sparse entry's gaps (over context positions) and value streams, in that order."""
    old_bits = np.asarray(old_bits)
    if old_bits.size != s.numel or old_bits.dtype.itemsize != s.itemsize:
        raise ValueError(f"base bits of {s.name}: {old_bits.shape}/{old_bits.dtype} != {s}")
    old_bits = old_bits.reshape(-1).view(uint_dtype(s.itemsize))
    cuts = choose_cuts(old_bits, ch.old, s.dtype)
    pos = context_rank(old_bits, s.dtype, cuts, ch.index)
    if cuts:
        # Within a class positions rise with the (sorted) flat index: context order is a stable
        # sort by class, a radix sort of small ints.
        cls = np.searchsorted(cuts, exponent_key(ch.old, s.dtype), side="right").astype(np.uint8)
        order = np.argsort(cls, kind="stable")
        pos = pos[order]
        ch = LeafChanges(ch.index[order], ch.delta[order], ch.old[order])
    gaps = np.diff(pos, prepend=-1) - 1
    steps = None if config.values in ("new", "xor") else _steps(ch.old, ch.new, s.itemsize)
    mode = _value_mode(ch, s.itemsize, config, steps)
    streams = {}
    if mode == "step":
        signs, vals = steps
        streams["s"] = [signs]
    else:
        vals = ch.delta if mode == "xor" else ch.new
    for p, plane in enumerate(byte_planes(vals, s.itemsize)):
        streams[f"v{p}"] = [plane]
    return gaps, mode, streams, cuts


def _compressor(cfg: CodecConfig):
    if cfg.compression == "none":
        return None
    import zstandard

    return zstandard.ZstdCompressor(level=cfg.zstd_level)


def encode(
    *,
    kind: Literal["patch", "anchor"],
    base_version: int | None,
    new_version: int,
    specs: Sequence[TensorSpec],
    changes: Mapping[str, LeafChanges] | None,
    dense_bits: Callable[[str], np.ndarray],
    leaf_digests: Mapping[str, np.ndarray],
    config: CodecConfig,
    run_id: str | None = None,
    base_digest: str | None = None,
    base_bits: Callable[[str], np.ndarray] | None = None,
) -> bytes:
    """Encode one patch (`changes` per leaf) or anchor (`changes=None`: every leaf dense).

    `dense_bits(name)` returns a leaf's full new bits on the host; it is called only for leaves
    sent dense. `base_bits(name)` returns a leaf's full *old* bits on the host (the receiver's
    context); format-3 patches call it for leaves sent sparse. `leaf_digests` are the per-leaf
    digests of the new published state. `run_id` names the publishing run and `base_digest`
    (patches only) is the `state_digest` of the state the patch applies to; a receiver checks
    both before decoding (None: not stated).
    """
    if kind == "anchor" and (changes is not None or base_version is not None or base_digest):
        raise ValueError("an anchor has no base_version, base_digest or changes")
    if kind == "patch" and (changes is None or base_version is None):
        raise ValueError("a patch needs base_version and changes")
    if run_id is not None:
        check_run_id(run_id)
    fmt = config.format
    if fmt >= 3 and kind == "patch" and base_bits is None:
        raise ValueError("a format-3 patch needs base_bits (the receiver's old bits)")
    entries: list[tuple[dict, dict[str, list[np.ndarray]]]] = []
    for s in specs:
        entry: dict = {}
        if fmt < 3 or kind == "anchor":  # format-3 patches carry a manifest digest instead
            entry.update(name=s.name, shape=list(s.shape), dtype=s.dtype)
        streams: dict[str, list[np.ndarray]] = {}
        ch = None if changes is None else changes[s.name]
        sparse = None
        if ch is not None and ch.count == 0:
            entry["encoding"] = "unchanged"
        elif ch is not None and ch.count * (1 + s.itemsize) < s.numel * s.itemsize:
            gaps = np.diff(ch.index, prepend=-1) - 1
            width = _gap_width(int(gaps.max()))
            if ch.count * (width + s.itemsize) < s.numel * s.itemsize:
                sparse = (gaps, width)
        if sparse is not None and fmt >= 3:
            gaps, mode, vstreams, cuts = _sparse_v3(s, ch, base_bits(s.name), config)
            width = _gap_width(int(gaps.max()))
            entry.update(encoding="sparse", nnz=ch.count, gap_width=width, values=mode)
            entry["context"] = cuts
            for p, plane in enumerate(byte_planes(gaps, width)):
                streams[f"g{p}"] = [plane]
            streams.update(vstreams)
        elif sparse is not None:
            gaps, width = sparse
            mode = _value_mode(ch, s.itemsize, config)
            vals = ch.delta if mode == "xor" else ch.new
            entry.update(encoding="sparse", nnz=ch.count, gap_width=width, values=mode)
            for p, plane in enumerate(byte_planes(gaps, width)):
                streams[f"g{p}"] = [plane]
            for p, plane in enumerate(byte_planes(vals, s.itemsize)):
                streams[f"v{p}"] = [plane]
        elif entry.get("encoding") is None:
            dense = np.asarray(dense_bits(s.name))
            if dense.shape != s.shape or dense.dtype.itemsize != s.itemsize:
                raise ValueError(f"dense bits of {s.name}: {dense.shape}/{dense.dtype} != {s}")
            entry["encoding"] = "dense"
            streams["d"] = [
                np.ascontiguousarray(dense.astype(uint_dtype(s.itemsize))).view(np.uint8)
            ]
        entry["digest"] = [int(v) for v in np.asarray(leaf_digests[s.name], np.uint32)]
        entries.append((entry, streams))

    cctx = _compressor(config)
    buckets_meta, bucket_blobs = [], []
    manifest: list[dict] = []

    names = streams_of(fmt)

    def flush(group):
        raw = {k: [] for k in names}
        for entry, streams in group:
            for k, chunks in streams.items():
                offset = sum(c.size for c in raw[k])
                raw[k].extend(chunks)
                if fmt < 3:  # format 3: segments tile each stream in manifest order
                    entry.setdefault("offsets", {})[k] = offset
            if entry["encoding"] != "unchanged" or fmt < 3:
                entry["bucket"] = len(buckets_meta)
            manifest.append(entry)
        stored, sizes = [], []
        for k in names:
            data = b"".join(c.tobytes() for c in raw[k])
            comp = data if cctx is None or not data else cctx.compress(data)
            stored.append(comp)
            sizes.append([len(comp), len(data)])
        blob = b"".join(stored)
        buckets_meta.append(
            {
                "size": len(blob),
                "streams": sizes,
                "checksum": hashlib.blake2b(blob, digest_size=16).hexdigest(),
            }
        )
        bucket_blobs.append(blob)

    group, group_bytes = [], 0
    for entry, streams in entries:
        nbytes = sum(c.size for chunks in streams.values() for c in chunks)
        if group and group_bytes + nbytes > config.bucket_bytes:
            flush(group)
            group, group_bytes = [], 0
        group.append((entry, streams))
        group_bytes += nbytes
    if group:
        flush(group)

    header = {
        "format": fmt,
        "kind": kind,
        "run_id": run_id,
        "base_version": base_version,
        "base_digest": base_digest,
        "new_version": new_version,
        "compression": config.compression,
        "state_digest": state_digest(specs, leaf_digests),
        "tensors": manifest,
        "buckets": buckets_meta,
    }
    if fmt >= 3:
        header["manifest"] = manifest_digest(specs) if kind == "patch" else None
    return b"".join([pack_header(header), *bucket_blobs])


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
        import zstandard

        dctx = dctx or zstandard.ZstdDecompressor()
        # The frame's own size claim is checked before anything is allocated: given a size in
        # its header, `decompress` allocates that much whatever `max_output_size` says.
        try:
            claimed = zstandard.frame_content_size(chunk)  # -1: not stated
        except Exception as e:  # zstandard.ZstdError and friends
            raise CorruptPatchError(f"bucket {b} stream {k}: zstd frame invalid: {e}") from e
        said = "states no size" if claimed == -1 else f"claims {claimed} bytes"
        _check(
            claimed == raw, f"bucket {b} stream {k}: zstd frame {said}, the manifest allows {raw}"
        )
        try:
            data = dctx.decompress(chunk, max_output_size=raw)
        except Exception as e:  # zstandard.ZstdError and friends
            raise CorruptPatchError(f"bucket {b} stream {k}: zstd frame invalid: {e}") from e
        _check(len(data) == raw, f"bucket {b} stream {k}: {len(data)} bytes, expected {raw}")
        out[k] = data
    return out


def _sparse_v3_values(
    s: TensorSpec, pos: np.ndarray, vals: np.ndarray, signs, mode: str, old_full, cuts: list
) -> tuple[np.ndarray, np.ndarray]:
    """Flat-sorted (index, new bits) of a format-3 sparse entry, given the leaf's old bits."""
    old_full = np.asarray(old_full).reshape(-1)
    if old_full.size != s.numel or old_full.dtype.itemsize != s.itemsize:
        raise ValueError(f"base bits of {s.name}: {old_full.shape}/{old_full.dtype} != {s}")
    old_full = old_full.view(uint_dtype(s.itemsize))
    index = context_select(old_full, s.dtype, cuts, pos)
    old = old_full[index]
    if mode == "new":
        new = vals
    elif mode == "xor":
        new = old ^ vals
    else:
        neg = np.unpackbits(np.asarray(signs), bitorder="little")
        _check(not neg[pos.size :].any(), f"tensor {s.name}: sign stream padding is not zero")
        mag = vals.astype(np.int64) + 1
        line = to_line(old, s.itemsize) + np.where(neg[: pos.size] != 0, -mag, mag)
        top = 1 << (8 * s.itemsize - 1)
        _check(
            bool(np.all((line >= -top) & (line < top))),
            f"tensor {s.name}: a step leaves the range of {s.dtype} bit patterns",
        )
        new = from_line(line, s.itemsize)
    order = np.argsort(index, kind="stable")
    return index[order], new[order]


def decode(
    blob: bytes,
    *,
    expect: Sequence[TensorSpec] | None = None,
    base: Callable[[str], np.ndarray] | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_decoded_bytes: int | None = None,
) -> Patch:
    """Parse and fully validate a patch. Nothing is returned unless every check passes.

    `expect`: the receiver's manifest; the patch must list exactly these tensors in this order.
    `base(name)`: the receiver's current bits of a leaf on the host (any shape with its element
    count, its dtype's width); a format-3 patch is coded against them, so decoding one needs
    both `expect` and `base` (ValueError otherwise), and its sparse tensors come back as flat
    sorted indices with the *new* bits (`xor=False`). Every size read from the blob is bounded
    before it is used: `header_len` by `max_header_bytes`, each stream's raw size by the
    manifest's shapes (`expect`'s when given), their sum by `max_decoded_bytes` (None: no cap
    beyond the manifest), each zstd frame's claim by its stream's raw size.
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
            index = np.cumsum(gaps.astype(np.int64) + 1) - 1
            if contextual:  # positions in context order, values in that order
                signs = take(entry, s.name, "s", (nnz + 7) // 8) if mode == "step" else None
                _check(index[-1] < s.numel, f"tensor {s.name}: positions out of [0, {s.numel})")
                old_full = base(s.name)
                cuts = entry["context"]  # checked by stream_sizes
                index, bits = _sparse_v3_values(s, index, vals, signs, mode, old_full, cuts)
                out[s.name] = TensorPatch(s, "sparse", index=index, bits=bits)
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
