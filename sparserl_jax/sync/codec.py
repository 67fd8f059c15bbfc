"""PULSESync patch codec: sparse bit-pattern patches and dense anchors as one byte string.

Layout (full spec in `docs/sync_format.md`):

    b"PSYN" | u32le header_len | blake2b-128(header) | header | bucket 0 | bucket 1 | ...

The encoder writes format 3; `decode` (in `decode.py`, re-exported here) reads formats 1-3. A
patch follows one path, mask to bytes, one stage per module:

1. `mask.py` / `extract.py`: which elements changed (on device), their indices and old and new
   bits (on the host): `LeafChanges`.
2. Per leaf (`encode_patch`): `unchanged`, `sparse`, or `dense` (all bits) when the sparse form
   would not be smaller.
3. `classes.py`: a sparse leaf's elements fall into up to five classes of their *old* exponent
   (the entry's `context` cuts, chosen for all leaves by one dynamic program).
4. `order.py`: changed positions are ranked in the context order (class 0 in flat order, then
   class 1, ...) and sent as gaps between ranks (`planes.gaps_of`) at the narrowest width.
5. `values.py`: the values in that order, as new bits, XOR, or signed steps on the ordered bit
   line, whichever is smallest by measured entropy.
6. `planes.py` and here: multi-byte gaps and values split into byte planes, so the mostly-zero
   high bytes compress; the entries packed into buckets of about `bucket_bytes`, each stream
   one zstd frame, each bucket with a blake2b-128 checksum; then the zstd-compressed JSON header
   (`header.py`): the publishing run's id, base and new version, the base state's digest, the
   receiver's manifest digest (tensors are named only in anchors), per-leaf digests and the
   digest of the whole new state.

Decoding a format-3 patch needs the receiver's old bits (`base`), which every receiver holds
exactly. `decode` validates everything (structure, checksums, sizes, index ranges and order) and
raises `CorruptPatchError`/`TruncatedPatchError` before returning anything; every size it reads
is bounded before it allocates or inflates.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np

from sparserl_jax.sync.classes import CUT_SLACK, best_cuts, cut_counts, keeps_cuts
from sparserl_jax.sync.decode import Patch as Patch  # re-exported
from sparserl_jax.sync.decode import TensorPatch as TensorPatch
from sparserl_jax.sync.decode import base_bits_of, state_digest
from sparserl_jax.sync.decode import decode as decode
from sparserl_jax.sync.extract import LeafChanges
from sparserl_jax.sync.header import (
    FORMAT_VERSION,
    READABLE_FORMATS,
    STREAMS_V3,
    TensorSpec,
    check_run_id,
    manifest_digest,
    pack_header,
)
from sparserl_jax.sync.header import ITEMSIZES as ITEMSIZES  # re-exported
from sparserl_jax.sync.header import read_header as read_header
from sparserl_jax.sync.order import ContextCache, context_order
from sparserl_jax.sync.planes import byte_planes, gap_width, gaps_of, uint_dtype
from sparserl_jax.sync.values import VALUE_MODES, code_values


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How patches are encoded.

    Attributes:
      bucket_bytes: raw (pre-compression) bytes per bucket; a tensor never spans buckets.
      compression: "zstd" (each stream one zstd frame) or "none".
      zstd_level: zstd level (1..22); 1, as grail: on these byte planes level 3 is ~3x slower and
        no smaller.
      values: "auto" (per tensor, the smallest of new bits, XOR and signed steps on the ordered
        line, by measured byte-plane entropy), "new", "xor" or "step".
      format: the wire format written: 3, the only one (formats 1 and 2 are still read).
      cut_slack: a leaf keeps its last context cuts while their mask costs at most this fraction
        more than one class per exponent (`classes.keeps_cuts`); 0 (the default) picks the best
        cuts every version. On the bench 0.05 encodes 5-9% faster (no cut changes, which cost
        both ends a pass over the leaf, and no search for the best) for 2% (lr 1e-6) to 5%
        (lr 1e-5) more bytes.
    """

    bucket_bytes: int = 64 << 20
    compression: Literal["zstd", "none"] = "zstd"
    zstd_level: int = 1
    values: Literal["auto", "new", "xor", "step"] = "auto"
    format: int = FORMAT_VERSION
    cut_slack: float = CUT_SLACK

    def __post_init__(self):
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        if self.compression not in ("zstd", "none"):
            raise ValueError(f"compression {self.compression!r} unknown; expected zstd or none")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in 1..22, got {self.zstd_level}")
        if self.values not in VALUE_MODES:
            raise ValueError(f"values {self.values!r} unknown; expected auto, new, xor or step")
        if self.format != FORMAT_VERSION:
            known = "read, no longer written" if self.format in READABLE_FORMATS else "unknown"
            raise ValueError(
                f"format {self.format!r} {known}; patches are written in format {FORMAT_VERSION}"
            )
        if not (isinstance(self.cut_slack, int | float) and 0 <= self.cut_slack < 1):
            raise ValueError(f"cut_slack must be a number in [0, 1), got {self.cut_slack!r}")


@dataclasses.dataclass
class _Entry:
    """One tensor's manifest entry and the arrays it adds to its bucket's streams."""

    meta: dict
    streams: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.streams.values())


def encode_anchor(
    *,
    version: int,
    specs: Sequence[TensorSpec],
    bits: Callable[[str], np.ndarray],
    leaf_digests: Mapping[str, np.ndarray],
    config: CodecConfig,
    run_id: str | None = None,
) -> bytes:
    """Encode anchor `version`: every leaf dense. `bits(name)`: a leaf's full bits on the host;
    `leaf_digests`: per-leaf digests of that state; `run_id`: the publishing run (None: not
    stated)."""
    if run_id is not None:
        check_run_id(run_id)
    entries = []
    for s in specs:
        entry = _dense(s, bits(s.name))
        entry.meta = {"name": s.name, "shape": list(s.shape), "dtype": s.dtype, **entry.meta}
        entries.append(entry)
    header = dict(kind="anchor", run_id=run_id, base_version=None, base_digest=None)
    return _frame(header, version, specs, entries, leaf_digests, config, manifest=None)


def encode_patch(
    *,
    base_version: int,
    new_version: int,
    specs: Sequence[TensorSpec],
    changes: Mapping[str, LeafChanges],
    new_bits: Callable[[str], np.ndarray],
    old_bits: Callable[[str], np.ndarray],
    leaf_digests: Mapping[str, np.ndarray],
    config: CodecConfig,
    run_id: str | None = None,
    base_digest: str | None = None,
    context: ContextCache | None = None,
) -> bytes:
    """Encode the patch `base_version -> new_version` of `changes` (every leaf's).

    `new_bits(name)` / `old_bits(name)`: a leaf's full new / old bits on the host (the old ones
    are the receiver's, what the patch is coded against); each is read only where needed: new
    bits for a leaf sent dense, old bits where `context` does not already hold what the leaf's
    classes need (always, without a `context`). `leaf_digests`: per-leaf digests of the new
    state. `run_id` names the publishing run and `base_digest` is the `state_digest` of the state
    the patch applies to; a receiver checks both before decoding (None: not stated).
    `context`: the publisher's `ContextCache` of the old bits, used and extended (bitmaps, and
    each leaf's `last_cuts`, kept while `config.cut_slack` allows); never advanced here.
    """
    if run_id is not None:
        check_run_id(run_id)
    olds = _OldBits(specs, old_bits)
    # Step 2: which leaves may go sparse: a one-byte gap and the value cost less than dense.
    sparse = [s for s in specs if 0 < changes[s.name].count * (1 + s.itemsize) < _dense_bytes(s)]
    # Step 3: the classes of every such leaf, by one dynamic program over all of them.
    cuts = _choose_cuts(sparse, changes, olds, config, context)
    entries = []
    for s in specs:
        ch = changes[s.name]
        if ch.count == 0:
            entry = _Entry({"encoding": "unchanged"})
        else:
            entry = None
            if s.name in cuts:  # steps 4 and 5
                entry = _sparse(s, ch, olds, cuts[s.name], config, context)
            if entry is None:
                entry = _dense(s, new_bits(s.name))
        entries.append(entry)
    header = dict(kind="patch", run_id=run_id, base_version=base_version, base_digest=base_digest)
    manifest = manifest_digest(specs)
    return _frame(header, new_version, specs, entries, leaf_digests, config, manifest=manifest)


class _OldBits:
    """Each leaf's old bits, read from `old_bits(name)` once, on first use, and checked."""

    def __init__(self, specs: Sequence[TensorSpec], old_bits: Callable[[str], np.ndarray]):
        self._specs = {s.name: s for s in specs}
        self._read = old_bits
        self._held: dict[str, np.ndarray] = {}

    def of(self, name: str) -> Callable[[], np.ndarray]:
        """The reader of leaf `name`'s old bits (flat uint)."""

        def read() -> np.ndarray:
            if name not in self._held:
                self._held[name] = base_bits_of(self._specs[name], self._read(name))
            return self._held[name]

        return read


def _dense_bytes(s: TensorSpec) -> int:
    return s.numel * s.itemsize


def _choose_cuts(
    sparse: Sequence[TensorSpec],
    changes: Mapping[str, LeafChanges],
    olds: _OldBits,
    config: CodecConfig,
    context: ContextCache | None,
) -> dict[str, list[int]]:
    """The context cuts of each leaf that may go sparse (`classes.py`): its last ones where
    `config.cut_slack` keeps them, else the best. Exponent histograms come from `context` when
    given (read from the old bits only the first time)."""
    plan, todo = {}, []
    for s in sparse:
        ch, read = changes[s.name], olds.of(s.name)
        if context is None:
            nk = cut_counts(read(), ch.old, s.dtype)
        else:
            nk = cut_counts(None, ch.old, s.dtype, counts=context.histogram(s.name, read, s.dtype))
        prefer = None if context is None else context.last_cuts.get(s.name)
        if nk is None:
            plan[s.name] = []
        elif keeps_cuts(*nk, prefer, config.cut_slack):
            plan[s.name] = list(prefer)
        else:
            todo.append((s.name, nk))
    plan.update(zip([n for n, _ in todo], best_cuts([nk for _, nk in todo]), strict=True))
    return plan


def _sparse(
    s: TensorSpec,
    ch: LeafChanges,
    olds: _OldBits,
    cuts: list[int],
    config: CodecConfig,
    context: ContextCache | None,
) -> _Entry | None:
    """A sparse entry: positions in context order as gaps (step 4), then the values in that
    order (step 5); None when it would not be smaller than the dense bits."""
    read = olds.of(s.name)
    ranges = None if context is None else context.ranges(s.name, read, s.numel, s.dtype, cuts)
    order, pos = context_order(read, s.dtype, cuts, ch.index, ranges, changed_old=ch.old)
    gaps = gaps_of(pos)
    width = gap_width(int(gaps.max()))
    if ch.count * (width + s.itemsize) >= _dense_bytes(s):
        return None
    if context is not None:
        context.last_cuts[s.name] = cuts
    old, new = (ch.old, ch.new) if not cuts else (ch.old[order], ch.new[order])
    mode, value_streams = code_values(
        old, new, s.itemsize, values=config.values, entropy=config.compression != "none"
    )
    meta = dict(encoding="sparse", nnz=ch.count, gap_width=width, values=mode, context=cuts)
    streams = {f"g{p}": plane for p, plane in enumerate(byte_planes(gaps, width))}
    return _Entry(meta, {**streams, **value_streams})


def _dense(s: TensorSpec, bits) -> _Entry:
    """A dense entry: every bit of the leaf (`bits`, on the host)."""
    bits = np.asarray(bits)
    if bits.shape != s.shape or bits.dtype.itemsize != s.itemsize:
        raise ValueError(f"dense bits of {s.name}: {bits.shape}/{bits.dtype} != {s}")
    raw = np.ascontiguousarray(bits.astype(uint_dtype(s.itemsize), copy=False)).view(np.uint8)
    return _Entry({"encoding": "dense"}, {"d": raw.reshape(-1)})


def _frame(
    header: dict,
    new_version: int,
    specs: Sequence[TensorSpec],
    entries: Sequence[_Entry],
    leaf_digests: Mapping[str, np.ndarray],
    config: CodecConfig,
    *,
    manifest: str | None,
) -> bytes:
    """Step 6: the entries packed into buckets (a tensor never spans two; each stream's segments
    tile it in manifest order), then the header, as one blob."""
    for s, entry in zip(specs, entries, strict=True):
        entry.meta["digest"] = [int(v) for v in np.asarray(leaf_digests[s.name], np.uint32)]
    groups, size = [[]], 0
    for entry in entries:
        if groups[-1] and size + entry.nbytes > config.bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    if config.compression == "none":
        compress = None
    else:
        import zstandard

        compress = zstandard.ZstdCompressor(level=config.zstd_level).compress
    buckets, blobs = [], []
    for b, group in enumerate(groups if entries else []):
        stored, table = [], []
        for k in STREAMS_V3:
            data = b"".join(e.streams[k].tobytes() for e in group if k in e.streams)
            stored.append(data if compress is None or not data else compress(data))
            table.append([len(stored[-1]), len(data)])
        for e in group:
            if e.meta["encoding"] != "unchanged":
                e.meta["bucket"] = b
        blob = b"".join(stored)
        checksum = hashlib.blake2b(blob, digest_size=16).hexdigest()
        buckets.append({"size": len(blob), "streams": table, "checksum": checksum})
        blobs.append(blob)
    header = {
        "format": FORMAT_VERSION,
        **header,
        "new_version": new_version,
        "compression": config.compression,
        "state_digest": state_digest(specs, leaf_digests),
        "tensors": [e.meta for e in entries],
        "buckets": buckets,
        "manifest": manifest,
    }
    return b"".join([pack_header(header), *blobs])
