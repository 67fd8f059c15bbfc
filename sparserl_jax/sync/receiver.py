"""PULSESync receiver: validate a whole patch, apply it on device, prove bit-identity, catch up.

A patch is applied only if (1) it comes from the receiver's run (`run_id`: given, or taken from the
first blob accepted) and continues the chain (`base_version == version` and `base_digest` equal to
the held state's digest; an anchor must be newer than the current version), (2) `codec.decode`
accepted every checksum, size, offset and index, and (3) after the scatter the per-leaf digests of
the *new device arrays* equal the publisher's and so does the full-state digest. JAX arrays are
immutable: the new state is built beside the old one and swapped in only after (3), so a refused
patch never leaves weights half-applied.

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
from sparserl_jax.sync.mask import _leaf_digest, from_bits, to_bits
from sparserl_jax.sync.transport import Transport


@functools.partial(jax.jit, static_argnames=("xor", "sharding"))
def _scatter(arr, idx_nm, vals, *, xor: bool, sharding: Sharding):
    """Write value bits at (padded) multi-indices; padding points past axis 0 and is dropped."""
    bits = to_bits(arr, None)
    idx = tuple(idx_nm[i] for i in range(arr.ndim))
    if xor:
        vals = vals ^ bits.at[idx].get(mode="fill", fill_value=0)
    bits = bits.at[idx].set(vals, mode="drop", indices_are_sorted=True)
    return lax.with_sharding_constraint(from_bits(bits, arr.dtype), sharding)


@jax.jit
def _digest(arr):
    return _leaf_digest(to_bits(arr, None))


def _replicated(sharding: Sharding) -> Sharding:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    raise TypeError(
        f"receiver shardings must be NamedSharding or SingleDeviceSharding, got {sharding}"
    )


def _pad_size(n: int) -> int:
    # Powers of two bound the number of compiled scatter shapes to ~log2(numel) per leaf.
    return max(8, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class ApplyEvent:
    """One accepted or refused blob during `Receiver.sync`."""

    version: int
    kind: str
    nbytes: int
    seconds: float
    error: str | None = None


class Receiver:
    """Holds a sampler's published weights (bit-exact) on its own devices.

    Args:
      sharding: per leaf name, the `Sharding` of that leaf on the sampler mesh (a mapping, or a
        function `(name, shape) -> Sharding`).
      verify: "all" recomputes every leaf's digest after each apply (the full-state check);
        "touched" recomputes only the leaves the patch changed and reuses verified digests of the
        others (the full-state digest is still checked).
      run_id: the run to follow; None binds the receiver to the run of the first blob it accepts
        that names one. Blobs of any other run are refused (`RunMismatchError`).
      max_header_bytes, max_decoded_bytes: bounds on a blob's header and on the bytes it decodes
        to (`codec.decode`); after the first anchor the receiver's own manifest bounds the latter.
    """

    def __init__(
        self,
        sharding: Mapping[str, Sharding] | Callable[[str, tuple[int, ...]], Sharding],
        *,
        verify: Literal["all", "touched"] = "all",
        run_id: str | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_decoded_bytes: int | None = None,
    ):
        if verify not in ("all", "touched"):
            raise ValueError(f"verify {verify!r} unknown; expected all or touched")
        self.run_id = None if run_id is None else check_run_id(run_id)
        self.max_header_bytes, self.max_decoded_bytes = max_header_bytes, max_decoded_bytes
        self._sharding = sharding
        self.verify = verify
        self.version: int | None = None
        self.specs: list[codec.TensorSpec] | None = None
        self.arrays: dict[str, jax.Array] = {}
        self._digests: dict[str, np.ndarray] = {}
        self.state_digest: str | None = None

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
            base=lambda name: np.asarray(self.arrays[name]),  # format 3 codes against these
            max_header_bytes=self.max_header_bytes,
            max_decoded_bytes=self.max_decoded_bytes,
        )
        specs = [t.spec for t in patch.tensors.values()]
        arrays, touched = dict(self.arrays), []
        for name, t in patch.tensors.items():
            if t.encoding == "unchanged":
                continue
            touched.append(name)
            shape = t.spec.shape
            sharding = self.sharding_of(name, shape)
            dtype = jnp.dtype(t.spec.dtype)
            if t.encoding == "dense":
                host = t.bits.view(np.bool_ if dtype == jnp.bool_ else dtype)
                arrays[name] = jax.device_put(host, sharding)
                continue
            n = t.index.size
            m = _pad_size(n)
            idx_nm = np.zeros((len(shape), m), np.int32)
            idx_nm[0, n:] = shape[0]  # out of bounds on axis 0: dropped by the scatter
            idx_nm[:, :n] = np.stack(np.unravel_index(t.index, shape)).astype(np.int32)
            vals = np.zeros((m,), t.bits.dtype)
            vals[:n] = t.bits
            rep = _replicated(sharding)
            arrays[name] = _scatter(
                arrays[name],
                jax.device_put(idx_nm, rep),
                jax.device_put(vals, rep),
                xor=t.xor,
                sharding=sharding,
            )
        names = [s.name for s in specs] if self.verify == "all" else touched
        computed = dict(self._digests) if self.verify == "touched" else {}
        pending = {name: _digest(arrays[name]) for name in names}
        computed.update({k: np.asarray(v, np.uint32) for k, v in pending.items()})
        bad = [n for n in names if not np.array_equal(computed[n], patch.leaf_digests[n])]
        if bad or codec.state_digest(specs, computed) != patch.state_digest:
            raise CorruptPatchError(
                f"version {patch.new_version}: digest mismatch after apply in {bad[:5]} "
                f"({len(bad)} tensors); weights left at version {self.version}"
            )
        self.arrays, self._digests, self.specs = arrays, computed, specs
        self.version, self.state_digest = patch.new_version, patch.state_digest
        self.run_id = self.run_id or patch.run_id
        return patch.new_version

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
        events.append(ApplyEvent(version, kind, len(blob), time.perf_counter() - t0))
        return None

    def tree(self, treedef, names: list[str]):
        """The held arrays as a pytree with `treedef` (leaves in the order of `names`)."""
        return jax.tree.unflatten(treedef, [self.arrays[n] for n in names])
