"""PULSESync receiver: validate a whole patch, apply it on device, prove bit-identity, catch up.

A patch is applied only if (1) it comes from the receiver's run (`run_id`: given, or taken from the
first blob accepted) and continues the chain (`base_version == version` and `base_digest` equal to
the held state's digest; an anchor must be newer than the current version), (2) `codec.decode`
accepted every checksum, size, offset and index, and (3) after the scatter the per-leaf digests of
the *new device arrays* equal the publisher's and so does the full-state digest. JAX arrays are
immutable: the new state is built beside the old one and swapped in only after (3), so a refused
patch never leaves weights half-applied. (With `verify="touched"` the digests in (3) are updated
from the elements the patch wrote instead of recomputed; see `Receiver`.)

The scatter takes each leaf's changes in chunks of one fixed size per leaf (`scatter_chunk`), the
last padded with no-op entries, so a steady run compiles a bounded number of programs: at most
two scatters (per verify mode) and one digest per distinct (shape, dtype, sharding) of a leaf,
whatever the change counts (`sparserl_jax.compiles` counts them).

Catch-up (PULSE / grail): from the current version apply the chain of patches `v+1, v+2, ...`;
when one is missing or refused, jump to the newest anchor in `(version, target]` and continue from
there. Anchors are published every K versions (default 10).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from sparserl_jax.sync import codec
from sparserl_jax.sync.errors import (
    BaseMismatchError,
    CorruptPatchError,
    DuplicatePatchError,
    MissingVersionError,
    OutOfOrderPatchError,
    RunMismatchError,
    SyncError,
    VersionError,
)
from sparserl_jax.sync.header import MAX_HEADER_BYTES, check_run_id
from sparserl_jax.sync.mask import (
    _leaf_digest,
    block_digest,
    element_hash,
    from_bits,
    lane_sums,
    to_bits,
)
from sparserl_jax.sync.order import ContextCache
from sparserl_jax.sync.planes import uint_dtype
from sparserl_jax.sync.transport import Transport

# The first chunk of a leaf copies the held array (kept until the digests are proven), later
# chunks update that copy in place (donated): two programs per leaf signature.
MIN_CHUNK = 1 << 12
MAX_CHUNK = 1 << 20
# Programs dispatched per leaf (scatters, digests) are waited on every `PACE`-th: XLA:CPU admits
# 32 programs per device at a time, and a launch past that blocks a thread of the pool that also
# runs the devices' programs, so on 8 (fake) devices an all-reduce then waited forever for
# participants with no thread left (a model of ~30 leaves hung `Receiver.apply` in the tests;
# 64 sharded digests in flight hang every time). On GPU/TPU it is one host wait per PACE leaves.
PACE = 16


class _Pacer:
    """Counts dispatched results and blocks on every `PACE`-th, bounding the programs in flight."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, x):
        self.count += 1
        if self.count % PACE == 0:
            jax.block_until_ready(x)
        return x


def scatter_chunk(numel: int) -> int:
    """Entries per scatter call for a leaf of `numel` elements: a power of two near numel / 64.

    Chunks of about numel / 64 keep a sparse patch (at most 2/3 of the elements, else it is sent
    dense) to at most ~43 calls, and the padding of a small patch to a few % of one leaf pass;
    `MIN_CHUNK` and `MAX_CHUNK` bound it for tiny and huge leaves.
    """
    c = 1 << max(numel // 64 - 1, 0).bit_length()
    return max(1, min(max(c, MIN_CHUNK), MAX_CHUNK, 1 << max(numel - 1, 0).bit_length()))


def _unravel(flat, shape: tuple[int, ...]) -> tuple:
    """C-order multi-index of uint32 flat indices; any flat index >= numel lands past axis 0."""
    idx = []
    for axis in range(len(shape) - 1, 0, -1):
        idx.append(flat % np.uint32(shape[axis]))
        flat = flat // np.uint32(shape[axis])
    return (flat, *reversed(idx))


def _scatter_body(arr, flat, vals, xor, change, *, sharding: Sharding, digest: bool):
    """Write one chunk; return the new array and (if `digest`) `change` plus the digest change of
    the chunk.

    `flat`: uint32 flat indices, sorted, padded with `numel` (dropped by the scatter, masked from
    the digest). `vals`: new bits, or `new ^ old` when `xor` (a traced flag: no program per mode).
    The digest change `sum_i h(i, new_i) - h(i, old_i)` (mod 2**32 per lane, `mask.element_hash`)
    reads `old` from the held array and `new` back from the written one; `change` (uint32[2]) is
    the change of the leaf's earlier chunks, so a leaf's chunks leave one running sum on device.
    """
    bits = to_bits(arr, None).reshape(arr.shape or (1,))
    valid = flat < np.uint32(arr.size)
    idx = _unravel(flat, bits.shape)
    old = bits.at[idx].get(mode="fill", fill_value=0)
    bits = bits.at[idx].set(jnp.where(xor, vals ^ old, vals), mode="drop", indices_are_sorted=True)
    out = lax.with_sharding_constraint(from_bits(bits.reshape(arr.shape), arr.dtype), sharding)
    if not digest:
        return out, None
    new = bits.at[idx].get(mode="fill", fill_value=0)
    o32, n32 = old.astype(jnp.uint32), new.astype(jnp.uint32)
    zero = jnp.zeros_like(flat)
    terms = tuple(
        jnp.where(valid, element_hash(flat, n32, k) - element_hash(flat, o32, k), zero)
        for k in range(2)
    )
    return out, change + lane_sums(terms, local=len(sharding.device_set) == 1)


_scatter_first = jax.jit(_scatter_body, static_argnames=("sharding", "digest"))
_scatter_more = jax.jit(_scatter_body, static_argnames=("sharding", "digest"), donate_argnums=0)


def scatter_changes(
    arr: jax.Array,
    index: np.ndarray,
    vals: np.ndarray,
    *,
    xor: bool,
    sharding: Sharding,
    chunk: int | None = None,
    digest: bool = True,
    pace: _Pacer | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """A new array equal to `arr` with the bits at sorted flat `index` set to `vals` (or XORed).

    Returns it with the change of the leaf digest (a uint32[2] array of two lanes, still on
    device: read it once every leaf is dispatched; None unless `digest`), computed from the old
    and the written bits: `digest(new) = digest(arr) + change` (mod 2**32). `arr` itself is left
    as it was. The scatter runs in chunks of `chunk` entries (default `scatter_chunk`); `pace`
    (shared by the leaves of one apply) bounds the chunks in flight. Nothing here waits for the
    device but `pace`.
    """
    _replicated(sharding)  # refuses a sharding the receiver does not handle
    pace = pace or _Pacer()
    numel = int(np.prod(arr.shape, dtype=np.int64))
    if numel >= 2**32 - 1:
        raise ValueError(f"leaf with {numel} elements exceeds the 2**32 - 1 element limit")
    c = chunk or scatter_chunk(numel)
    chunks = -(-index.size // c)
    flat = np.full((chunks, c), numel, np.uint32)
    flat.reshape(-1)[: index.size] = index
    v = np.zeros((chunks, c), vals.dtype)
    v.reshape(-1)[: index.size] = vals
    # Host arrays go to the jitted calls as they are: jit's own transfer of an argument costs
    # about half of a `device_put` of the same arrays beforehand.
    flag, change, out = np.bool_(xor), np.zeros((2,), np.uint32), arr
    for k in range(chunks):
        fn = _scatter_first if k == 0 else _scatter_more
        out, change = pace(fn(out, flat[k], v[k], flag, change, sharding=sharding, digest=digest))
    return out, change


@functools.partial(jax.jit, static_argnames="local")
def _digest_jit(arr, *, local: bool):
    # One program per leaf signature, not a dozen eager ops each with its own cross-device
    # reduction: eager collectives on a sharded leaf, interleaved with the trainer's programs
    # still running asynchronously on other devices, aborted XLA:CPU (SIGABRT) in the tests.
    return _leaf_digest(to_bits(arr, None), local=local)


def digest_of(arr: jax.Array) -> jax.Array:
    """A held leaf's two digest lanes, computed on device (`mask.leaf_digests`' arithmetic)."""
    return _digest_jit(arr, local=len(arr.sharding.device_set) == 1)


ShardingSpec = Mapping[str, Sharding] | Callable[[str, tuple[int, ...]], Sharding]


def _replicated(sharding: Sharding) -> Sharding:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    raise TypeError(
        f"receiver shardings must be NamedSharding or SingleDeviceSharding, got {sharding}"
    )


@dataclasses.dataclass(frozen=True)
class ApplyEvent:
    """One accepted or refused blob during `Receiver.sync`."""

    version: int
    kind: str
    nbytes: int
    seconds: float
    error: str | None = None
    format: int | None = None  # the wire format of an accepted blob


class Receiver:
    """Holds a sampler's published weights (bit-exact) on its own devices.

    Args:
      sharding: per leaf name, the `Sharding` of that leaf on the sampler mesh (a mapping, or a
        function `(name, shape) -> Sharding`).
      verify: "all" (the default, the safe check) recomputes every leaf's digest from the device
        arrays after each apply, so it also finds held weights corrupted anywhere. "touched" costs
        O(changed): a leaf's digest becomes its last verified digest plus the change of the
        elements the patch wrote (old bits read from the held array, new bits read back from the
        written one; dense leaves are hashed in full). It proves the written elements and their
        old values, and trusts the held bits elsewhere (those are re-proven by the next "all"
        apply or anchor). Both compare every leaf digest and the full-state digest.
      run_id: the run to follow; None binds the receiver to the run of the first blob it accepts
        that names one. Blobs of any other run are refused (`RunMismatchError`).
      max_header_bytes, max_decoded_bytes: bounds on a blob's header and on the bytes it decodes
        to (`codec.decode`); after the first anchor the receiver's own manifest bounds the latter.
      block_of: a part's tensor (`sync.parts`) -> (starts, leaf shape) of the block it is, hashed
        at its leaf's indices (`mask.block_digest`); needs `verify="all"`, single-device blocks.

    Format-3 patches are coded against the receiver's old bits: from the first such patch on, the
    receiver keeps a host copy of the published bits of each leaf they touch (the size of the
    published weights, e.g. 1 GB for a 0.5B model in bf16), advanced by every apply, so no apply
    copies a leaf back from the devices.
    """

    def __init__(
        self,
        sharding: ShardingSpec,
        *,
        verify: Literal["all", "touched"] = "all",
        run_id: str | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_decoded_bytes: int | None = None,
        block_of: Callable[[str], tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ):
        if verify not in ("all", "touched"):
            raise ValueError(f"verify {verify!r} unknown; expected all or touched")
        if block_of is not None and verify != "all":
            raise ValueError("a receiver of blocks (block_of) verifies with verify='all'")
        self._block_of = block_of
        self.run_id = None if run_id is None else check_run_id(run_id)
        self.max_header_bytes, self.max_decoded_bytes = max_header_bytes, max_decoded_bytes
        self._sharding = sharding
        self.verify = verify
        self.version: int | None = None
        self.last_format: int | None = None  # the wire format of the last blob applied
        self.specs: list[codec.TensorSpec] | None = None
        self.arrays: dict[str, jax.Array] = {}
        self.digests: dict[str, np.ndarray] = {}  # each held tensor's verified digest lanes
        # Format 3: each leaf's context classes of `arrays`, kept across versions, and its bits
        # on the host (flat uint), read from the devices once when a patch first needs them and
        # then advanced by every apply: decoding never copies a leaf back from an accelerator.
        self._context = ContextCache()
        self._host: dict[str, np.ndarray] = {}
        self.state_digest: str | None = None

    def _digest(self, name: str, arr: jax.Array) -> jax.Array:
        if self._block_of is None:
            return digest_of(arr)
        return block_digest(arr, *self._block_of(name))

    def sharding_of(self, name: str, shape: tuple[int, ...]) -> Sharding:
        if callable(self._sharding):
            return self._sharding(name, shape)
        return self._sharding[name]

    def _check_order(self, header: dict) -> None:
        kind, base, new = header["kind"], header.get("base_version"), header.get("new_version")
        if not isinstance(new, int):
            raise CorruptPatchError(f"bad new_version {new!r}")
        if self.run_id is not None and header["run_id"] != self.run_id:
            what = f"anchor {new}" if kind == "anchor" else f"patch {base}->{new}"
            raise RunMismatchError(
                f"{what} refused: it was published by run {header['run_id']!r}, this receiver "
                f"follows run {self.run_id!r} (a sync location reused by another run?)"
            )
        if kind == "anchor":
            if self.version is not None and new <= self.version:
                raise DuplicatePatchError(
                    f"anchor {new} is not newer than the receiver's version {self.version}"
                )
            return
        if self.version is None:
            raise VersionError(f"patch {base}->{new} refused: the receiver has no anchor yet")
        if new <= self.version:
            raise DuplicatePatchError(
                f"patch {base}->{new} refused: version {new} already applied "
                f"(receiver at {self.version})"
            )
        if base != self.version:
            raise OutOfOrderPatchError(
                f"patch {base}->{new} refused: base version {base} != receiver version "
                f"{self.version} (versions {self.version + 1}..{base} missing)"
            )
        expected = header["base_digest"]
        if expected is not None and expected != self.state_digest:
            raise BaseMismatchError(
                f"patch {base}->{new} refused: made for a base state with digest {expected}, the "
                f"receiver holds {self.state_digest} at version {self.version}"
            )

    def apply(self, blob: bytes) -> int:
        """Validate and apply one patch or anchor; returns the new version. Raises `SyncError`."""
        self._check_order(codec.read_header(blob, max_header_bytes=self.max_header_bytes))
        patch = codec.decode(
            blob,
            expect=self.specs,
            base=self._host_bits,  # format 3 codes against these
            max_header_bytes=self.max_header_bytes,
            max_decoded_bytes=self.max_decoded_bytes,
            context=self._context,
        )
        specs = [t.spec for t in patch.tensors.values()]
        arrays, changes, dense, pace = dict(self.arrays), {}, [], _Pacer()
        for name, t in patch.tensors.items():
            if t.encoding == "unchanged":
                continue
            sharding = self.sharding_of(name, t.spec.shape)
            if t.encoding == "dense":
                dtype = jnp.dtype(t.spec.dtype)
                host = t.bits.view(np.bool_ if dtype == jnp.bool_ else dtype)
                arrays[name] = jax.device_put(host, sharding)
                dense.append(name)
                continue
            arrays[name], changes[name] = scatter_changes(
                arrays[name],
                t.index,
                t.bits,
                xor=t.xor,
                sharding=sharding,
                digest=self.verify == "touched",
                pace=pace,
            )
        if self.verify == "all":
            names = [s.name for s in specs]
            computed = {}
        else:  # "touched": digests moved by the elements written, from the verified ones
            names = dense + list(changes)
            computed = dict(self.digests)
            for name, change in changes.items():  # read once every leaf is dispatched
                computed[name] = computed[name] + np.asarray(change, np.uint32)  # lanes wrap
        recompute = names if self.verify == "all" else dense
        pending = {n: pace(self._digest(n, arrays[n])) for n in recompute}  # dispatched, then read
        computed.update({k: np.asarray(v, np.uint32) for k, v in pending.items()})
        bad = [n for n in names if not np.array_equal(computed[n], patch.leaf_digests[n])]
        if bad or codec.state_digest(specs, computed) != patch.state_digest:
            raise CorruptPatchError(
                f"version {patch.new_version}: digest mismatch after apply in {bad[:5]} "
                f"({len(bad)} tensors); weights left at version {self.version}"
            )
        self.arrays, self.digests, self.specs = arrays, computed, specs
        self.version, self.state_digest = patch.new_version, patch.state_digest
        self.run_id = self.run_id or patch.run_id
        self.last_format = patch.format
        for name, t in patch.tensors.items():  # the held classes follow the new bits
            if t.encoding == "sparse" and not t.xor:
                self._context.advance(name, t.index, t.bits, t.old)
            elif t.encoding != "unchanged":  # dense, or XOR values (format 2): rebuilt on use
                self._context.drop(name)
        self._advance_host(patch)
        return patch.new_version

    def _host_bits(self, name: str) -> np.ndarray:
        """Leaf `name`'s bits on the host: read from the devices the first time only."""
        if name not in self._host:
            held = np.array(self.arrays[name]).reshape(-1)  # the one device-to-host copy
            self._host[name] = held.view(uint_dtype(held.dtype.itemsize))
        return self._host[name]

    def _advance_host(self, patch) -> None:
        """The held host bits follow an applied (verified) patch, from its decoded values."""
        for name, t in patch.tensors.items():
            held = self._host.get(name)
            if held is None or t.encoding == "unchanged":
                continue
            if t.encoding == "dense":
                self._host[name] = np.array(t.bits).reshape(-1).view(held.dtype)
            elif t.xor:
                held[t.index] ^= t.bits.astype(held.dtype, copy=False)
            else:
                held[t.index] = t.bits.astype(held.dtype, copy=False)

    def sync(self, transport: Transport, target: int | None = None) -> list[ApplyEvent]:
        """Catch up to `target` (default: newest available), by chain, else by the newest anchor.

        Raises `MissingVersionError` if neither the chain nor an anchor in `(version, target]`
        can get there; the weights then stay at the last good version.
        """
        anchors = transport.versions("anchor")
        patches = transport.versions("patch")
        if target is None:
            target = max(anchors + patches, default=-1)
        events: list[ApplyEvent] = []
        while self.version is None or self.version < target:
            err = None
            if self.version is not None:
                nxt = self.version + 1
                blob = transport.get(nxt, "patch")
                if blob is None:
                    err = MissingVersionError(f"patch {nxt} not available")
                else:
                    err = self._try(blob, nxt, "patch", events)
                if err is None:
                    continue
            lo = -1 if self.version is None else self.version
            candidates = [a for a in transport.versions("anchor") if lo < a <= target]
            if not candidates:
                raise MissingVersionError(
                    f"cannot reach version {target} from {self.version}: "
                    f"{err or 'no state yet'}, and no anchor in ({lo}, {target}]"
                ) from err
            a = max(candidates)
            blob = transport.get(a, "anchor")
            aerr = None if blob is None else self._try(blob, a, "anchor", events)
            if blob is None or aerr is not None:
                raise MissingVersionError(f"anchor {a} unusable: {aerr or 'not available'}") from (
                    aerr or err
                )
        return events

    def _try(self, blob: bytes, version: int, kind: str, events: list) -> SyncError | None:
        t0 = time.perf_counter()
        try:
            self.apply(blob)
        except SyncError as e:
            events.append(ApplyEvent(version, kind, len(blob), time.perf_counter() - t0, str(e)))
            return e
        seconds = time.perf_counter() - t0
        events.append(ApplyEvent(version, kind, len(blob), seconds, format=self.last_format))
        return None

    def tree(self, treedef, names: list[str]):
        """The held arrays as a pytree with `treedef` (leaves in the order of `names`)."""
        return jax.tree.unflatten(treedef, [self.arrays[n] for n in names])
