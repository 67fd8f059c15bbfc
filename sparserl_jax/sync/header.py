"""PULSESync blob prefix and header: framing, format versions, run identity, manifest bounds.

    b"PSYN" | u32le header_len | blake2b-128(header) | header | buckets (codec.py)

The header is UTF-8 JSON (formats 1 and 2) or one zstd frame of it (format 3). `read_header`
checks the prefix, bounds `header_len` (and a format-3 frame's stated size) by a configured
maximum before reading or inflating it, checks the checksum and the fields every format version
shares, and returns the header with the identity fields of format 2 (`run_id`, `base_digest`;
both None in a format-1 blob). Format 2 added only those two fields; format 3 compresses the
header, names tensors only in anchors (a patch carries the `manifest_digest` of the receiver's
tensor list instead), drops the derivable stream offsets, adds the sign stream `s` and each
sparse entry's exponent `context` cuts (docs/sync_format.md). `parse_spec`, `stream_sizes` and
`bucket_table` validate the manifest and derive from its shapes the exact raw size of every
stream, so no size a blob claims is trusted before `codec.decode` reads or inflates anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import secrets
import struct

from sparserl_jax.sync.classes import MAX_CUTS, max_exponent
from sparserl_jax.sync.errors import CorruptPatchError, TruncatedPatchError
from sparserl_jax.sync.planes import GAP_WIDTHS

__all__ = [
    "FORMAT_VERSION",
    "GAP_WIDTHS",
    "ITEMSIZES",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "PREFIX_BYTES",
    "STREAMS",
    "TensorSpec",
    "bucket_table",
    "check_run_id",
    "corrupt_unless",
    "is_uint",
    "manifest_digest",
    "new_run_id",
    "pack_header",
    "parse_spec",
    "read_header",
    "stream_sizes",
    "streams_of",
]

MAGIC = b"PSYN"
FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
PREFIX_BYTES = 4 + 4 + 16
# A header is ~250 bytes per tensor; 64 MiB holds a manifest of ~250k tensors.
MAX_HEADER_BYTES = 64 << 20
STREAMS = ("g0", "g1", "g2", "g3", "v0", "v1", "v2", "v3", "d")  # formats 1 and 2
STREAMS_V3 = ("g0", "g1", "g2", "g3", "v0", "v1", "v2", "v3", "s", "d")
VALUE_MODES = {1: ("new", "xor"), 2: ("new", "xor"), 3: ("new", "xor", "step")}
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_NUMEL = 2**32  # per leaf: the digest's flat index is a uint32
ITEMSIZES = {"bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "uint32": 4, "float32": 4}  # fmt: skip
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_DIGEST = re.compile(r"[0-9a-f]{32}")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, global shape and published dtype name of one leaf."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.dtype]


def corrupt_unless(cond: bool, msg: str) -> None:
    """Raise `CorruptPatchError(msg)` unless `cond`."""
    if not cond:
        raise CorruptPatchError(msg)


def is_uint(v, lo: int = 0) -> bool:
    """`v` is an int (a JSON integer, not a float or bool) and `>= lo`."""
    return type(v) is int and v >= lo


def parse_spec(entry: dict, i: int) -> TensorSpec:
    """Manifest entry `i` as a `TensorSpec`; its shape has fewer than 2**32 elements."""
    corrupt_unless(isinstance(entry, dict), f"manifest entry {i} is not an object")
    name, shape, dtype = entry.get("name"), entry.get("shape"), entry.get("dtype")
    corrupt_unless(isinstance(name, str), f"manifest entry {i}: bad name {name!r}")
    corrupt_unless(
        isinstance(shape, list) and all(map(is_uint, shape)), f"tensor {name}: bad shape {shape!r}"
    )
    corrupt_unless(
        isinstance(dtype, str) and dtype in ITEMSIZES,
        f"tensor {name}: dtype {dtype!r} not in {sorted(ITEMSIZES)}",
    )
    corrupt_unless(
        math.prod(shape) < MAX_NUMEL, f"tensor {name}: shape {shape} has 2**32 or more elements"
    )
    return TensorSpec(name, tuple(shape), dtype)


def streams_of(fmt: int) -> tuple[str, ...]:
    """The stream names of a bucket in format `fmt`, in their stored order."""
    return STREAMS_V3 if fmt >= 3 else STREAMS


def manifest_digest(specs) -> str:
    """blake2b-128 over every tensor's name, dtype and shape, in order (format-3 patches)."""
    h = hashlib.blake2b(digest_size=16)
    for s in specs:
        h.update(f"{s.name}|{s.dtype}|{','.join(map(str, s.shape))}|".encode())
    return h.hexdigest()


def stream_sizes(
    tensors: list, specs: list[TensorSpec], kind: str, n_buckets: int, fmt: int = 2
) -> list:
    """Validate every entry's encoding fields; the raw bytes each bucket's streams must hold.

    These follow from the manifest alone (shapes, `nnz`, widths), so a stream table claiming more
    is refused before anything is read or inflated.
    """
    need = [dict.fromkeys(streams_of(fmt), 0) for _ in range(n_buckets)]
    for entry, s in zip(tensors, specs, strict=True):
        enc, b = entry.get("encoding"), entry.get("bucket")
        corrupt_unless(
            enc in ("unchanged", "sparse", "dense"), f"tensor {s.name}: bad encoding {enc!r}"
        )
        corrupt_unless(
            kind == "patch" or enc == "dense", f"tensor {s.name}: an anchor must be dense"
        )
        if enc == "unchanged":
            continue
        corrupt_unless(is_uint(b) and b < n_buckets, f"tensor {s.name}: bad bucket {b!r}")
        corrupt_unless(
            fmt >= 3 or isinstance(entry.get("offsets"), dict), f"tensor {s.name}: offsets missing"
        )
        if enc == "dense":
            need[b]["d"] += s.numel * s.itemsize
            continue
        nnz, width, mode = entry.get("nnz"), entry.get("gap_width"), entry.get("values")
        corrupt_unless(is_uint(nnz, 1) and nnz <= s.numel, f"tensor {s.name}: bad nnz {nnz!r}")
        corrupt_unless(
            type(width) is int and width in GAP_WIDTHS, f"tensor {s.name}: bad gap_width {width!r}"
        )
        corrupt_unless(mode in VALUE_MODES[fmt], f"tensor {s.name}: bad values mode {mode!r}")
        for p in range(width):
            need[b][f"g{p}"] += nnz
        for p in range(s.itemsize):
            need[b][f"v{p}"] += nnz
        if mode == "step":
            need[b]["s"] += (nnz + 7) // 8
        if fmt >= 3:
            cuts, top = entry.get("context"), max_exponent(s.dtype)
            corrupt_unless(
                isinstance(cuts, list)
                and len(cuts) <= (MAX_CUTS if top else 0)
                and all(is_uint(t, 1) and t <= top for t in cuts)
                and cuts == sorted(set(cuts)),  # strictly increasing
                f"tensor {s.name}: bad context cuts {cuts!r}",
            )
    return need


def bucket_table(meta, b: int, fmt: int = 2) -> tuple[int, list]:
    """Bucket `b`'s stored size and `[stored, raw]` stream table, checked for type and sum."""
    corrupt_unless(isinstance(meta, dict), f"bucket {b} is not an object")
    size, streams = meta.get("size"), meta.get("streams")
    corrupt_unless(is_uint(size), f"bucket {b}: bad size {size!r}")
    corrupt_unless(
        isinstance(streams, list)
        and len(streams) == len(streams_of(fmt))
        and all(isinstance(x, list) and len(x) == 2 and all(map(is_uint, x)) for x in streams),
        f"bucket {b}: bad stream table",
    )
    corrupt_unless(
        sum(s for s, _ in streams) == size, f"bucket {b}: stream sizes do not add up to {size}"
    )
    return size, streams


def new_run_id() -> str:
    """A fresh random run id (16 hex digits)."""
    return secrets.token_hex(8)


def check_run_id(run_id) -> str:
    """`run_id` if it is 1..64 characters of `A-Za-z0-9._-`; ValueError otherwise."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} must be 1..64 characters of A-Za-z0-9._-")
    return run_id


def pack_header(header: dict) -> bytes:
    """The prefix and header of a blob (its buckets follow); zstd-compressed in format 3."""
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    if isinstance(header, dict) and header.get("format") == 3:
        import zstandard

        hbytes = zstandard.ZstdCompressor(level=9).compress(hbytes)
    hsum = hashlib.blake2b(hbytes, digest_size=16).digest()
    return b"".join([MAGIC, struct.pack("<I", len(hbytes)), hsum, hbytes])


def read_header(blob: bytes, *, max_header_bytes: int = MAX_HEADER_BYTES) -> dict:
    """Parse and checksum the header only (cheap: used to route a patch before decoding it)."""
    if len(blob) < PREFIX_BYTES:
        raise TruncatedPatchError(
            f"patch has {len(blob)} bytes, fewer than the {PREFIX_BYTES}-byte prefix"
        )
    if blob[:4] != MAGIC:
        raise CorruptPatchError(f"bad magic {bytes(blob[:4])!r}; expected {MAGIC!r}")
    (hlen,) = struct.unpack("<I", blob[4:8])
    corrupt_unless(
        hlen <= max_header_bytes,
        f"header_len {hlen} exceeds the maximum of {max_header_bytes} bytes",
    )
    if len(blob) < PREFIX_BYTES + hlen:
        raise TruncatedPatchError(
            f"patch has {len(blob)} bytes but its header needs {PREFIX_BYTES + hlen}"
        )
    hbytes = bytes(blob[PREFIX_BYTES : PREFIX_BYTES + hlen])
    corrupt_unless(
        hashlib.blake2b(hbytes, digest_size=16).digest() == blob[8:24], "header checksum mismatch"
    )
    compressed = hbytes[:4] == _ZSTD_MAGIC
    if compressed:
        hbytes = _inflate_header(hbytes, max_header_bytes)
    try:
        header = json.loads(hbytes)
    except (ValueError, RecursionError) as e:
        raise CorruptPatchError(f"header is not valid JSON: {e}") from e
    corrupt_unless(
        isinstance(header, dict), f"header is a JSON {type(header).__name__}, not an object"
    )
    fmt = header.get("format")
    corrupt_unless(
        type(fmt) is int and fmt in READABLE_FORMATS,
        f"format version {fmt!r}; this reader knows {list(READABLE_FORMATS)}",
    )
    corrupt_unless(
        compressed == (fmt >= 3),
        f"format {fmt} header {'is' if compressed else 'is not'} zstd-compressed",
    )
    kind = header.get("kind")
    corrupt_unless(kind in ("patch", "anchor"), f"kind {kind!r}; expected patch or anchor")
    if fmt == 1:
        return {**header, "run_id": None, "base_digest": None}
    for key in ("run_id", "base_digest"):
        corrupt_unless(key in header, f"format {fmt} header has no {key!r}")
    run_id, base = header["run_id"], header["base_digest"]
    corrupt_unless(
        run_id is None or (isinstance(run_id, str) and _RUN_ID.fullmatch(run_id) is not None),
        f"bad run_id {run_id!r}",
    )
    corrupt_unless(
        base is None or (kind == "patch" and isinstance(base, str) and _DIGEST.fullmatch(base)),
        f"bad base_digest {base!r} for a {kind}",
    )
    if fmt >= 3:
        m = header.get("manifest")
        corrupt_unless(
            (m is None)
            if kind == "anchor"
            else (isinstance(m, str) and bool(_DIGEST.fullmatch(m))),
            f"bad manifest digest {m!r} for a format-3 {kind}",
        )
    return header


def _inflate_header(frame: bytes, max_header_bytes: int) -> bytes:
    """A format-3 header frame, inflated only after its stated size is checked."""
    import zstandard

    try:
        claimed = zstandard.frame_content_size(frame)  # -1: not stated
        corrupt_unless(
            0 <= claimed <= max_header_bytes,
            f"header frame claims {claimed} bytes (-1: not stated), the maximum is "
            f"{max_header_bytes}",
        )
        data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=claimed)
    except zstandard.ZstdError as e:
        raise CorruptPatchError(f"header zstd frame invalid: {e}") from e
    corrupt_unless(len(data) == claimed, f"header frame gave {len(data)} bytes, not {claimed}")
    return data
