"""PULSESync publisher: turns successive master trees into versioned patches and anchors.

Version 0 is an anchor of `publish(master_0)`. Each later `publish(master)` computes the packed
visible mask against the last *sent* bits (`mask.visible_bitmap`) and the new published bits,
extracts the changed elements shard by shard and encodes patch `v -> v+1`. Every `anchor_every`
versions the full state is also published as an anchor (grail: both a FULL and a DELTA at anchor
windows, so running receivers stay on the cheap path while late joiners start from the anchor).

The per-leaf digests are updated incrementally in O(changed) (the digest is a sum of per-element
terms) and recomputed in full on device at every anchor as a self-check.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from sparserl_jax.sync import codec
from sparserl_jax.sync.errors import RunMismatchError, SyncError
from sparserl_jax.sync.extract import (
    LeafChanges,
    box_name,
    extract_changes,
    global_index,
    host_bits,
    primary_shards,
    shard_changes,
    shard_start,
)
from sparserl_jax.sync.header import check_run_id, new_run_id, read_header
from sparserl_jax.sync.mask import (
    block_digest,
    digest_update,
    leaf_digests,
    publish_bits,
    published_dtype,
    visible_bitmap,
)
from sparserl_jax.sync.order import ContextCache
from sparserl_jax.sync.transport import KINDS, Transport

PUBLISH_DTYPES = ("bfloat16", "float16", "float32", "keep")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """PULSESync settings.

    Attributes:
      anchor_every: K; a full anchor at every version that is a multiple of K (PULSE/grail: 10).
      publish_dtype: dtype floating leaves are published in; "keep" publishes them as they are.
      codec: patch encoding settings.
    """

    anchor_every: int = 10
    publish_dtype: Literal["bfloat16", "float16", "float32", "keep"] = "bfloat16"
    codec: codec.CodecConfig = dataclasses.field(default_factory=codec.CodecConfig)

    def __post_init__(self):
        if not isinstance(self.anchor_every, int) or self.anchor_every < 1:
            raise ValueError(f"anchor_every must be an int >= 1, got {self.anchor_every!r}")
        if self.publish_dtype not in PUBLISH_DTYPES:
            raise ValueError(
                f"publish_dtype {self.publish_dtype!r} unknown; expected one of {PUBLISH_DTYPES}"
            )

    @property
    def jnp_publish_dtype(self):
        return None if self.publish_dtype == "keep" else jnp.dtype(self.publish_dtype)


@dataclasses.dataclass(frozen=True)
class Published:
    """What one `publish` call produced, with sizes and timings (seconds)."""

    version: int
    patch: bytes | None
    anchor: bytes | None
    changed: dict[str, int]
    numel: int
    dense_bytes: int
    mask_s: float = 0.0
    extract_s: float = 0.0
    encode_s: float = 0.0
    anchor_s: float = 0.0
    anchor_cpu_s: float = 0.0
    payload_nbytes: int | None = None  # the patch bytes, where `patch` is not one blob (parts)

    @property
    def total_changed(self) -> int:
        return sum(self.changed.values())

    @property
    def payload_bytes(self) -> int:
        """Bytes of the patch (of every part's, for a publish spread over processes)."""
        return len(self.patch or b"") if self.payload_nbytes is None else self.payload_nbytes


def leaf_names(tree) -> list[str]:
    """Stable names of a pytree's leaves (`jax.tree_util.keystr` of each path)."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(p) for p, _ in paths]


class Publisher:
    """Publishes `bf16(master)` versions to a transport (or just returns the blobs)."""

    def __init__(
        self,
        transport: Transport | None = None,
        *,
        config: SyncConfig | None = None,
        start_version: int = 0,
        run_id: str | None = None,
        shards: bool = False,
        device: jax.Device | None = None,
    ):
        """`start_version`: the version of the first (anchor) publish, e.g. the version a
        resumed trainer had reached, so that version numbers keep rising across restarts.
        `run_id`: written into every blob (default: a fresh random id); a resumed trainer passes
        the id it checkpointed, so receivers bound to the run keep following it.
        `shards`: publish only the primary shards (`replica_id == 0`) this process holds, each
        as its own tensor named after the block of its leaf it covers (`extract.box_name`): this
        process's part of a publish spread over processes (`sync.parts`). Their digests hash
        each element at its index in the whole leaf, so the parts' digests of a leaf add up to
        the leaf's digest. No leaf is read beyond this process's shards. `device` (with
        `shards`): only the shards on that device (one part per device, `sync.parts`)."""
        if start_version < 0:
            raise ValueError(f"start_version must be >= 0, got {start_version}")
        self._start_version = start_version
        self.run_id = new_run_id() if run_id is None else check_run_id(run_id)
        self.transport = transport
        self.config = config or SyncConfig()
        self.version: int | None = None
        self.names: list[str] = []
        self.specs: list[codec.TensorSpec] = []
        self._treedef = None
        self._sent = None
        self._digests: dict[str, np.ndarray] = {}
        # Each leaf's context classes of `_sent` and its last cuts, kept across versions: in
        # steady state a patch reads no leaf's old bits back from its devices.
        self._context = ContextCache()
        self.shards, self.device = shards, device
        # With `shards`: per tensor, (its leaf's position, where its block starts).
        self._blocks: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.leaf_specs: list[codec.TensorSpec] = []  # the whole leaves (== specs without shards)

    @property
    def sent_bits(self):
        """The bits of the last published state (a tree like the master; same shardings)."""
        return self._sent

    def _block(self, tree, name: str):
        """Tensor `name`'s block of `tree` (with `shards`): the shard of its leaf there."""
        leaf, starts = self._blocks[name]
        x = jax.tree.leaves(tree)[leaf]
        return next(s for s in primary_shards(x, local=True) if shard_start(s) == starts)

    def _full_digests(self) -> dict[str, np.ndarray]:
        if not self.shards:
            leaves = dict(zip(self.names, jax.tree.leaves(self._sent), strict=True))
            return {k: np.asarray(v, np.uint32) for k, v in leaf_digests(leaves).items()}
        shapes = [s.shape for s in self.leaf_specs]
        pending = {}
        for n, (leaf, starts) in self._blocks.items():
            pending[n] = block_digest(self._block(self._sent, n).data, starts, shapes[leaf])
        return {k: np.asarray(v, np.uint32) for k, v in pending.items()}

    def _bits(self, tree, name: str) -> np.ndarray:
        if self.shards:
            return np.asarray(self._block(tree, name).data)
        return host_bits(dict(zip(self.names, jax.tree.leaves(tree), strict=True))[name])

    def _anchor(self) -> bytes:
        full = self._full_digests()
        if self._digests and any(not np.array_equal(full[k], self._digests[k]) for k in full):
            raise RuntimeError("incremental digest diverged from the full digest (a PULSESync bug)")
        self._digests = full
        sent = self._sent
        return codec.encode_anchor(
            version=self.version,
            specs=self.specs,
            bits=lambda n: self._bits(sent, n),
            leaf_digests=self._digests,
            config=self.config.codec,
            run_id=self.run_id,
        )

    @property
    def state_digest(self) -> str:
        """The digest of the last published state (`codec.state_digest`)."""
        return codec.state_digest(self.specs, self._digests)

    def _check_transport(self) -> None:
        """Refuse to publish where another run's versions at or above ours already are: a
        receiver could splice them into this run's chain. The newest blob of each kind is read
        (an anchor only when it is newer than every patch): one publisher per location writes
        them in order, so a foreign run shows there. Unreadable leftovers are left to receivers,
        which refuse them."""
        newest = {}
        for kind in KINDS:
            later = [v for v in self.transport.versions(kind) if v >= self._start_version]
            if later:
                newest[kind] = later[-1]
        if "anchor" in newest and newest["anchor"] <= newest.get("patch", -1):
            del newest["anchor"]
        for kind, v in newest.items():
            blob = self.transport.get(v, kind)
            try:
                other = None if blob is None else read_header(blob)["run_id"]
            except SyncError:
                continue
            if blob is not None and other != self.run_id:
                raise RunMismatchError(
                    f"the sync transport already holds {kind} {v} of run {other!r} (this run, "
                    f"{self.run_id!r}, starts at version {self._start_version}): publish to an "
                    "empty location, delete those versions, or resume that run with its run id"
                )

    def publish(self, master, *, staged=None) -> Published:
        """Publish the next version of `master` (a pytree of arrays, any sharding).

        `staged`: the device work for it, done once for several publishers of one master (the
        parts of `sync.parts`): the first publish's `publish_bits(master)`, then
        `visible_bitmap(master, sent_bits)`'s triple."""
        pdt = self.config.jnp_publish_dtype
        # Host (numpy) leaves become device arrays; device arrays are taken as they are.
        master = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), master)
        if self.version is None:
            t0 = time.perf_counter()
            if self.transport is not None:
                self._check_transport()
            self._sent = publish_bits(master, pdt) if staged is None else staged
            leaves, self._treedef = jax.tree.flatten(master)
            names = leaf_names(master)
            self.leaf_specs = [
                codec.TensorSpec(n, tuple(x.shape), published_dtype(x.dtype, pdt).name)
                for n, x in zip(names, leaves, strict=True)
            ]
            self.names, self.specs = names, self.leaf_specs
            if self.shards:
                self.specs = []
                for i, (spec, x) in enumerate(zip(self.leaf_specs, leaves, strict=True)):
                    for shard in primary_shards(x, local=True):
                        if self.device is not None and shard.device != self.device:
                            continue
                        name = box_name(spec.name, shard_start(shard))
                        self._blocks[name] = (i, shard_start(shard))
                        shape = tuple(shard.data.shape)
                        self.specs.append(codec.TensorSpec(name, shape, spec.dtype))
                self.names = [s.name for s in self.specs]
            self.version = self._start_version
            anchor = self._anchor()
            self._put(self.version, "anchor", anchor)
            numel = sum(s.numel for s in self.specs)
            dense = sum(s.numel * s.itemsize for s in self.specs)
            changed = {s.name: s.numel for s in self.specs}
            return Published(
                self.version, None, anchor, changed, numel, dense, encode_s=time.perf_counter() - t0
            )
        if jax.tree.structure(master) != self._treedef:
            raise ValueError("master tree structure changed since the first publish")
        for spec, x in zip(self.leaf_specs, jax.tree.leaves(master), strict=True):
            shape, dtype = tuple(x.shape), published_dtype(x.dtype, pdt).name
            if (shape, dtype) != (spec.shape, spec.dtype):
                raise ValueError(
                    f"master leaf {spec.name} is {shape} {dtype} but was {spec.shape} "
                    f"{spec.dtype} at the first publish (a publisher's leaves keep their shapes "
                    "and dtypes: start a new Publisher)"
                )
        # Nothing in `self` changes until the patch is encoded: a failure leaves the publisher
        # at its last version.
        t0 = time.perf_counter()
        if staged is None:
            staged = visible_bitmap(master, self._sent, pdt)
        bitmaps, packed, new_sent = staged
        jax.block_until_ready((bitmaps, new_sent))
        t1 = time.perf_counter()
        changes, index = self._changes(bitmaps, new_sent, packed)
        t2 = time.perf_counter()
        digests = dict(self._digests)
        for n, ch in changes.items():
            if ch.count:
                digests[n] = digest_update(digests[n], index(n), ch.old, ch.new)
        sent = self._sent
        patch = codec.encode_patch(
            run_id=self.run_id,
            base_digest=self.state_digest,
            base_version=self.version,
            new_version=self.version + 1,
            specs=self.specs,
            changes=changes,
            new_bits=lambda n: self._bits(new_sent, n),
            old_bits=lambda n: self._bits(sent, n),
            leaf_digests=digests,
            config=self.config.codec,
            context=self._context,
        )
        t3 = time.perf_counter()
        self._sent, self._digests, self.version = new_sent, digests, self.version + 1
        for n, ch in changes.items():
            self._context.advance(n, ch.index, ch.new, ch.old)
        anchor, c3 = None, time.process_time()
        if self.version % self.config.anchor_every == 0:
            anchor = self._anchor()
        t4, c4 = time.perf_counter(), time.process_time()
        self._put(self.version, "patch", patch)
        if anchor is not None:
            self._put(self.version, "anchor", anchor)
        return Published(
            self.version,
            patch,
            anchor,
            {n: ch.count for n, ch in changes.items()},
            sum(s.numel for s in self.specs),
            sum(s.numel * s.itemsize for s in self.specs),
            mask_s=t1 - t0,
            extract_s=t2 - t1,
            encode_s=t3 - t2,
            anchor_s=t4 - t3,
            anchor_cpu_s=c4 - c3,
        )

    def _changes(self, bitmaps, new_sent, packed):
        """Each tensor's changes, and where each change is in its whole leaf (for the digest)."""
        trees = (jax.tree.leaves(bitmaps), jax.tree.leaves(self._sent), jax.tree.leaves(new_sent))
        if not self.shards:
            changes = {
                n: extract_changes(b, o, s, packed=p)
                for n, b, o, s, p in zip(self.names, *trees, packed, strict=True)
            }
            return changes, lambda n: changes[n].index
        changes, where = {}, {}
        bitmaps_l, old_l, new_l = trees
        olds = [{shard_start(s): s for s in primary_shards(x, local=True)} for x in old_l]
        # The bitmap is packed along the last axis: its shards are found by device.
        for n, (leaf, starts) in self._blocks.items():
            old = olds[leaf][starts]
            bm = next(s for s in bitmaps_l[leaf].addressable_shards if s.device == old.device)
            new = next(s for s in new_l[leaf].addressable_shards if s.device == old.device)
            local, ovals, nvals = shard_changes(bm, old, new, packed=packed[leaf])
            changes[n] = LeafChanges(local.astype(np.int64), ovals ^ nvals, ovals)
            where[n] = (starts, old.data.shape, self.leaf_specs[leaf].shape)

        def index(n):  # computed when the digest needs it, one block at a time
            return global_index(changes[n].index, *where[n])

        return changes, index

    def _put(self, version: int, kind: str, blob: bytes) -> None:
        if self.transport is not None:
            self.transport.put(version, kind, blob)
