"""Receiver apply: the chunked, padded scatter is exact, compiles a bounded number of programs,
and both verify modes refuse a corrupted base."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.compiles import CompileCount
from sparserl_jax.sync import (
    CorruptPatchError,
    InProcessTransport,
    Publisher,
    Receiver,
    decode,
    to_bits,
)
from sparserl_jax.sync.receiver import _scatter_first, scatter_changes, scatter_chunk
from sparserl_jax.testing.sync import np_digest, random_bits, uint

DTYPES = {"bfloat16": 2, "float32": 4, "int8": 1, "bool": 1}


def as_array(bits: np.ndarray, dtype: str, sharding):
    host = bits.astype(bool) if dtype == "bool" else bits.view(jnp.dtype(dtype))
    return jax.device_put(host, sharding)


@st.composite
def sparse_changes(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(1, 13), min_size=1, max_size=3)))
    numel = int(np.prod(shape))
    n = draw(st.integers(0, numel))
    index = np.sort(rng.choice(numel, n, replace=False)).astype(np.int64)
    old = random_bits(rng, shape, DTYPES[dtype], dtype)
    new = random_bits(rng, (n,), DTYPES[dtype], dtype)
    chunk = draw(st.sampled_from([None, 1, 3, 8]))
    return dtype, old, index, new, draw(st.booleans()), chunk, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(sparse_changes())
def test_padded_scatter_is_bit_identical_to_the_reference(case):
    dtype, old, index, new, xor, chunk, sharded = case
    mesh = Mesh(np.array(jax.devices()[4:8]), ("x",))
    sharding = (
        NamedSharding(mesh, P("x") if old.shape[0] % 4 == 0 else P())
        if sharded
        else SingleDeviceSharding(jax.devices()[0])
    )
    arr = as_array(old, dtype, sharding)
    ref = old.reshape(-1).copy()
    ref[index] = new
    vals = new ^ old.reshape(-1)[index] if xor else new
    out, change = scatter_changes(arr, index, vals, xor=xor, sharding=sharding, chunk=chunk)
    got = np.asarray(to_bits(out, None)).reshape(-1)
    np.testing.assert_array_equal(got, ref.astype(got.dtype))
    assert out.sharding.is_equivalent_to(sharding, old.ndim) and out.dtype == arr.dtype
    np.testing.assert_array_equal(np.asarray(to_bits(arr, None)), old)  # the held array is kept
    # The digest change is exactly digest(new) - digest(old), lane by lane mod 2**32.
    np.testing.assert_array_equal(np_digest(old) + change, np_digest(ref))


def test_scatter_chunk_is_a_bounded_power_of_two():
    for numel in (1, 5, 512, 3000, 2**18, 2**22 + 7, 2**31):
        c = scatter_chunk(numel)
        assert c & (c - 1) == 0 and c <= 1 << 20
        assert c >= min(numel, 1 << 12)  # a leaf under 4096 elements takes one call
        assert -(-numel * 2 // 3) <= 64 * c or c == 1 << 20  # a sparse patch: <= ~43 calls


def _publish_counts(counts, seed=0):
    """A publisher whose version v changes exactly counts[v-1] elements of `w`, a few of `b`."""
    rng = np.random.default_rng(seed)
    bits = {
        "w": random_bits(rng, (512, 512), 2, "bfloat16"),
        "b": random_bits(rng, (700,), 2, "bfloat16"),
    }
    bits = {k: (v & np.uint16(0x3FFF)) | np.uint16(0x3800) for k, v in bits.items()}  # finite

    def master():
        return {k: jnp.asarray(v.view(jnp.bfloat16)).astype(jnp.float32) for k, v in bits.items()}

    tr = InProcessTransport()
    pub = Publisher(tr)
    pub.publish(master())
    for k in counts:
        for name, n in (("w", k), ("b", 1 + k % 7)):
            flat = bits[name].reshape(-1)
            flat[rng.choice(flat.size, n, replace=False)] ^= np.uint16(1)
        out = pub.publish(master())
        assert out.changed == {"['b']": 1 + k % 7, "['w']": k}
    return tr, pub


@pytest.mark.parametrize("verify", ["all", "touched"])
def test_varying_change_counts_compile_a_bounded_number_of_programs(verify):
    counts = [3, 40, 700, 5000, 20000, 90, 12000, 1, 30000, 257]
    assert len({max(8, 1 << (n - 1).bit_length()) for n in counts}) == 8  # powers of two: 8 sizes
    tr, pub = _publish_counts(counts)
    rc = Receiver(lambda n, s: SingleDeviceSharding(jax.devices()[1]), verify=verify)
    rc.apply(tr.get(0, "anchor"))
    per_step = []
    for v in range(1, len(counts) + 1):
        with CompileCount() as c:
            rc.apply(tr.get(v, "patch"))
        per_step.append(c.total)
    # Two leaf signatures: `w` (4096-entry chunks: a first and an in-place scatter, 2 programs) and
    # `b` (one chunk: 1 program), plus one digest program each when every leaf is re-hashed.
    assert sum(per_step) <= (5 if verify == "all" else 3), per_step
    assert per_step[5:] == [0] * 5  # flat once both of `w`'s programs exist (step 4: 5000 > 4096)
    for name, sent in zip(pub.names, jax.tree.leaves(pub.sent_bits), strict=True):
        np.testing.assert_array_equal(np.asarray(to_bits(rc.arrays[name], None)), sent)
    assert rc.state_digest == pub.state_digest


def _corrupt(rc: Receiver, name: str, flat_index: int) -> None:
    bits = np.asarray(to_bits(rc.arrays[name], None)).copy()
    bits.reshape(-1)[flat_index] ^= uint(bits.itemsize).type(1)
    rc.arrays[name] = jax.device_put(bits.view(rc.arrays[name].dtype), rc.arrays[name].sharding)


@pytest.mark.parametrize("verify", ["all", "touched"])
@pytest.mark.parametrize("where", ["written", "elsewhere"])
def test_verify_modes_refuse_a_corrupted_base(verify, where):
    tr, pub = _publish_counts([50, 60, 70])
    rc = Receiver(lambda n, s: SingleDeviceSharding(jax.devices()[0]), verify=verify)
    rc.sync(tr, target=1)
    base = lambda n: np.asarray(rc.arrays[n])  # noqa: E731  (the receiver's bits, uncorrupted)
    patch_index = decode(tr.get(2, "patch"), expect=rc.specs, base=base).tensors["['w']"].index
    untouched = np.setdiff1d(np.arange(512 * 512), patch_index)
    _corrupt(rc, "['w']", int(patch_index[7] if where == "written" else untouched[123]))
    held = {k: np.asarray(to_bits(v, None)) for k, v in rc.arrays.items()}
    if verify == "touched" and where == "elsewhere":
        # "touched" trusts the held bits outside the patch; the next full check finds them.
        rc.apply(tr.get(2, "patch"))
        assert rc.version == 2
        rc.verify = "all"
        with pytest.raises(CorruptPatchError, match=r"digest mismatch after apply in \[\"\['w'\]"):
            rc.apply(tr.get(3, "patch"))
        return
    if verify == "all" and where == "written":
        # Format 3 decodes against the receiver's host copy of the bits and writes the new bits:
        # the patch overwrites the corrupted element, and the full check proves the result.
        rc.sync(tr)
        assert rc.version == 3
        for name, sent in zip(pub.names, jax.tree.leaves(pub.sent_bits), strict=True):
            np.testing.assert_array_equal(np.asarray(to_bits(rc.arrays[name], None)), sent)
        return
    with pytest.raises(CorruptPatchError, match=r"digest mismatch after apply in \[\"\['w'\]\"\]"):
        rc.apply(tr.get(2, "patch"))
    assert rc.version == 1
    for k, v in rc.arrays.items():
        np.testing.assert_array_equal(np.asarray(to_bits(v, None)), held[k])


@pytest.mark.parametrize("verify", ["all", "touched"])
def test_many_sharded_leaves_apply_without_a_collective_deadlock(verify):
    """A model of 96 leaves, each sharded over the 8 fake devices: applying the anchor and a patch
    touching every leaf dispatches a scatter and a digest (an all-reduce) per leaf. XLA:CPU admits
    32 programs per device at a time, and a launch past that blocks a thread of the pool that also
    runs the devices' collectives: 64 such programs in flight never finished (the all-reduce waited
    for participants with no thread left). The receiver waits on every few results instead."""
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    rng = np.random.default_rng(0)
    master = {f"l{i:02d}": rng.standard_normal((8, 16)).astype(np.float32) for i in range(96)}
    tr = InProcessTransport()
    pub = Publisher(tr)
    pub.publish({k: jax.device_put(v, sharding) for k, v in master.items()})
    for v in master.values():
        v[rng.integers(8), rng.integers(16)] *= 1.5  # one element of every leaf changes
    out = pub.publish({k: jax.device_put(v, sharding) for k, v in master.items()})
    assert len(out.changed) == 96
    rc = Receiver(lambda n, s: sharding, verify=verify)
    rc.sync(tr, target=1)
    for name, sent in zip(pub.names, jax.tree.leaves(pub.sent_bits), strict=True):
        np.testing.assert_array_equal(np.asarray(to_bits(rc.arrays[name], None)), sent)
    assert rc.version == 1 and rc.state_digest == pub.state_digest


@pytest.mark.parametrize("spec", [P(None, "tensor"), P("tensor", None), P(("data", "tensor"))])
def test_a_patch_applies_to_sharded_leaves_without_gathering_them(spec):
    """A sampler's weights split over `tensor` (a non-leading axis included): the scatter of a
    patch runs where each shard lives. Its compiled program holds no all-gather (only
    all-reduces of one chunk's old values and digest terms), and the bits equal the trainer's."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, spec)
    rng = np.random.default_rng(1)
    master = {"w": rng.standard_normal((64, 256)).astype(np.float32)}
    tr = InProcessTransport()
    pub = Publisher(tr)
    pub.publish(master)
    master["w"][rng.random((64, 256)) < 0.05] *= 1.5
    pub.publish(master)
    rc = Receiver(lambda n, s: sharding, verify="touched")
    rc.sync(tr, target=1)
    held = rc.arrays[pub.names[0]]
    assert held.sharding == sharding
    np.testing.assert_array_equal(
        np.asarray(to_bits(held, None)), jax.tree.leaves(pub.sent_bits)[0]
    )
    flat = np.arange(0, held.size, 7, dtype=np.uint32)[:512]
    for digest in (False, True):
        text = (
            _scatter_first.lower(
                held,
                flat,
                np.ones(512, np.uint16),
                np.bool_(False),
                np.zeros(2, np.uint32),
                sharding=sharding,
                digest=digest,
            )
            .compile()
            .as_text()
        )
        assert "all-gather" not in text and "all-to-all" not in text
