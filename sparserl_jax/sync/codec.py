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

`decode` (in `decode.py`, re-exported here) validates everything (structure, checksums, sizes,
offsets, index ranges and order) and raises `CorruptPatchError`/`TruncatedPatchError` before
returning anything; every size it reads is bounded before it allocates or inflates.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np

from sparserl_jax.sync.context import context_order, exponent_histogram, to_line
from sparserl_jax.sync.cuts import CUT_SLACK, best_cuts, cut_counts, keeps_cuts
from sparserl_jax.sync.decode import Patch as Patch  # re-exported
from sparserl_jax.sync.decode import TensorPatch as TensorPatch
from sparserl_jax.sync.decode import base_bits_of, state_digest
from sparserl_jax.sync.decode import decode as decode
from sparserl_jax.sync.extract import LeafChanges
from sparserl_jax.sync.header import ITEMSIZES as ITEMSIZES  # re-exported
from sparserl_jax.sync.header import (
    WRITABLE_FORMATS,
    TensorSpec,
    check_run_id,
    manifest_digest,
    pack_header,
    streams_of,
)
from sparserl_jax.sync.header import read_header as read_header
from sparserl_jax.sync.held import ContextCache
from sparserl_jax.sync.planes import (
    GAP_WIDTHS,
    byte_planes,
    entropy_bytes,
    gap_width,
    gaps_of,
    uint_dtype,
)

# Values sampled per tensor to choose its value mode: on the bench's updates the chosen mode's
# estimate is 40-50% below the next one at both learning rates, far beyond this sample's error.
MODE_SAMPLE = 1 << 12


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
        compact header: 30-35% fewer bytes on the bench's updates, but on a CPU host ~1.5x
        slower to encode and 2-3x slower to apply, and a receiver holds a host copy of the
        published bits to decode against). Choose 3 where the link, not the host, is the
        bottleneck.
      cut_slack: format 3: a leaf keeps its last context cuts while their mask costs at most
        this fraction more than one class per exponent (`cuts.choose_cuts`); 0 (the default)
        picks the best cuts every version. On the bench 0.05 encodes 5-9% faster (no cut changes,
        which cost both ends a pass over the leaf, and no search for the best) for 2% (lr 1e-6)
        to 5% (lr 1e-5) more bytes.
    """

    bucket_bytes: int = 64 << 20
    compression: Literal["zstd", "none"] = "zstd"
    zstd_level: int = 1
    values: Literal["auto", "new", "xor", "step"] = "auto"
    format: int = 2
    cut_slack: float = CUT_SLACK

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
        if not (isinstance(self.cut_slack, int | float) and 0 <= self.cut_slack < 1):
            raise ValueError(f"cut_slack must be a number in [0, 1), got {self.cut_slack!r}")
        if self.values == "step" and self.format < 3:
            raise ValueError("values 'step' needs format 3")


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
        "new": entropy_bytes(ch.new, itemsize, MODE_SAMPLE),
        "xor": entropy_bytes(ch.delta, itemsize, MODE_SAMPLE),
    }
    if steps is not None:
        signs, mags = steps
        cost["step"] = signs.size + entropy_bytes(mags, itemsize, MODE_SAMPLE)
    return min(cost, key=cost.get)  # ties: the first, "new"


def _plan_cuts(
    leaves: Sequence[tuple[TensorSpec, LeafChanges, np.ndarray]],
    config: CodecConfig,
    context: ContextCache | None,
    held: Mapping[str, list[int]] | None,
) -> dict[str, list[int]]:
    """Format 3: the cuts of each `(spec, changes, old bits)`: the leaf's `held` (last) ones
    where `config.cut_slack` keeps them, else the best, by one dynamic program over every leaf
    (`cuts.best_cuts`). Exponent histograms come from `context` when given."""
    plan, todo = {}, []
    for s, ch, old in leaves:
        if context is None:
            counts = exponent_histogram(old, s.dtype)
        else:
            counts = context.histogram(s.name, old, s.dtype)
        nk = cut_counts(old, ch.old, s.dtype, counts=counts)
        prefer = None if held is None else held.get(s.name)
        if nk is None:
            plan[s.name] = []
        elif keeps_cuts(*nk, prefer, config.cut_slack):
            plan[s.name] = list(prefer)
        else:
            todo.append((s.name, nk))
    plan.update(zip([n for n, _ in todo], best_cuts([nk for _, nk in todo]), strict=True))
    return plan


def _sparse_v3(
    s: TensorSpec,
    ch: LeafChanges,
    old_bits: np.ndarray,
    config: CodecConfig,
    cuts: list[int],
    context: ContextCache | None = None,
):
    """A format-3 sparse entry's gaps (over context positions) and value streams, in that order,
    for `cuts` over `old_bits` (`decode.base_bits_of`). `context`: the encoder's held class bitmaps
    (`ContextCache`), used and extended."""
    # Within a class positions rise with the (sorted) flat index: context order is a stable
    # sort by class.
    ranges = None if context is None else context.ranges(s.name, old_bits, s.dtype, cuts)
    order, pos = context_order(old_bits, s.dtype, cuts, ch.index, ranges, changed_old=ch.old)
    if cuts:
        ch = LeafChanges(ch.index[order], ch.delta[order], ch.old[order])
    gaps = gaps_of(pos)
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
    return gaps, mode, streams


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
    context: ContextCache | None = None,
    cuts: dict[str, list[int]] | None = None,
) -> bytes:
    """Encode one patch (`changes` per leaf) or anchor (`changes=None`: every leaf dense).

    `dense_bits(name)` returns a leaf's full new bits on the host; it is called only for leaves
    sent dense. `base_bits(name)` returns a leaf's full *old* bits on the host (the receiver's
    context); format-3 patches call it for leaves sent sparse. `leaf_digests` are the per-leaf
    digests of the new published state. `run_id` names the publishing run and `base_digest`
    (patches only) is the `state_digest` of the state the patch applies to; a receiver checks
    both before decoding (None: not stated). `context`: the publisher's `ContextCache` for the
    base bits (format 3), so a leaf's classes are not rebuilt from `base_bits` every version.
    `cuts`: per leaf, the context cuts of its last format-3 sparse entry, kept while nearly as
    good (`CodecConfig.cut_slack`: a new cut costs both ends a pass over the leaf); updated in
    place with this patch's. Encoding depends on it, never on `context`.
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
    old_of: dict[str, np.ndarray] = {}
    plan: dict[str, list[int]] = {}
    if fmt >= 3 and kind == "patch":  # the old bits and cuts of every leaf that may go sparse
        for s in specs:
            ch = changes[s.name]
            if ch.count > 0 and ch.count * (1 + s.itemsize) < s.numel * s.itemsize:
                old_of[s.name] = base_bits_of(s, base_bits(s.name))
        leaves = [(s, changes[s.name], old_of[s.name]) for s in specs if s.name in old_of]
        plan = _plan_cuts(leaves, config, context, cuts)
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
            if fmt >= 3 and ch.count * (GAP_WIDTHS[-1] + s.itemsize) < s.numel * s.itemsize:
                sparse = (None, None)  # smaller at any gap width: format 3 has its own gaps
            else:
                gaps = gaps_of(ch.index)
                width = gap_width(int(gaps.max()))
                if ch.count * (width + s.itemsize) < s.numel * s.itemsize:
                    sparse = (gaps, width)
        if sparse is not None and fmt >= 3:
            used = plan[s.name]
            gaps, mode, vstreams = _sparse_v3(s, ch, old_of[s.name], config, used, context)
            if cuts is not None:
                cuts[s.name] = used
            width = gap_width(int(gaps.max()))
            entry.update(encoding="sparse", nnz=ch.count, gap_width=width, values=mode)
            entry["context"] = used
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
