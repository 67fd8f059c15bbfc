"""Publisher -> receiver: bit-identity on a sampler sub-mesh, refusals, catch-up by anchors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.sync import (
    CodecConfig,
    CorruptPatchError,
    DuplicatePatchError,
    InProcessTransport,
    LeafChanges,
    MissingVersionError,
    OutOfOrderPatchError,
    Publisher,
    Receiver,
    SyncConfig,
    encode_patch,
    to_bits,
)
from sparserl_jax.sync.codec import ITEMSIZES
from sparserl_jax.testing.sync import SPECIAL_BITS, mutate, random_bits


def trainer_mesh():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))


def sampler_mesh():
    return Mesh(np.array(jax.devices()[4:8]), ("x",))


def sampler_sharding(name, shape):
    spec = P("x") if len(shape) >= 1 and shape[0] % 4 == 0 else P()
    return NamedSharding(sampler_mesh(), spec)


def host_bits(x) -> np.ndarray:
    return np.asarray(to_bits(x, None))


def assert_receiver_matches(rc: Receiver, pub: Publisher):
    for name, sent in zip(pub.names, jax.tree.leaves(pub.sent_bits), strict=True):
        got = rc.arrays[name]
        assert got.sharding.device_set == set(sampler_mesh().devices.flat)
        np.testing.assert_array_equal(host_bits(got), np.asarray(sent), err_msg=name)


DTYPES = ["float32", "bfloat16", "float16", "int32", "int8", "bool"]
SHAPES = [(8, 6), (5,), (4, 3, 2), (12,)]


@st.composite
def runs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    leaves = [
        (draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SHAPES)))
        for _ in range(draw(st.integers(1, 3)))
    ]
    steps = [
        (
            draw(st.sampled_from(["sparse", "signs", "nudge", "none", "all"])),
            draw(st.sampled_from([0.02, 0.3])),
        )
        for _ in range(draw(st.integers(1, 4)))
    ]
    publish_dtype = draw(st.sampled_from(["bfloat16", "keep"]))
    return rng, leaves, steps, publish_dtype


def as_array(bits: np.ndarray, dtype: str, sharding):
    host = bits.astype(bool) if dtype == "bool" else bits.view(jnp.dtype(dtype))
    return jax.device_put(host, sharding)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(runs())
def test_random_trees_rebuild_bit_identically(run):
    rng, leaves, steps, publish_dtype = run
    tm = trainer_mesh()
    shardings = [NamedSharding(tm, P("a") if s[0] % 2 == 0 else P()) for _, s in leaves]
    master_bits = [random_bits(rng, s, ITEMSIZES[d], d) for d, s in leaves]
    tr = InProcessTransport()
    pub = Publisher(tr, config=SyncConfig(anchor_every=3, publish_dtype=publish_dtype))
    rc = Receiver(sampler_sharding)
    for step in range(len(steps) + 1):
        if step:
            pattern, density = steps[step - 1]
            master_bits = [
                mutate(rng, b, pattern, density, d)
                for b, (d, _) in zip(master_bits, leaves, strict=True)
            ]
        master = {
            f"l{i}": as_array(b, d, sh)
            for i, (b, (d, _), sh) in enumerate(zip(master_bits, leaves, shardings, strict=True))
        }
        pub.publish(master)
        # The sent state is exactly bits(publish(master)): nothing drifts.
        pdt = None if publish_dtype == "keep" else jnp.bfloat16
        sent_leaves = jax.tree.leaves(pub.sent_bits)
        for name, sent, x in zip(pub.names, sent_leaves, jax.tree.leaves(master), strict=True):
            np.testing.assert_array_equal(np.asarray(sent), np.asarray(to_bits(x, pdt)), name)
        events = rc.sync(tr)
        assert all(e.error is None for e in events)
        assert rc.version == pub.version
        assert_receiver_matches(rc, pub)


# Catch-up, late join, refusals and restarts hold for the format the publisher writes.


def _run(n_versions: int, anchor_every: int = 3):
    rng = np.random.default_rng(0)
    tm = trainer_mesh()
    master = {
        "w": jax.device_put(
            rng.standard_normal((16, 12)).astype(np.float32) * 0.02, NamedSharding(tm, P("a", "b"))
        ),
        "b": jnp.asarray(rng.standard_normal(5).astype(np.float32)),
    }
    tr = InProcessTransport()
    pub = Publisher(tr, config=SyncConfig(anchor_every=anchor_every))
    pub.publish(master)
    for _ in range(n_versions):
        master = jax.tree.map(lambda x: x - 1e-3 * jnp.sign(x) * (jnp.abs(x) > 0.01), master)
        pub.publish(master)
    return tr, pub


def snapshot(rc: Receiver):
    return {k: host_bits(v) for k, v in rc.arrays.items()}


def test_out_of_order_and_duplicate_are_refused_without_touching_weights():
    tr, pub = _run(3)
    rc = Receiver(sampler_sharding)
    rc.apply(tr.get(0, "anchor"))
    rc.apply(tr.get(1, "patch"))
    before = snapshot(rc)
    with pytest.raises(OutOfOrderPatchError, match=r"base version 2 != receiver version 1"):
        rc.apply(tr.get(3, "patch"))
    with pytest.raises(DuplicatePatchError, match="already applied"):
        rc.apply(tr.get(1, "patch"))
    with pytest.raises(DuplicatePatchError, match="not newer"):
        rc.apply(tr.get(0, "anchor"))
    assert rc.version == 1
    for k, v in snapshot(rc).items():
        np.testing.assert_array_equal(v, before[k])
    rc.apply(tr.get(2, "patch"))
    rc.apply(tr.get(3, "patch"))
    assert_receiver_matches(rc, pub)


@pytest.mark.parametrize("damage", ["drop", "flip", "truncate", "reordered", "duplicate"])
def test_damaged_or_missing_version_is_recovered_from_anchor(damage):
    tr, pub = _run(7, anchor_every=3)
    rc = Receiver(sampler_sharding)
    rc.sync(tr, target=1)
    blob = tr.get(2, "patch")
    if damage == "drop":
        tr.drop(2, "patch")
    elif damage == "flip":
        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 0x10
        tr.put(2, "patch", bytes(bad))
    elif damage == "truncate":
        tr.put(2, "patch", blob[:-7])
    elif damage == "reordered":  # patch 3 -> 4 arrives where 1 -> 2 was expected
        tr.put(2, "patch", tr.get(4, "patch"))
    else:  # patch 0 -> 1 delivered again
        tr.put(2, "patch", tr.get(1, "patch"))
    events = rc.sync(tr)
    assert rc.version == 7
    assert_receiver_matches(rc, pub)
    if damage != "drop":
        expect = {
            "flip": "checksum",
            "truncate": "bytes",
            "reordered": "base version 3 != receiver version 1",
            "duplicate": "already applied",
        }[damage]
        assert events[0].version == 2 and expect in events[0].error
    kinds = [(e.version, e.kind) for e in events if e.error is None]
    assert kinds == [(6, "anchor"), (7, "patch")]


def test_late_joiner_starts_from_last_anchor():
    tr, pub = _run(5, anchor_every=3)
    rc = Receiver(sampler_sharding)
    events = rc.sync(tr)
    assert [(e.version, e.kind) for e in events] == [(3, "anchor"), (4, "patch"), (5, "patch")]
    assert_receiver_matches(rc, pub)


def test_no_route_raises_clear_error():
    tr, _ = _run(4, anchor_every=3)
    rc = Receiver(sampler_sharding)
    rc.sync(tr, target=3)
    tr.drop(4, "patch")
    with pytest.raises(MissingVersionError, match=r"no anchor in \(3, 4\]"):
        rc.sync(tr, target=4)
    assert rc.version == 3


def test_wrong_values_with_valid_checksums_are_refused_by_digest():
    tr, pub = _run(1)
    rc = Receiver(sampler_sharding)
    rc.apply(tr.get(0, "anchor"))
    before = snapshot(rc)
    good = Receiver(sampler_sharding)
    good.sync(tr)
    # Forge version 1: the real per-leaf digests, but one value bit wrong in "['w']".
    digests = dict(good.digests)
    changes = {}
    for name in pub.names:
        old, new = before[name].reshape(-1), host_bits(good.arrays[name]).reshape(-1)
        idx = np.flatnonzero(old != new)
        changes[name] = LeafChanges(idx, old[idx] ^ new[idx], old[idx])
    ch = changes["['w']"]
    changes["['w']"] = LeafChanges(ch.index, ch.delta ^ np.uint16(1), ch.old)
    forged = encode_patch(
        run_id=pub.run_id,
        base_version=0,
        base_digest=rc.state_digest,
        new_version=1,
        specs=rc.specs,
        changes=changes,
        new_bits=lambda n: host_bits(good.arrays[n]),
        old_bits=before.__getitem__,
        leaf_digests=digests,
        config=CodecConfig(),
    )
    with pytest.raises(CorruptPatchError, match=r"digest mismatch after apply in \[\"\['w'\]\"\]"):
        rc.apply(forged)
    assert rc.version == 0
    for k, v in snapshot(rc).items():
        np.testing.assert_array_equal(v, before[k])


def test_special_values_survive_on_sampler_mesh():
    bits = np.array(SPECIAL_BITS[2] * 4, np.uint16)[:40].reshape(8, 5)
    master = {"w": jnp.asarray(bits.view(jnp.bfloat16))}
    tr = InProcessTransport()
    pub = Publisher(tr, config=SyncConfig(publish_dtype="keep"))
    pub.publish(master)
    flipped = bits ^ np.uint16(0x8000)
    pub.publish({"w": jnp.asarray(flipped.view(jnp.bfloat16))})
    rc = Receiver(sampler_sharding)
    rc.sync(tr)
    np.testing.assert_array_equal(host_bits(rc.arrays["['w']"]), flipped)


def test_start_version_continues_numbering_after_a_restart():
    """A resumed trainer publishes an anchor at the version it had reached, then patches on top;
    a fresh receiver joins from that anchor and stays bit-exact."""
    master = {"w": jnp.arange(24, dtype=jnp.float32).reshape(8, 3) / 7, "b": jnp.ones((5,))}
    transport = InProcessTransport()
    config = SyncConfig(anchor_every=4)
    pub = Publisher(transport, config=config, start_version=6)
    assert pub.publish(master).version == 6
    rc = Receiver(sampler_sharding)
    rc.sync(transport)
    assert rc.version == 6
    for v in (7, 8):
        master = jax.tree.map(lambda x: x * 1.5, master)
        out = pub.publish(master)
        assert out.version == v and out.patch is not None
        assert (out.anchor is not None) == (v == 8)
        rc.sync(transport)
        assert rc.version == v
        assert_receiver_matches(rc, pub)
    with pytest.raises(ValueError, match="start_version"):
        Publisher(start_version=-1)


def test_format3_apply_reads_no_leaf_back_from_the_devices(monkeypatch):
    """A format-3 patch codes against the receiver's old bits: the receiver holds them on the
    host from the first patch on, so later applies copy no leaf from device to host (counted on
    every `jax.Array.__array__` of a leaf-sized array), and the bits stay exact."""
    from jax._src.array import ArrayImpl

    rng = np.random.default_rng(3)
    leaves = {"w": (32, 24), "v": (40,)}
    bits = {n: random_bits(rng, s, 4, "float32") for n, s in leaves.items()}
    tr = InProcessTransport()
    pub = Publisher(tr, config=SyncConfig(anchor_every=100))
    rc = Receiver(sampler_sharding)
    reads = []
    to_host = ArrayImpl.__array__

    def counting(self, *args, **kwargs):
        if self.size >= 40:  # a leaf, not a digest
            reads.append(self.shape)
        return to_host(self, *args, **kwargs)

    monkeypatch.setattr(ArrayImpl, "__array__", counting)
    for step in range(4):
        if step:
            bits = {n: mutate(rng, b, "sparse", 0.05, "float32") for n, b in bits.items()}
        master = {n: jnp.asarray(b.view(np.float32)) for n, b in bits.items()}
        pub.publish(master)
        reads.clear()
        assert all(e.error is None for e in rc.sync(tr))
        # The first patch (step 1) reads each leaf once; no apply after it reads any.
        assert sorted(reads) == (sorted(leaves.values()) if step == 1 else []), (step, reads)
    monkeypatch.undo()
    assert_receiver_matches(rc, pub)


def test_publisher_reads_old_bits_only_for_a_cut_it_does_not_hold(monkeypatch):
    """The publisher's context (`ContextCache`) holds each leaf's exponent histogram and class
    bitmaps: a patch reads a leaf's old bits in full only the first time and for a context cut
    the leaf has not used before (counted on the codec's reader), and the bytes do not change."""
    from sparserl_jax.sync import codec
    from sparserl_jax.sync.header import read_header
    from sparserl_jax.sync.order import ContextCache

    rng = np.random.default_rng(5)
    spread = np.exp(rng.normal(0, 1.5, (96, 64)))  # exponents over a wide range: cuts are used
    master = {"w": (rng.normal(0, 0.02, (96, 64)) * spread).astype(np.float32)}
    tr = InProcessTransport()
    pub = Publisher(tr, config=SyncConfig(anchor_every=100))
    pub._context = ContextCache(max_cuts=16)  # room for every cut used here: none evicted
    reads = []
    encode = codec.encode_patch

    def counting(**kw):
        read = kw["old_bits"]
        kw["old_bits"] = lambda n: reads.append(n) or read(n)
        return encode(**kw)

    monkeypatch.setattr(codec, "encode_patch", counting)
    pub.publish(master)
    seen, want = set(), []
    for _ in range(6):
        master = {"w": master["w"] + rng.normal(0, 2e-5, (96, 64)).astype(np.float32)}
        reads.clear()
        out = pub.publish(master)
        (entry,) = read_header(out.patch)["tensors"]
        assert entry["encoding"] == "sparse"
        new_cut = not seen or not set(entry["context"]) <= seen
        seen |= set(entry["context"])
        want.append(new_cut)
        assert reads == (["['w']"] if new_cut else []), (entry["context"], reads)
    assert want[0] and not all(want)  # the first patch reads, a later one does not
    rc = Receiver(sampler_sharding)
    assert all(e.error is None for e in rc.sync(tr))
    assert_receiver_matches(rc, pub)
