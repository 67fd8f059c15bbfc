"""A round trip through each transport: in-process, TensorStore kvstore, TCP stream."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.sync import (
    InProcessTransport,
    KvStoreTransport,
    Publisher,
    Receiver,
    StreamClient,
    StreamServer,
    SyncConfig,
    to_bits,
)
from sparserl_jax.testing.fixtures import xla_flags_with_devices


def sampler_sharding(name, shape):
    mesh = Mesh(np.array(jax.devices()[4:8]), ("x",))
    return NamedSharding(mesh, P("x") if shape and shape[0] % 4 == 0 else P())


def publish_run(transport, n=4):
    rng = np.random.default_rng(0)
    tm = Mesh(np.array(jax.devices()[:4]), ("x",))
    master = {
        "w": jax.device_put(
            rng.standard_normal((16, 8)).astype(np.float32) * 0.02, NamedSharding(tm, P("x"))
        ),
        "n": jnp.ones((7,), jnp.float32),
        "step": jnp.int32(0),
    }
    pub = Publisher(transport, config=SyncConfig(anchor_every=2))
    pub.publish(master)
    for _ in range(n):
        master = {
            "w": master["w"] - 3e-4 * jnp.sign(master["w"]),
            "n": master["n"] * 1.01,
            "step": master["step"] + 1,
        }
        pub.publish(master)
    return pub


def check(rc, pub):
    assert rc.version == pub.version
    for name, sent in zip(pub.names, jax.tree.leaves(pub.sent_bits), strict=True):
        np.testing.assert_array_equal(np.asarray(to_bits(rc.arrays[name], None)), np.asarray(sent))


def test_in_process_onto_sampler_submesh():
    tr = InProcessTransport()
    pub = publish_run(tr)
    rc = Receiver(sampler_sharding)
    rc.sync(tr)
    check(rc, pub)
    assert rc.arrays["['w']"].sharding.device_set == set(jax.devices()[4:8])


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_kvstore_round_trip_with_ready_markers(kind, tmp_path):
    ctx = ts.Context()
    url = f"file://{tmp_path}/sync/" if kind == "file" else "memory://"
    writer = KvStoreTransport(url, context=ctx)
    pub = publish_run(writer)
    reader = KvStoreTransport(url, context=ctx)
    assert reader.versions("anchor") == [0, 2, 4]
    assert reader.versions("patch") == [1, 2, 3, 4]
    rc = Receiver(sampler_sharding)
    rc.sync(reader)
    check(rc, pub)
    # A blob whose READY marker is not written yet is invisible.
    raw = ts.KvStore.open(url, context=ctx).result()
    raw.write("patch-000000000005.psyn", b"partial").result()
    assert reader.versions("patch") == [1, 2, 3, 4] and reader.get(5, "patch") is None
    reader.delete(4, "patch")
    assert reader.versions("patch") == [1, 2, 3]


def test_a_publisher_killed_before_its_rename_leaves_no_unreadable_blob(tmp_path):
    """TensorStore's file driver rewrites a dead writer's `<key>.__lock` from offset 0 without
    cutting it (`decoupled.records.loads`): a publisher killed before its renames, restarted
    with a shorter blob for the same version, left the dead blob's tail behind it, and the
    decoder refused the patch ("trailing bytes"). The reader keeps the size its marker names."""
    writer = KvStoreTransport(f"file://{tmp_path}/sync/")
    (tmp_path / "sync" / "READY").mkdir(parents=True)
    (tmp_path / "sync" / "patch-000000000003.psyn.__lock").write_bytes(b"\xff" * 4096)
    (tmp_path / "sync" / "READY" / "patch-000000000003.__lock").write_bytes(b"123456789\n")
    writer.put(3, "patch", b"the blob written")
    assert (tmp_path / "sync" / "patch-000000000003.psyn").stat().st_size == 4096  # the tail
    assert writer.get(3, "patch") == b"the blob written"
    # A marker from before sizes were written (empty) keeps the whole value.
    (tmp_path / "sync" / "READY" / "anchor-000000000000").write_bytes(b"")
    (tmp_path / "sync" / "anchor-000000000000.psyn").write_bytes(b"old")
    assert writer.get(0, "anchor") == b"old"


RECEIVER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import hashlib, jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from sparserl_jax.sync import Receiver, StreamClient, to_bits
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rc = Receiver(lambda n, s: NamedSharding(mesh, P("x") if s and s[0] % 4 == 0 else P()))
    client = StreamClient("127.0.0.1", int(sys.argv[1]), timeout=20)
    events = rc.sync(client)
    client.close()
    bits = {k: hashlib.sha256(np.asarray(to_bits(v, None)).tobytes()).hexdigest()
            for k, v in rc.arrays.items()}
    print(json.dumps({"version": rc.version, "bits": bits, "digest": rc.state_digest,
                      "events": [[e.version, e.kind] for e in events]}))
    """
)


@pytest.mark.slow
def test_stream_between_two_processes():
    import hashlib

    server = StreamServer(InProcessTransport(), host="127.0.0.1", port=0, timeout=20)
    try:
        pub = publish_run(server, n=3)
        proc = subprocess.run(
            [sys.executable, "-c", RECEIVER_SCRIPT, str(server.address[1])],
            env={
                **os.environ,
                "XLA_FLAGS": xla_flags_with_devices(4),
                "JAX_PLATFORMS": "cpu",
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        server.close()
    assert out["version"] == 3 and out["events"] == [[2, "anchor"], [3, "patch"]]
    for name, sent in zip(pub.names, jax.tree.leaves(pub.sent_bits), strict=True):
        assert out["bits"][name] == hashlib.sha256(np.asarray(sent).tobytes()).hexdigest()


def test_stream_client_put_get_list_and_missing():
    server = StreamServer(host="127.0.0.1", timeout=5)
    client = StreamClient(*server.address, timeout=5)
    try:
        client.put(7, "patch", b"abc" * 1000)
        assert client.get(7, "patch") == b"abc" * 1000
        assert client.get(8, "patch") is None
        assert client.versions("patch") == [7] and client.versions("anchor") == []
        with pytest.raises(ValueError, match="kind"):
            client.get(7, "delta")
    finally:
        client.close()
        server.close()
