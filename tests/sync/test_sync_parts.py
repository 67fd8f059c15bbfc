"""PULSESync from a publisher spread over processes (`sync.parts`).

In-process (8 CPU devices, one process holding every part): the parts' blocks add up to the
single publisher's digests, receivers on 1, 2 and 8 devices hold its bits, bad manifests and a
missing part are refused. Across processes (slow): two processes of 4 CPU devices each joined by
`jax.distributed`, a leaf sharded over all 8 devices on its last axis, a replicated leaf and a
64 MB bf16 leaf, 5 publishes; the processes may not gather (process_allgather and friends refuse
anything over 1 KiB) and each one's host allocations while publishing a patch stay under 0.6x
the big leaf's bf16 size; receivers in this process on 1, 2 and 8 devices verify every version
and hold the bits of a single publisher fed the same states, whose patches are within 5% of the
two parts' bytes.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.sync.errors import CorruptPatchError, MissingVersionError
from sparserl_jax.sync.parts import (
    VERSIONS,
    PartPublisher,
    PartsReceiver,
    kvstore_location,
    part_location,
    read_manifest,
)
from sparserl_jax.sync.publisher import Publisher
from sparserl_jax.sync.transport import InProcessTransport
from sparserl_jax.testing.processes import join, run_processes

RUN = "parts-test-0001"
VERSIONS_N = 5
WALL_S = 300
# Leaf shapes: "w" sharded on its last axis over every device, "b" replicated, "big" (64 MB of
# bf16, only across processes) sharded on its leading axis.
SMALL = {"w": (16, 512), "b": (24,)}
BIG = {"big": (4096, 8192)}
MASK32 = np.uint64(0xFFFFFFFF)


def values(shape, index, version: int) -> np.ndarray:
    """The master's values at `index` of a leaf of `shape`, computed for that region only (no
    process builds a whole leaf): a smooth base, and ~1% of the elements moved per version (as
    bf16 weights at RL learning rates, PULSE's regime)."""
    grids = np.meshgrid(
        *[np.arange(sl.start or 0, sl.stop or d) for sl, d in zip(index, shape, strict=True)],
        indexing="ij",
    )
    flat = np.zeros(grids[0].shape if grids else (), np.int64)
    for g, d in zip(grids, shape, strict=True):
        flat = flat * d + g
    base = np.sin(flat * 1e-3).astype(np.float32)
    moved = np.zeros_like(base)
    for v in range(1, version + 1):
        h = (flat.astype(np.uint64) + np.uint64(v * 0x9E3779B1)) & MASK32
        h = ((h ^ (h >> np.uint64(16))) * np.uint64(0x85EBCA6B)) & MASK32  # a murmur finaliser:
        h = ((h ^ (h >> np.uint64(13))) * np.uint64(0xC2B2AE35)) & MASK32  # positions at random
        hit = (h ^ (h >> np.uint64(16))) % np.uint64(100) == 0
        moved = moved + np.where(hit, 0.01 * v, 0.0).astype(np.float32)
    return base + moved


def shardings(mesh: Mesh, names) -> dict[str, NamedSharding]:
    axes = tuple(mesh.axis_names)
    spec = {"w": P(None, axes), "b": P(), "big": P(axes, None)}
    return {n: NamedSharding(mesh, spec[n]) for n in names}


def master(shapes: dict, mesh: Mesh, version: int) -> dict:
    out = {}
    for name, sharding in shardings(mesh, shapes).items():
        shape = shapes[name]
        out[name] = jax.make_array_from_callback(
            shape, sharding, lambda idx, s=shape: values(s, idx, version)
        )
    return out


def receiver_sharding(devices):
    if len(devices) == 1:
        return lambda name, shape: SingleDeviceSharding(devices[0])
    mesh = Mesh(np.array(devices), ("x",))
    return lambda name, shape: NamedSharding(mesh, P(*([None] * (len(shape) - 1)), "x"))


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def test_one_process_parts_equal_a_single_publisher(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("p", "d"))
    loc = kvstore_location(f"file://{tmp_path}")
    parts = PartPublisher(loc, run_id=RUN)
    single = Publisher(InProcessTransport(), run_id=RUN)
    digests = []
    for v in range(VERSIONS_N):
        m = master(SMALL, mesh, v)
        parts.publish(m)
        single.publish(m)
        # The whole state's digest is the one a single publisher of the leaves sends.
        assert parts.state_digest == single.state_digest
        digests.append(single.state_digest)
    # The blocks' digests (each element hashed at its index in the leaf) add up to the leaf's.
    sums = {}
    for name, d in [kv for sub in parts.subs for kv in sub._digests.items()]:
        leaf = name.rpartition("#")[0]
        sums[leaf] = sums.get(leaf, np.zeros(2, np.uint32)) + d
    assert sums.keys() == single._digests.keys()
    for leaf, d in sums.items():
        np.testing.assert_array_equal(d, single._digests[leaf])
    # One part per device: w's block on each, b's one replica on the first.
    assert [len(sub.specs) for sub in parts.subs] == [2] + [1] * 7
    for n in (1, 2, 8):
        rc = PartsReceiver(receiver_sharding(jax.devices()[:n]))
        for v in range(VERSIONS_N):
            rc.sync(loc, v)
            assert rc.version == v
            assert rc.state_digest == digests[v]
        for name, held in rc.arrays.items():
            np.testing.assert_array_equal(_bits(held), _bits(single.sent_bits[name[2:-2]]))


def test_a_bad_manifest_or_a_missing_part_is_refused(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("p", "d"))
    loc = kvstore_location(f"file://{tmp_path}")
    # A part that never appears: the leader gives up within its timeout, with one clear error.
    leader = PartPublisher(loc, run_id=RUN, timeout_s=0.3)
    leader.publish(master(SMALL, mesh, 0))
    with pytest.raises(MissingVersionError, match=r"parts \[\(1, 0\)\] \(process, part\) not"):
        leader._wait_for_parts(0, ["anchor"], [(0, 0), (1, 0)])
    loc(VERSIONS).put(0, "patch", b'{"format": 1, "version": 0}')
    with pytest.raises(CorruptPatchError, match="malformed parts manifest"):
        PartsReceiver(receiver_sharding(jax.devices()[:1])).sync(loc)
    # A block whose bits were altered in storage: its receiver refuses the part, nothing swaps.
    good = kvstore_location(f"file://{tmp_path}/good")
    pub = PartPublisher(good, run_id=RUN)
    pub.publish(master(SMALL, mesh, 0))
    pub.publish(master(SMALL, mesh, 1))
    rc = PartsReceiver(receiver_sharding(jax.devices()[:2]))
    rc.sync(good, 0)
    held = {k: _bits(v).copy() for k, v in rc.arrays.items()}
    t = good(part_location(0, 3))
    blob = bytearray(t.get(1, "patch"))
    blob[-5] ^= 0xFF
    t.put(1, "patch", bytes(blob))
    with pytest.raises(MissingVersionError):
        rc.sync(good, 1)
    assert rc.version == 0
    for k, v in rc.arrays.items():
        np.testing.assert_array_equal(_bits(v), held[k])


@pytest.mark.slow
def test_two_processes_publish_their_shards_without_gathering(tmp_path):
    outs = [tmp_path / f"process{p}.json" for p in range(2)]
    sync_dir = tmp_path / "sync"
    args = [[str(sync_dir), str(o)] for o in outs]
    run_processes(__file__, args, devices_per_process=4, wall_s=WALL_S)
    results = [json.loads(o.read_text()) for o in outs]

    shapes = {**SMALL, **BIG}
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("p", "d"))
    single = Publisher(InProcessTransport(), run_id=RUN)
    loc = kvstore_location(f"file://{sync_dir}")
    receivers = {n: PartsReceiver(receiver_sharding(jax.devices()[:n])) for n in (1, 2, 8)}
    part_bytes, single_bytes = [], []
    for v in range(VERSIONS_N):
        out = single.publish(master(shapes, mesh, v))
        for r in results:  # each process's digest of the whole state (its small all-reduce)
            assert r["state_digests"][v] == single.state_digest
        for n, rc in receivers.items():
            rc.sync(loc, v)
            assert rc.version == v and rc.state_digest == single.state_digest
            for name, held in rc.arrays.items():
                want = _bits(single.sent_bits[name[2:-2]])
                np.testing.assert_array_equal(_bits(held), want, err_msg=f"{n} devices, v{v}")
        if v:
            kinds = ("patch",)
            ids = read_manifest(loc(VERSIONS).get(v, "patch"))["parts"]
            assert sorted(ids) == [[p, k] for p in (0, 1) for k in range(4)]  # one per device
            part_bytes.append(
                sum(len(loc(part_location(*q)).get(v, k)) for q in ids for k in kinds)
            )
            # Every process's figures are the whole version's (its small all-reduce).
            assert [r["payload_bytes"][v] for r in results] == [part_bytes[-1]] * 2
            single_bytes.append(len(out.patch))
    # Each block was written by exactly one process, and together they tile every leaf.
    blocks = [set(r["blocks"]) for r in results]
    assert not blocks[0] & blocks[1]
    assert {b.rpartition("#")[0] for b in blocks[0] | blocks[1]} == {f"['{n}']" for n in shapes}
    big = 2 * np.prod(BIG["big"])
    for r in results:
        assert r["gathered_bytes"] <= 1024, r
        assert max(r["patch_peak_bytes"]) < 0.6 * big, (r["patch_peak_bytes"], big)
    ratio = sum(part_bytes) / sum(single_bytes)
    peaks = [r["patch_peak_bytes"] for r in results]
    print(f"patch bytes, 2 parts / 1 publisher: {ratio:.4f} ({part_bytes} vs {single_bytes})")
    anchors = [r["anchor_peak_bytes"] for r in results]
    print(f"host peak per process: patches {peaks}, anchors {anchors}")
    assert ratio <= 1.05, (part_bytes, single_bytes)


def test_a_sampler_follows_a_parts_publish_through_the_exchange(tmp_path):
    """A trainer incarnation whose epoch record says `sync_parts`: the sampler job gives its
    sampler a `PartsReceiver` on the epoch's sync location, and the weights it then holds are
    the trainer's (a model's parameters sharded on an 8-device mesh, published as parts)."""
    from flax import nnx

    from sparserl_jax.config import RolloutConfig
    from sparserl_jax.decoupled.exchange import Exchange
    from sparserl_jax.decoupled.sampler_job import follow_epoch
    from sparserl_jax.models.transformer import Transformer
    from sparserl_jax.parallel import make_mesh
    from sparserl_jax.parallel.sharding import create_sharded
    from sparserl_jax.sampler import Sampler, published_params, sampler_shardings
    from sparserl_jax.testing.fixtures import tiny_model_config

    mesh = make_mesh(None, jax.devices()[:8])
    model = create_sharded(lambda: Transformer(tiny_model_config(), rngs=nnx.Rngs(0)), mesh)
    params = nnx.to_pure_dict(nnx.state(model))
    ex = Exchange(f"file://{tmp_path}/exchange/")
    single = ex.begin_epoch({})
    epoch = ex.begin_epoch({"sync_parts": 1})
    pub = PartPublisher(ex.sync_location(epoch), run_id=RUN)
    pub.publish(params)
    moved = jax.tree.map(lambda x: x * 1.01, params)
    pub.publish(moved)
    sampler = Sampler.create(
        model,
        params,
        RolloutConfig(max_new_tokens=4, max_prompt_len=4),
        shardings=sampler_shardings(model, mesh),
        publish_dtype=jnp.bfloat16,
        mesh=mesh,
    )
    assert not isinstance(follow_epoch(ex, single, sampler), type(ex.sync_location(epoch)))
    location = follow_epoch(ex, epoch, sampler)
    assert isinstance(sampler.receiver, PartsReceiver)
    events = sampler.sync(location)
    assert sampler.version == 1 and all(e.error is None for e in events)
    assert sampler.receiver.state_digest == pub.state_digest
    want = published_params(pub.sent_bits, params, jnp.bfloat16)
    got = sampler.params()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_figures_cross_the_uint32_all_reduce_without_wrapping():
    """Element and byte counts of a 7B model pass 2**32: summed over processes as 16-bit limbs
    in uint32 (as `_sum_over_processes` adds them), they come back exact."""
    from sparserl_jax.sync.parts import _from_limbs, _limbs

    values = [7 * 2**32 + 5, 2**32 - 1, 3 * 2**40 + 2**31]
    summed = np.sum([np.asarray(_limbs(v), np.uint32) for v in values], axis=0, dtype=np.uint32)
    assert _from_limbs(summed) == sum(values)


def child(sync_dir: str, out_path: str) -> None:
    import tracemalloc

    from jax.experimental import multihost_utils

    gathered = [0]

    def refuse_large(fn):
        def wrapped(x, *args, **kwargs):
            size = sum(np.asarray(a).nbytes for a in jax.tree.leaves(x))
            gathered[0] = max(gathered[0], size)
            if size > 1024:
                raise AssertionError(f"{fn.__name__} of {size} bytes during publish")
            return fn(x, *args, **kwargs)

        return wrapped

    for name in ("process_allgather", "broadcast_one_to_all", "host_local_array_to_global_array"):
        setattr(multihost_utils, name, refuse_large(getattr(multihost_utils, name)))
    try:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = Mesh(np.array(devices).reshape(2, 4), ("p", "d"))
        shapes = {**SMALL, **BIG}
        pub = PartPublisher(kvstore_location(f"file://{sync_dir}"), run_id=RUN)
        peaks, state_digests, payloads = [], [], []
        for v in range(VERSIONS_N):
            m = master(shapes, mesh, v)
            jax.block_until_ready(m)
            tracemalloc.start()
            payloads.append(pub.publish(m).payload_bytes)
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            state_digests.append(pub.state_digest)
        result = {
            "blocks": [s.name for sub in pub.subs for s in sub.specs],
            "gathered_bytes": gathered[0],
            "anchor_peak_bytes": peaks[0],
            "patch_peak_bytes": peaks[1:],
            "state_digests": state_digests,
            "payload_bytes": payloads,
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    child(*join(sys.argv))
