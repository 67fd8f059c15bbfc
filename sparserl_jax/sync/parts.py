"""PULSESync from a publisher spread over processes: each process publishes the shards it holds.

A trainer whose leaves are sharded across processes cannot give any one process a whole leaf.
So every process p publishes *part p*: an ordinary PULSESync stream (anchors and format-3
patches, the run's id) over its primary shards (`replica_id == 0`), each a tensor named after
the block of its leaf it covers (`Publisher(shards=True)`, `extract.box_name`). Each element of a
leaf is in exactly one process's part. A block's digest hashes each element at its index in the
whole leaf, so the parts' digests of a leaf add up to the digest a single publisher would send.

Layout under one location (`open_transport(sub)` gives a `Transport` for a sub-location):

    part-<p>/    process p's blobs
    versions/    per version v, the leader's manifest (JSON, stored as kind "patch"): written
                 once every part's blob of v is there, so its presence is version v's READY
                 marker; it names the parts, the blob kinds and every leaf's global shape.

A `PartsReceiver` (any mesh, any number of devices, one process) follows each part with its own
`Receiver` (which validates every blob in full), and swaps in version v only when every part
reached v: it assembles each changed leaf on its own sharding from the blocks and checks the
assembled leaf's digest against the sum of its verified blocks' digests.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from sparserl_jax.sync import codec
from sparserl_jax.sync.errors import CorruptPatchError, MissingVersionError, RunMismatchError
from sparserl_jax.sync.extract import parse_box_name, primary_shards
from sparserl_jax.sync.header import check_run_id
from sparserl_jax.sync.mask import publish_bits, published_dtype, visible_bitmap
from sparserl_jax.sync.publisher import Published, Publisher, SyncConfig, leaf_names
from sparserl_jax.sync.receiver import ApplyEvent, Receiver, ShardingSpec, digest_of
from sparserl_jax.sync.transport import KvStoreTransport, Transport

MANIFEST_FORMAT = 1
VERSIONS = "versions/"
MAX_MANIFEST_BYTES = 16 * 2**20

OpenTransport = Callable[[str], Transport]


def part_location(process: int, part: int) -> str:
    """Where process `process`'s part `part` (its `part`-th device holding shards) goes."""
    return f"part-{process:04d}-{part:03d}/"


def kvstore_location(url: str, **kwargs) -> OpenTransport:
    """`open_transport` for a TensorStore kvstore URL (`file:///shared/sync/`, `gs://b/run/`)."""
    root = url if url.endswith("/") else url + "/"
    return lambda sub: KvStoreTransport(root + sub, **kwargs)


class PartPublisher:
    """This process's parts of every version, and (on process 0, the leader) the manifests.

    One part per device of this process that holds a primary shard: each part's anchor and
    patch hold one device's share, encoded one after another, so a process's host memory
    while it publishes follows its largest device share, not the sum of them. The device work
    (published bits, visible masks) runs once per version for all of them.

    Every process calls `publish` with the same global master at the same step (its arrays may
    span processes); none gathers a leaf. After writing its blobs each joins one small
    all-reduce (the leaves' digests, each process's part count, the totals), which the leader's
    manifest then follows; the leader also checks (up to `timeout_s`) that every listed part's
    blob is there, else `MissingVersionError`.
    """

    def __init__(
        self,
        open_transport: OpenTransport,
        *,
        run_id: str,
        config: SyncConfig | None = None,
        start_version: int = 0,
        devices=None,
        timeout_s: float = 120.0,
        poll_s: float = 0.02,
    ):
        """`devices`: whose shards this process publishes (default: its local devices)."""
        self.process = jax.process_index()
        self.run_id = check_run_id(run_id)
        self.config = config or SyncConfig()
        self._open, self._start_version = open_transport, start_version
        self._devices = list(jax.local_devices() if devices is None else devices)
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.subs: list[Publisher] = []  # one per part, made at the first publish
        self.version: int | None = None
        self.leaf_specs: list[codec.TensorSpec] = []
        self.leaf_digests: dict[str, np.ndarray] = {}
        self.parts: list[tuple[int, int]] = []  # every process's parts, as of the last version
        self._sent = None
        self._versions = open_transport(VERSIONS) if self.process == 0 else None

    @property
    def sent_bits(self):
        """The last published state's bits (global arrays, as the master is laid out)."""
        return self._sent

    def _make_parts(self, master) -> None:
        held = set()
        for x in jax.tree.leaves(master):
            held |= {s.device for s in primary_shards(x, local=True)}
        mine = [d for d in sorted(self._devices, key=lambda d: d.id) if d in held]
        self.subs = [
            Publisher(
                self._open(part_location(self.process, k)),
                config=self.config,
                start_version=self._start_version,
                run_id=self.run_id,
                shards=True,
                device=d,
            )
            for k, d in enumerate(mine)
        ]

    def publish(self, master) -> Published:
        """Publish this process's parts of the next version (and, on the leader, its manifest);
        returns the whole version's figures (every process's parts)."""
        pdt = self.config.jnp_publish_dtype
        master = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), master)
        first = self.version is None
        if first:
            self._make_parts(master)
            self.leaf_specs = [
                codec.TensorSpec(n, tuple(x.shape), published_dtype(x.dtype, pdt).name)
                for n, x in zip(leaf_names(master), jax.tree.leaves(master), strict=True)
            ]
            staged = sent = publish_bits(master, pdt)
        else:
            staged = visible_bitmap(master, self._sent, pdt)
            sent = staged[2]
        outs = [sub.publish(master, staged=staged) for sub in self.subs]
        self._sent = sent
        self.version = self._start_version if first else self.version + 1
        totals = self._combine(outs)
        if self._versions is not None:
            kinds = ["anchor"] if first else ["patch"]
            if not first and self.version % self.config.anchor_every == 0:
                kinds.append("anchor")
            self._wait_for_parts(self.version, kinds, self.parts)
            manifest = {
                "format": MANIFEST_FORMAT,
                "run_id": self.run_id,
                "version": self.version,
                "parts": [list(q) for q in self.parts],
                "kinds": kinds,
                "leaves": [[s.name, list(s.shape), s.dtype] for s in self.leaf_specs],
            }
            self._versions.put(self.version, "patch", json.dumps(manifest).encode())
        return totals

    @property
    def state_digest(self) -> str:
        """The digest of the last published whole state (`codec.state_digest` of the leaves)."""
        return codec.state_digest(self.leaf_specs, self.leaf_digests)

    def _combine(self, outs: list[Published]) -> Published:
        """Sum the leaves' digests, the part counts and the figures over every process."""
        specs, procs = self.leaf_specs, jax.process_count()
        local = np.zeros((len(specs) + procs + FIGURE_ROWS, 2), np.uint32)
        for sub in self.subs:
            for name, (leaf, _) in sub._blocks.items():
                local[leaf] += np.asarray(sub._digests[name], np.uint32)  # lanes wrap
        local[len(specs) + self.process, 0] = len(self.subs)
        figures = [
            sum(o.total_changed for o in outs),
            sum(o.numel for o in outs),
            sum(o.dense_bytes for o in outs),
            sum(o.payload_bytes for o in outs),
        ]
        local[len(specs) + procs :] = np.reshape([_limbs(v) for v in figures], (FIGURE_ROWS, 2))
        if procs > 1:
            local = _sum_over_processes(local)
        self.leaf_digests = {s.name: local[i] for i, s in enumerate(specs)}
        counts = local[len(specs) : len(specs) + procs, 0]
        self.parts = [(p, k) for p in range(procs) for k in range(int(counts[p]))]
        sums = [_from_limbs(x) for x in local[len(specs) + procs :].reshape(-1, LIMBS)]
        return Published(
            self.version,
            None,
            None,
            {"all parts": sums[0]},
            sums[1],
            sums[2],
            mask_s=max((o.mask_s for o in outs), default=0.0),
            extract_s=sum(o.extract_s for o in outs),
            encode_s=sum(o.encode_s for o in outs),
            anchor_s=sum(o.anchor_s for o in outs),
            anchor_cpu_s=sum(o.anchor_cpu_s for o in outs),
            payload_nbytes=sums[3],
        )

    def _wait_for_parts(self, version: int, kinds: list[str], parts) -> None:
        deadline = time.monotonic() + self.timeout_s
        missing = list(parts)
        while True:
            missing = [
                q
                for q in missing
                if any(version not in self._open(part_location(*q)).versions(k) for k in kinds)
            ]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise MissingVersionError(
                    f"version {version}: parts {missing} (process, part) not written within "
                    f"{self.timeout_s:g} s (are those trainer processes alive?)"
                )
            time.sleep(self.poll_s)


# The figures (changed elements, elements, bytes: 64-bit counts) cross the uint32 all-reduce
# as 16-bit limbs, whose sums over up to 2**16 processes cannot wrap; carries are resolved after.
LIMBS = 4
FIGURE_ROWS = 4 * LIMBS // 2  # 4 figures, 2 lanes per row


def _limbs(value: int) -> list[int]:
    return [(value >> (16 * i)) & 0xFFFF for i in range(LIMBS)]


def _from_limbs(limbs) -> int:
    return sum(int(x) << (16 * i) for i, x in enumerate(limbs))


def _sum_over_processes(x: np.ndarray) -> np.ndarray:
    """`x` (uint32, the same shape in every process) summed over the processes, mod 2**32: one
    all-reduce over a device of each process."""
    first = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)
    mesh = Mesh(np.array([first[p] for p in sorted(first)]), ("p",))
    stacked = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("p")), x[None]
    )
    total = jax.jit(
        lambda a: jnp.sum(a, axis=0, dtype=jnp.uint32),
        out_shardings=NamedSharding(mesh, PartitionSpec()),
    )(stacked)
    return np.asarray(total.addressable_data(0))


def read_manifest(blob: bytes) -> dict:
    """Parse and check a version manifest; raises `CorruptPatchError` on anything unexpected."""
    if len(blob) > MAX_MANIFEST_BYTES:
        raise CorruptPatchError(f"manifest of {len(blob)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        m = json.loads(blob)
    except (ValueError, RecursionError) as e:
        raise CorruptPatchError(f"manifest is not valid JSON: {e}") from e
    ok = (
        isinstance(m, dict)
        and m.get("format") == MANIFEST_FORMAT
        and type(m.get("version")) is int
        and isinstance(m.get("parts"), list)
        and len(m["parts"]) >= 1
        and all(
            isinstance(q, list) and len(q) == 2 and all(type(i) is int and i >= 0 for i in q)
            for q in m["parts"]
        )
        and isinstance(m.get("kinds"), list)
        and set(m["kinds"]) <= {"anchor", "patch"}
        and isinstance(m.get("leaves"), list)
        and all(
            isinstance(e, list)
            and len(e) == 3
            and isinstance(e[0], str)
            and isinstance(e[1], list)
            and all(type(d) is int and d >= 0 for d in e[1])
            and e[2] in codec.ITEMSIZES
            for e in m["leaves"]
        )
    )
    if not ok:
        raise CorruptPatchError(f"malformed parts manifest: {str(m)[:200]}")
    check_run_id(m["run_id"])
    return m


class PartsReceiver:
    """Follows a publish spread over processes and holds the whole weights on `sharding`.

    `sync(location)` takes the location's sub-transports (`open_transport`, as given to the
    `PartPublisher`s); it has `Receiver`'s interface otherwise (`version`, `state_digest`,
    `tree`, `sharding_of`), so a `Sampler` holds either.

    Args:
      sharding: per leaf name, its `Sharding` here (mapping or `(name, shape) -> Sharding`).
      run_id: the run to follow (None: the first manifest's).
      block_device: where the per-part receivers keep the blocks (default: the first local CPU
        device), next to their host copy of the bits; the assembled leaves live on `sharding`.
    """

    def __init__(
        self,
        sharding: ShardingSpec,
        *,
        run_id: str | None = None,
        block_device: jax.Device | None = None,
    ):
        self._open: OpenTransport | None = None
        self._versions: Transport | None = None
        self._sharding = sharding
        self.run_id = None if run_id is None else check_run_id(run_id)
        device = block_device or jax.local_devices(backend="cpu")[0]
        self._block_sharding = SingleDeviceSharding(device)
        self.version: int | None = None
        self.arrays: dict[str, jax.Array] = {}
        self.leaf_specs: list[codec.TensorSpec] | None = None
        self._parts: list[Receiver] = []
        self._transports: list[Transport] = []
        self._assembled_from: dict[str, tuple] = {}  # leaf -> the block arrays it was built from
        self.leaf_digests: dict[str, np.ndarray] = {}
        self.state_digest: str | None = None

    def sharding_of(self, name: str, shape: tuple[int, ...]):
        if callable(self._sharding):
            return self._sharding(name, shape)
        return self._sharding[name]

    def _manifest(self, version: int) -> dict:
        blob = self._versions.get(version, "patch")
        if blob is None:
            raise MissingVersionError(f"manifest of version {version} not available")
        m = read_manifest(blob)
        if m["version"] != version:
            raise CorruptPatchError(f"manifest stored as version {version} says {m['version']}")
        if self.run_id is not None and m["run_id"] != self.run_id:
            raise RunMismatchError(
                f"version {version} was published by run {m['run_id']!r}; this receiver follows "
                f"run {self.run_id!r}"
            )
        if self._parts and [tuple(q) for q in m["parts"]] != self._part_ids:
            raise CorruptPatchError(
                f"version {version} has parts {m['parts']}; this run had {self._part_ids}"
            )
        return m

    def _start(self, m: dict) -> None:
        self.run_id = m["run_id"]
        self.leaf_specs = [codec.TensorSpec(n, tuple(s), d) for n, s, d in m["leaves"]]
        shapes = {s.name: s.shape for s in self.leaf_specs}

        def block_of(name: str):
            leaf, starts = parse_box_name(name)
            if leaf not in shapes or len(starts) != len(shapes[leaf]):
                raise CorruptPatchError(f"tensor {name!r} is no block of a manifest leaf")
            return starts, shapes[leaf]

        self._part_ids = [tuple(q) for q in m["parts"]]
        self._transports = [self._open(part_location(*q)) for q in self._part_ids]
        self._parts = [
            Receiver(
                lambda name, shape: self._block_sharding, run_id=self.run_id, block_of=block_of
            )
            for _ in self._part_ids
        ]

    def sync(self, location: OpenTransport, target: int | None = None) -> list[ApplyEvent]:
        """Bring every part to `target` (default: the newest manifest) and swap in the whole
        state. Raises `SyncError` (the held weights stay at the last good version)."""
        if self._open is None:
            self._open, self._versions = location, location(VERSIONS)
        elif location is not self._open:
            raise ValueError("a PartsReceiver follows one location (make another for another)")
        available = self._versions.versions("patch")
        if target is None:
            if not available:
                raise MissingVersionError("no version published yet")
            target = available[-1]
        if self.version is not None and target <= self.version:
            return []
        m = self._manifest(target)
        if not self._parts:
            self._start(m)
        events: list[ApplyEvent] = []
        for receiver, transport in zip(self._parts, self._transports, strict=True):
            events += receiver.sync(transport, target)
        self._assemble(target)
        return events

    def _assemble(self, version: int) -> None:
        blocks: dict[str, list[tuple[tuple[int, ...], jax.Array, np.ndarray]]] = {}
        for receiver in self._parts:
            for name, arr in receiver.arrays.items():
                leaf, starts = parse_box_name(name)
                blocks.setdefault(leaf, []).append((starts, arr, receiver.digests[name]))
        arrays, pending, digests = dict(self.arrays), {}, {}
        for spec in self.leaf_specs:
            held = blocks.get(spec.name, [])
            want = np.zeros(2, np.uint32)
            for _, _, d in held:
                want = want + np.asarray(d, np.uint32)  # lanes wrap mod 2**32
            digests[spec.name] = want
            covered = sum(math.prod(a.shape) for _, a, _ in held)
            if covered != spec.numel:
                raise CorruptPatchError(
                    f"version {version}: the parts' blocks of {spec.name} cover {covered} of its "
                    f"{spec.numel} elements"
                )
            source = tuple(a for _, a, _ in held)
            last = self._assembled_from.get(spec.name, ())
            if len(last) == len(source) and all(a is b for a, b in zip(last, source, strict=True)):
                continue  # no block of this leaf changed (an apply replaces what it changes)
            arrays[spec.name] = _assemble_leaf(spec, held, self.sharding_of(spec.name, spec.shape))
            pending[spec.name] = (digest_of(arrays[spec.name]), want)
        bad = [n for n, (got, want) in pending.items() if not np.array_equal(np.asarray(got), want)]
        if bad:
            raise CorruptPatchError(
                f"version {version}: assembled leaves {bad[:5]} do not match their blocks' "
                f"digests; weights left at version {self.version}"
            )
        self.arrays, self.version, self.leaf_digests = arrays, version, digests
        self.state_digest = codec.state_digest(self.leaf_specs, digests)
        for spec in self.leaf_specs:
            self._assembled_from[spec.name] = tuple(a for _, a, _ in blocks[spec.name])

    def tree(self, treedef, names: list[str]):
        """The held arrays as a pytree with `treedef` (leaves in the order of `names`)."""
        return jax.tree.unflatten(treedef, [self.arrays[n] for n in names])


def _assemble_leaf(spec: codec.TensorSpec, held, sharding) -> jax.Array:
    """Leaf `spec` on `sharding`, each device's region copied from the blocks it overlaps."""
    hosts = [(starts, np.asarray(a)) for starts, a, _ in held]

    def region(index: tuple) -> np.ndarray:
        lo = [sl.start or 0 for sl in index] if index else []
        hi = [d if sl.stop is None else sl.stop for sl, d in zip(index, spec.shape, strict=True)]
        out = np.empty([h - low for low, h in zip(lo, hi, strict=True)], hosts[0][1].dtype)
        for starts, block in hosts:
            a = [max(low, s) for low, s in zip(lo, starts, strict=True)]
            b = [min(h, s + n) for h, s, n in zip(hi, starts, block.shape, strict=True)]
            if any(x >= y for x, y in zip(a, b, strict=True)):
                continue
            dst = tuple(slice(x - low, y - low) for x, y, low in zip(a, b, lo, strict=True))
            src = tuple(slice(x - s, y - s) for x, y, s in zip(a, b, starts, strict=True))
            out[dst] = block[src]
        return out

    return jax.make_array_from_callback(tuple(spec.shape), sharding, region)
