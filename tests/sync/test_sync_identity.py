"""PULSESync identity and bounds: blobs carry their run id and base-state digest, receivers refuse
another run's blobs and patches for another base before applying anything, and no size read from
a blob or a socket is trusted before it is bounded."""

import base64
import contextlib
import hashlib
import json
import socket
import struct
import threading
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import SingleDeviceSharding

from sparserl_jax.build import build_model
from sparserl_jax.checkpoint import CheckpointManager
from sparserl_jax.config import load_config
from sparserl_jax.rl import Learner
from sparserl_jax.sync import (
    BaseMismatchError,
    CodecConfig,
    CorruptPatchError,
    InProcessTransport,
    KvStoreTransport,
    MissingVersionError,
    Publisher,
    Receiver,
    RunMismatchError,
    StreamClient,
    StreamServer,
    SyncConfig,
    SyncError,
    TensorSpec,
    TruncatedPatchError,
    decode,
    to_bits,
)
from sparserl_jax.sync import receiver as receiver_module
from sparserl_jax.sync.header import PREFIX_BYTES, pack_header, read_header
from sparserl_jax.sync.order import ContextCache
from sparserl_jax.testing.sync import np_digest
from sparserl_jax.train import train

ONE = SingleDeviceSharding(jax.devices()[0])
MiB = 1 << 20


def sharding(name, shape):
    return ONE


def masters(n: int, seed: int = 0):
    """`n` successive master trees: small sparse-ish updates, so patches hold sparse tensors."""
    rng = np.random.default_rng(seed)
    m = {
        "w": jnp.asarray(rng.standard_normal((16, 8)).astype(np.float32) * 0.02),
        "b": jnp.asarray(rng.standard_normal(6).astype(np.float32)),
    }
    out = [m]
    for _ in range(n - 1):
        m = jax.tree.map(lambda x: x - 3e-3 * jnp.sign(x) * (jnp.abs(x) > 0.015), m)
        out.append(m)
    return out


def publish(transport, trees, **kw):
    codec = CodecConfig()
    config = SyncConfig(anchor_every=kw.pop("anchor_every", 2), codec=codec)
    pub = Publisher(transport, config=config, **kw)
    for m in trees:
        pub.publish(m)
    return pub


def bits(rc: Receiver) -> dict[str, np.ndarray]:
    return {k: np.asarray(to_bits(v, None)) for k, v in rc.arrays.items()}


def assert_bits(rc: Receiver, want: dict[str, np.ndarray]):
    got = bits(rc)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def sent(pub: Publisher) -> dict[str, np.ndarray]:
    return {
        n: np.asarray(b) for n, b in zip(pub.names, jax.tree.leaves(pub.sent_bits), strict=True)
    }


def split(blob: bytes) -> tuple[dict, bytes]:
    """(header JSON, bucket bytes) of a blob (format 3: the header is one zstd frame)."""
    hlen = int.from_bytes(blob[4:8], "little")
    hbytes = blob[PREFIX_BYTES : PREFIX_BYTES + hlen]
    if hbytes[:4] == b"\x28\xb5\x2f\xfd":
        hbytes = zstandard.ZstdDecompressor().decompress(hbytes)
    return json.loads(hbytes), blob[PREFIX_BYTES + hlen :]


def rdecode(rc: Receiver, blob: bytes, **kw):
    """`decode` as receiver `rc` does: against its manifest and its current bits."""
    return decode(blob, expect=rc.specs, base=lambda n: np.asarray(rc.arrays[n]), **kw)


# --- identity ---------------------------------------------------------------------------------


def test_blobs_carry_run_id_and_base_digest():
    tr = InProcessTransport()
    pub = Publisher(tr, config=SyncConfig(anchor_every=2))
    digests = []
    for m in masters(3):
        pub.publish(m)
        digests.append(pub.state_digest)
    anchor = read_header(tr.get(0, "anchor"))
    assert anchor["format"] == 3 and anchor["run_id"] == pub.run_id
    assert anchor["base_digest"] is None and anchor["state_digest"] == digests[0]
    for v in (1, 2):
        h = read_header(tr.get(v, "patch"))
        assert h["run_id"] == pub.run_id
        assert (h["base_digest"], h["state_digest"]) == (digests[v - 1], digests[v])
    assert Publisher(run_id="run-7.a_b").run_id == "run-7.a_b"
    assert Publisher().run_id != pub.run_id  # a fresh random id per publisher
    for bad in ("", "has space", "x" * 65, 7):
        with pytest.raises(ValueError, match="run id"):
            Publisher(run_id=bad)


@pytest.fixture
def two_runs(tmp_path):
    """Run A published versions 0..5 in a directory; run B (another id) 0..2 into memory."""
    url = f"file://{tmp_path}/sync/"
    trees_a, trees_b = masters(6, seed=1), masters(3, seed=2)
    pub_a = publish(KvStoreTransport(url), trees_a)
    mem_b = InProcessTransport()
    pub_b = publish(mem_b, trees_b)
    return url, pub_a, mem_b, pub_b


def test_second_run_in_the_same_directory_is_refused_by_its_publisher(two_runs):
    url, pub_a, _, _ = two_runs
    tr = KvStoreTransport(url)
    before = {(k, v): tr.get(v, k) for k in ("patch", "anchor") for v in tr.versions(k)}
    pub_b = Publisher(tr, config=SyncConfig(anchor_every=2))
    with pytest.raises(RunMismatchError) as e:
        pub_b.publish(masters(1, seed=2)[0])
    msg = str(e.value)
    assert f"of run {pub_a.run_id!r}" in msg and f"this run, {pub_b.run_id!r}" in msg, msg
    assert "empty location" in msg
    after = {(k, v): tr.get(v, k) for k in ("patch", "anchor") for v in tr.versions(k)}
    assert after == before and pub_b.version is None  # nothing written, nothing changed
    # A run that starts above run A's newest version does not interleave with it.
    assert Publisher(tr, start_version=6).publish(masters(1)[0]).version == 6


def test_receiver_refuses_another_runs_blobs_naming_both_ids(two_runs):
    """The old failure: run B's blobs written over run A's 0..2 (here past B's publisher, as a
    copy would), A's 3..5 left behind. No receiver ever applies a blob of the other run."""
    url, pub_a, mem_b, pub_b = two_runs
    tr = KvStoreTransport(url)
    a0 = tr.get(0, "anchor")
    for kind in ("anchor", "patch"):
        for v in mem_b.versions(kind):
            tr.put(v, kind, mem_b.get(v, kind))

    # Bound to B by the first anchor it accepts: A's patch 3 and anchor 4 are refused.
    rc = Receiver(sharding)
    rc.apply(tr.get(0, "anchor"))
    assert rc.run_id == pub_b.run_id
    rc.sync(tr, target=2)
    assert_bits(rc, sent(pub_b))
    with pytest.raises(MissingVersionError) as e:
        rc.sync(tr)
    msg = str(e.value)
    assert f"published by run {pub_a.run_id!r}" in msg and f"follows run {pub_b.run_id!r}" in msg
    assert rc.version == 2
    assert_bits(rc, sent(pub_b))
    with pytest.raises(RunMismatchError, match=r"patch 2->3 refused: it was published by run"):
        rc.apply(tr.get(3, "patch"))

    # Bound to A explicitly (a fresh sampler told which run to follow): B's anchor 2 and
    # patches are refused, A's anchor 4 and patch 5 take it to A's newest state.
    rc_a = Receiver(sharding, run_id=pub_a.run_id)
    with pytest.raises(RunMismatchError, match="anchor 0 refused"):
        rc_a.apply(tr.get(0, "anchor"))
    events = rc_a.sync(tr)
    assert [(e.version, e.kind) for e in events if e.error is None] == [(4, "anchor"), (5, "patch")]
    assert_bits(rc_a, sent(pub_a))
    # Bound to A by A's own anchor 0: B's patch 1 is refused, never applied.
    rc_a0 = Receiver(sharding)
    rc_a0.apply(a0)
    events = rc_a0.sync(tr)
    assert pub_b.run_id in events[0].error and events[0].version == 1
    assert rc_a0.version == 5
    assert_bits(rc_a0, sent(pub_a))


def test_resumed_publisher_keeps_its_run_id_and_receivers_continue(tmp_path):
    """A trainer killed after publishing 0..5 resumes from its checkpoint at version 3 with the
    checkpointed run id: it may publish over its own leftovers, and receivers at 3 (behind) and
    at 5 (ahead of the checkpoint) both continue; with a deterministic replay nothing is lost."""
    url = f"file://{tmp_path}/sync/"
    trees = masters(8)
    first = publish(KvStoreTransport(url), trees[:6], anchor_every=3)
    behind, ahead = Receiver(sharding), Receiver(sharding)
    behind.sync(KvStoreTransport(url), target=3)
    ahead.sync(KvStoreTransport(url))
    assert (behind.version, ahead.version) == (3, 5)

    resumed = Publisher(
        KvStoreTransport(url),
        config=SyncConfig(anchor_every=3),
        start_version=3,
        run_id=first.run_id,
    )
    for m in trees[3:]:
        resumed.publish(m)
    assert resumed.version == 7
    for rc in (behind, ahead):
        events = rc.sync(KvStoreTransport(url))
        assert all(e.error is None for e in events), events
        assert rc.version == 7 and rc.run_id == first.run_id
        assert_bits(rc, sent(resumed))


def test_resumed_run_that_diverged_is_caught_by_the_base_digest(tmp_path):
    """Same run id, but the replay after the restart differs (non-deterministic step): the
    receiver that had applied the lost version 4 refuses patch 4'->5' before applying it and
    recovers from anchor 6 of the new chain."""
    url = f"file://{tmp_path}/sync/"
    trees = masters(6)
    first = publish(KvStoreTransport(url), trees[:5], anchor_every=3)
    rc = Receiver(sharding)
    rc.sync(KvStoreTransport(url))
    assert rc.version == 4
    state4 = bits(rc)
    other = masters(4, seed=9)  # versions 4', 5', 6' differ from the lost 4
    resumed = Publisher(
        KvStoreTransport(url),
        config=SyncConfig(anchor_every=3),
        start_version=3,
        run_id=first.run_id,
    )
    resumed.publish(trees[3])
    resumed.publish(other[1])  # 4'
    tr = KvStoreTransport(url)
    resumed.publish(other[2])  # 5'
    with pytest.raises(BaseMismatchError, match=r"patch 4->5 refused: made for a base state"):
        rc.apply(tr.get(5, "patch"))
    assert rc.version == 4
    assert_bits(rc, state4)
    resumed.publish(other[3])  # 6' and anchor 6'
    events = rc.sync(tr)
    assert "base state" in events[0].error
    assert [(e.version, e.kind) for e in events if e.error is None] == [(6, "anchor")]
    assert_bits(rc, sent(resumed))


def test_patch_for_the_wrong_base_is_refused_before_decoding(monkeypatch):
    """Two publishers of one run from the same anchor diverge at version 1: patch 1->2 of the
    one is refused by a receiver holding version 1 of the other, weights unchanged bit for bit,
    and nothing is decoded or scattered."""
    trees = masters(3)
    tr_x, tr_y = InProcessTransport(), InProcessTransport()
    pub_x = publish(tr_x, trees[:2])
    pub_y = Publisher(tr_y, config=SyncConfig(anchor_every=2), run_id=pub_x.run_id)
    pub_y.publish(trees[0])
    pub_y.publish(jax.tree.map(lambda x: x * 1.5, trees[1]))
    pub_y.publish(trees[2])
    rc = Receiver(sharding)
    rc.sync(tr_x)
    before = bits(rc)
    calls = []
    real = receiver_module.codec.decode
    monkeypatch.setattr(
        receiver_module.codec, "decode", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    with pytest.raises(BaseMismatchError) as e:
        rc.apply(tr_y.get(2, "patch"))
    assert read_header(tr_y.get(2, "patch"))["base_digest"] in str(e.value)
    assert rc.state_digest in str(e.value)
    assert calls == [] and rc.version == 1
    assert_bits(rc, before)


# --- format 1 stays readable -------------------------------------------------------------------

# Written by the format-1 encoder (commit 8be5032): leaves "w" (30,) bfloat16 and "b" (4,) float32;
# a patch 3 -> 4 (w sparse/XOR, b dense) and an anchor of version 4, zstd.
V1_PATCH = base64.b64decode(
    "UFNZTkkCAABVZ7FH/PWXAHvaff+0XQyNeyJmb3JtYXQiOjEsImtpbmQiOiJwYXRjaCIsImJhc2VfdmVyc2lvbiI6MywibmV3X3ZlcnNpb24iOjQsImNvbXByZXNzaW9uIjoienN0ZCIsInN0YXRlX2RpZ2VzdCI6ImJjNjkzMWQ0MzkyODJkZDJhMmVkMTg3MTA2MTkyZmE4IiwidGVuc29ycyI6W3sibmFtZSI6InciLCJzaGFwZSI6WzMwXSwiZHR5cGUiOiJiZmxvYXQxNiIsImVuY29kaW5nIjoic3BhcnNlIiwibm56IjozLCJnYXBfd2lkdGgiOjEsInZhbHVlcyI6InhvciIsImRpZ2VzdCI6WzY5MzY3NTY0Niw3Njg0NTg5NjBdLCJvZmZzZXRzIjp7ImcwIjowLCJ2MCI6MCwidjEiOjB9LCJidWNrZXQiOjB9LHsibmFtZSI6ImIiLCJzaGFwZSI6WzRdLCJkdHlwZSI6ImZsb2F0MzIiLCJlbmNvZGluZyI6ImRlbnNlIiwiZGlnZXN0IjpbMjQ3MjA5MjIyNiwzNjgzNTc1NDM0XSwib2Zmc2V0cyI6eyJkIjowfSwiYnVja2V0IjowfV0sImJ1Y2tldHMiOlt7InNpemUiOjYxLCJzdHJlYW1zIjpbWzEyLDNdLFswLDBdLFswLDBdLFswLDBdLFsxMiwzXSxbMTIsM10sWzAsMF0sWzAsMF0sWzI1LDE2XV0sImNoZWNrc3VtIjoiMTAxYTZiNGQwZTEyMWFjMGUzMDM2ODU3OTM5YjRjZWQifV19KLUv/SADGQAAAwYSKLUv/SADGQAAAQEBKLUv/SADGQAAgICAKLUv/SAQgQAAAACAPwAAAIABAMB/BwAAAA=="
)
V1_ANCHOR = base64.b64decode(
    "UFNZThYCAADzz7rJhDqGhM/mcIMecWWReyJmb3JtYXQiOjEsImtpbmQiOiJhbmNob3IiLCJiYXNlX3ZlcnNpb24iOm51bGwsIm5ld192ZXJzaW9uIjo0LCJjb21wcmVzc2lvbiI6InpzdGQiLCJzdGF0ZV9kaWdlc3QiOiJiYzY5MzFkNDM5MjgyZGQyYTJlZDE4NzEwNjE5MmZhOCIsInRlbnNvcnMiOlt7Im5hbWUiOiJ3Iiwic2hhcGUiOlszMF0sImR0eXBlIjoiYmZsb2F0MTYiLCJlbmNvZGluZyI6ImRlbnNlIiwiZGlnZXN0IjpbNjkzNjc1NjQ2LDc2ODQ1ODk2MF0sIm9mZnNldHMiOnsiZCI6MH0sImJ1Y2tldCI6MH0seyJuYW1lIjoiYiIsInNoYXBlIjpbNF0sImR0eXBlIjoiZmxvYXQzMiIsImVuY29kaW5nIjoiZGVuc2UiLCJkaWdlc3QiOlsyNDcyMDkyMjI2LDM2ODM1NzU0MzRdLCJvZmZzZXRzIjp7ImQiOjYwfSwiYnVja2V0IjowfV0sImJ1Y2tldHMiOlt7InNpemUiOjg1LCJzdHJlYW1zIjpbWzAsMF0sWzAsMF0sWzAsMF0sWzAsMF0sWzAsMF0sWzAsMF0sWzAsMF0sWzAsMF0sWzg1LDc2XV0sImNoZWNrc3VtIjoiZWJkMzA1NGQyZGUzNDkwNzcwMmM3ZTI3MGYzMGFjNTUifV19KLUv/SBMYQIAAAABAQICAoMEBAUFBgYHBwgICQkLigsLDAwNDQ4ODw8QEBEREhITExQUFRUWFhcXGBgZGRoaGxscHBydAACAPwAAAIABAMB/BwAAAA=="
)
V1_SPECS = [TensorSpec("w", (30,), "bfloat16"), TensorSpec("b", (4,), "float32")]


def _v1_state():
    old_w = (np.arange(30, dtype=np.uint16) * 0x0101).astype(np.uint16)
    new_w = old_w.copy()
    new_w[[3, 10, 29]] ^= np.uint16(0x8001)
    new_b = np.array([0x3F800000, 0x80000000, 0x7FC00001, 7], np.uint32)
    return old_w, new_w, new_b


def test_format_1_blobs_stay_decodable():
    old_w, new_w, new_b = _v1_state()
    patch = decode(V1_PATCH, expect=V1_SPECS)
    assert (patch.kind, patch.base_version, patch.new_version) == ("patch", 3, 4)
    assert patch.run_id is None and patch.base_digest is None
    w = patch.tensors["w"]
    assert w.encoding == "sparse" and w.xor
    rebuilt = old_w.copy()
    rebuilt[w.index] ^= w.bits
    np.testing.assert_array_equal(rebuilt, new_w)
    np.testing.assert_array_equal(patch.tensors["b"].bits, new_b)
    np.testing.assert_array_equal(patch.leaf_digests["w"], np_digest(new_w))
    # A receiver bound to no run accepts the format-1 anchor; one bound to a run refuses it.
    rc = Receiver(sharding)
    assert rc.apply(V1_ANCHOR) == 4 and rc.run_id is None
    assert_bits(rc, {"w": new_w, "b": new_b})
    with pytest.raises(RunMismatchError, match=r"published by run None, this receiver follows"):
        Receiver(sharding, run_id="abc").apply(V1_ANCHOR)


# --- format 2 stays readable -------------------------------------------------------------------

# Written by the format-2 encoder (commit 571fd14), run "pinned-v2": the leaves of the format-1
# blobs above, an anchor of version 3 (the old state) and a patch 3 -> 4 (both leaves sparse, XOR).
V2_ANCHOR_3 = base64.b64decode(
    "UFNZTj8CAABOGGhjZbBM5oS02udoEN5xeyJmb3JtYXQiOjIsImtpbmQiOiJhbmNob3IiLCJydW5faWQiOiJwaW5uZWQt"
    "djIiLCJiYXNlX3ZlcnNpb24iOm51bGwsImJhc2VfZGlnZXN0IjpudWxsLCJuZXdfdmVyc2lvbiI6MywiY29tcHJlc3Np"
    "b24iOiJ6c3RkIiwic3RhdGVfZGlnZXN0IjoiOTNmMWU1MmMxOTg1Y2RjOWQ3MWI2YTJiYmRjYTliY2EiLCJ0ZW5zb3Jz"
    "IjpbeyJuYW1lIjoidyIsInNoYXBlIjpbMzBdLCJkdHlwZSI6ImJmbG9hdDE2IiwiZW5jb2RpbmciOiJkZW5zZSIsImRp"
    "Z2VzdCI6WzgyNTA1NjQ4NCw0MTA3NTQ2MjYyXSwib2Zmc2V0cyI6eyJkIjowfSwiYnVja2V0IjowfSx7Im5hbWUiOiJi"
    "Iiwic2hhcGUiOls0XSwiZHR5cGUiOiJmbG9hdDMyIiwiZW5jb2RpbmciOiJkZW5zZSIsImRpZ2VzdCI6WzIyMzY3ODM2"
    "MjYsMzExMjkzOTA1Ml0sIm9mZnNldHMiOnsiZCI6NjB9LCJidWNrZXQiOjB9XSwiYnVja2V0cyI6W3sic2l6ZSI6ODUs"
    "InN0cmVhbXMiOltbMCwwXSxbMCwwXSxbMCwwXSxbMCwwXSxbMCwwXSxbMCwwXSxbMCwwXSxbMCwwXSxbODUsNzZdXSwi"
    "Y2hlY2tzdW0iOiI0ODlhODRiNjU3ZmViNzdlZTJiNTBjNTFiMDQxMjk2MSJ9XX0otS/9IExhAgAAAAEBAgIDAwQEBQUG"
    "BgcHCAgJCQoKCwsMDA0NDg4PDxAQERESEhMTFBQVFRYWFxcYGBkZGhobGxwcHR0AAIA/AAAAAAAAwH8HAAAA"
)
V2_PATCH = base64.b64decode(
    "UFNZTtICAABxrOR+XUhrgYfyndEAtSd1eyJmb3JtYXQiOjIsImtpbmQiOiJwYXRjaCIsInJ1bl9pZCI6InBpbm5lZC12"
    "MiIsImJhc2VfdmVyc2lvbiI6MywiYmFzZV9kaWdlc3QiOiI5M2YxZTUyYzE5ODVjZGM5ZDcxYjZhMmJiZGNhOWJjYSIs"
    "Im5ld192ZXJzaW9uIjo0LCJjb21wcmVzc2lvbiI6InpzdGQiLCJzdGF0ZV9kaWdlc3QiOiJiYzY5MzFkNDM5MjgyZGQy"
    "YTJlZDE4NzEwNjE5MmZhOCIsInRlbnNvcnMiOlt7Im5hbWUiOiJ3Iiwic2hhcGUiOlszMF0sImR0eXBlIjoiYmZsb2F0"
    "MTYiLCJlbmNvZGluZyI6InNwYXJzZSIsIm5ueiI6MywiZ2FwX3dpZHRoIjoxLCJ2YWx1ZXMiOiJ4b3IiLCJkaWdlc3Qi"
    "Ols2OTM2NzU2NDYsNzY4NDU4OTYwXSwib2Zmc2V0cyI6eyJnMCI6MCwidjAiOjAsInYxIjowfSwiYnVja2V0IjowfSx7"
    "Im5hbWUiOiJiIiwic2hhcGUiOls0XSwiZHR5cGUiOiJmbG9hdDMyIiwiZW5jb2RpbmciOiJzcGFyc2UiLCJubnoiOjIs"
    "ImdhcF93aWR0aCI6MSwidmFsdWVzIjoieG9yIiwiZGlnZXN0IjpbMjQ3MjA5MjIyNiwzNjgzNTc1NDM0XSwib2Zmc2V0"
    "cyI6eyJnMCI6MywidjAiOjMsInYxIjozLCJ2MiI6MCwidjMiOjB9LCJidWNrZXQiOjB9XSwiYnVja2V0cyI6W3sic2l6"
    "ZSI6NjQsInN0cmVhbXMiOltbMTQsNV0sWzAsMF0sWzAsMF0sWzAsMF0sWzE0LDVdLFsxNCw1XSxbMTEsMl0sWzExLDJd"
    "LFswLDBdXSwiY2hlY2tzdW0iOiJmMjg4OWJjNjA4NWNiYTQwMTZmMzg4MmY1MTYxZDAxOCJ9XX0otS/9IAUpAAADBhIB"
    "ACi1L/0gBSkAAAEBAQABKLUv/SAFKQAAgICAAAAotS/9IAIRAAAAACi1L/0gAhEAAIAA"
)


V2_OLD_B = np.array([0x3F800000, 0, 0x7FC00000, 7], np.uint32)  # "b" at version 3


def test_format_2_blobs_stay_decodable():
    old_w, new_w, new_b = _v1_state()
    old_b = V2_OLD_B
    patch = decode(V2_PATCH, expect=V1_SPECS)
    assert (patch.format, patch.kind, patch.base_version, patch.new_version) == (2, "patch", 3, 4)
    assert patch.run_id == "pinned-v2" and patch.base_digest == "93f1e52c1985cdc9d71b6a2bbdca9bca"
    w, b = patch.tensors["w"], patch.tensors["b"]
    assert w.encoding == b.encoding == "sparse" and w.xor and b.xor
    np.testing.assert_array_equal(w.index, [3, 10, 29])
    np.testing.assert_array_equal(b.index, [1, 2])
    # A receiver following the run takes the anchor, then the patch, to the new bits.
    rc = Receiver(sharding, run_id="pinned-v2")
    assert rc.apply(V2_ANCHOR_3) == 3
    assert_bits(rc, {"w": old_w, "b": old_b})
    assert rc.state_digest == patch.base_digest
    assert rc.apply(V2_PATCH) == 4
    assert_bits(rc, {"w": new_w, "b": new_b})


# --- bounds ----------------------------------------------------------------------------------


def repack(header: dict, payload: bytes) -> bytes:
    return pack_header(header) + payload


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """One zstd frame of 1 GiB of zeros (~32 KB), compressed from 1 MiB pieces."""
    cobj = zstandard.ZstdCompressor(level=1).compressobj(size=1 << 30)
    zeros = bytes(MiB)
    frame = b"".join([cobj.compress(zeros) for _ in range(1024)] + [cobj.flush()])
    assert zstandard.frame_content_size(frame) == 1 << 30 and len(frame) < 40_000
    return frame


def _dense_patch():
    """A patch 0 -> 1 whose only bucket holds one dense stream (leaf "b"), and its receiver."""
    trees = masters(2)
    trees[1] = {"w": trees[0]["w"], "b": trees[0]["b"] + 1.0}
    tr = InProcessTransport()
    pub = publish(tr, trees)
    rc = Receiver(sharding)
    rc.apply(tr.get(0, "anchor"))
    blob = tr.get(1, "patch")
    header, payload = split(blob)
    assert [t["encoding"] for t in header["tensors"]] == ["dense", "unchanged"]  # b, w
    return rc, blob, header, pub


def _with_stream(header: dict, frame: bytes, raw: int) -> bytes:
    header = json.loads(json.dumps(header))
    (bucket,) = header["buckets"]
    bucket["streams"][-1] = [len(frame), raw]  # the dense stream "d"
    bucket["size"] = len(frame)
    bucket["checksum"] = hashlib.blake2b(frame, digest_size=16).hexdigest()
    return repack(header, frame)


def _peak_mib(fn, error, match: str) -> float:
    """MiB allocated (traced Python/C-extension heap) at the peak of `fn()`, which must raise."""
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match):
            fn()
        return tracemalloc.get_traced_memory()[1] / MiB
    finally:
        tracemalloc.stop()


def test_a_zstd_frame_must_state_its_size():
    rc, blob, header, _ = _dense_patch()
    raw = header["buckets"][0]["streams"][-1][1]
    data = rdecode(rc, blob).tensors["['b']"].bits.tobytes()
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    with pytest.raises(
        CorruptPatchError, match=f"zstd frame states no size, the manifest allows {raw}"
    ):
        rc.apply(_with_stream(header, frame, raw))
    rc.apply(_with_stream(header, zstandard.ZstdCompressor().compress(data), raw))
    assert rc.version == 1


@pytest.mark.parametrize("claim", ["stream", "frame"])
def test_a_34kb_patch_claiming_1gib_is_refused_before_inflating(bomb, claim):
    """`stream`: the stream table says 1 GiB raw where the manifest allows a few bytes; `frame`:
    the table is honest but the zstd frame's own header claims 1 GiB (zstandard allocates a
    frame's claimed size whatever `max_output_size` says)."""
    rc, _, header, _ = _dense_patch()
    before = bits(rc)
    allowed = header["buckets"][0]["streams"][-1][1]
    blob = _with_stream(header, bomb, 1 << 30 if claim == "stream" else allowed)
    assert len(blob) < 36_000
    want = "header says 1073741824 raw bytes" if claim == "stream" else "frame claims 1073741824"
    for fn in (lambda: rdecode(rc, blob), lambda: rc.apply(blob)):
        peak = _peak_mib(fn, CorruptPatchError, want)
        assert peak < 8, f"{peak:.1f} MiB allocated while refusing"
    assert rc.version == 0
    assert_bits(rc, before)


def test_every_length_field_is_bounded_before_use():
    rc, blob, header, pub = _dense_patch()
    before = bits(rc)
    _, payload = split(blob)

    def refused(bad: bytes, match: str, error=CorruptPatchError):
        with pytest.raises(error, match=match):
            rdecode(rc, bad)
        with pytest.raises(error, match=match):
            rc.apply(bad)

    # header_len: above the configured maximum, refused before it is read.
    huge = blob[:4] + struct.pack("<I", 2**32 - 1) + blob[8:]
    refused(huge, "header_len 4294967295 exceeds the maximum")
    with pytest.raises(CorruptPatchError, match="exceeds the maximum of 100 bytes"):
        rdecode(rc, blob, max_header_bytes=100)
    # A bucket size beyond the blob: truncated, nothing sliced.
    h = json.loads(json.dumps(header))
    h["buckets"][0]["size"] = 2**40
    h["buckets"][0]["streams"][-1][0] = 2**40
    refused(repack(h, payload), "patch has .* bytes, its header describes", TruncatedPatchError)
    # Counts: nnz beyond the element count; a shape of 2**32 elements or more.
    h = json.loads(json.dumps(header))
    h["tensors"][1].update(encoding="sparse", nnz=2**40, gap_width=1, values="new", bucket=0)
    refused(repack(h, payload), r"bad nnz 1099511627776")
    # Shapes travel in anchors (a format-3 patch names the receiver's manifest by digest).
    h, anchor_payload = split(pub.transport.get(0, "anchor"))
    h["tensors"][0]["shape"] = [2**16, 2**16]
    with pytest.raises(CorruptPatchError, match="2\\*\\*32 or more elements"):
        decode(repack(h, anchor_payload))
    # Sizes of the wrong JSON type (a float) or negative are refused as such.
    n_streams = len(header["buckets"][0]["streams"])
    bad_table = [[0, 0]] * (n_streams - 1) + [[24.0, 24]]
    for field, value in (("size", 24.0), ("size", -1), ("streams", bad_table)):
        h = json.loads(json.dumps(header))
        h["buckets"][0][field] = value
        refused(repack(h, payload), "bucket 0: bad (size|stream table)")
    # The total decoded size against a configured cap (a fresh receiver's only bound).
    n = header["buckets"][0]["streams"][-1][1]
    with pytest.raises(CorruptPatchError, match=f"decodes to {n} bytes, more than the maximum"):
        rdecode(rc, blob, max_decoded_bytes=n - 1)
    assert rc.version == 0
    assert_bits(rc, before)
    rc.apply(blob)  # the untouched patch still applies


def _serve_once(reply: bytes):
    """A one-shot TCP peer that reads a request line and answers `reply`."""
    srv = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = srv.accept()
        with conn:
            conn.recv(256)
            conn.sendall(reply)
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[:2]


def test_socket_lengths_are_bounded_before_allocation():
    # A reply announcing 2**62 bytes is refused (the old client allocated the announced size);
    # one under the cap whose peer sends 3 bytes and hangs up costs what arrived, not 512 GiB.
    for n, match in ((2**62, "announced 4611686018427387904 bytes"), (2**39, "closed after 3 of")):
        client = StreamClient(*_serve_once(struct.pack("<Q", n) + b"abc"), timeout=5)
        assert _peak_mib(lambda c=client: c.get(1, "patch"), ConnectionError, match) < 8
        client.close()

    # The server: a PUT over max_blob_bytes, or announcing more than it sends, stores nothing.
    server = StreamServer(host="127.0.0.1", timeout=5, max_blob_bytes=1000)
    try:
        small = StreamClient(*server.address, timeout=5)
        with pytest.raises(ConnectionError):
            small.put(1, "patch", b"x" * 1001)
        # Over the cap, negative, or under it but the peer hangs up after 3 bytes: the server
        # drops the connection (EOF or reset) and stores nothing.
        for line in (b"PUT patch 2 549755813888\n", b"PUT patch 3 -5\n", b"PUT patch 5 900\nabc"):
            with socket.create_connection(server.address, timeout=5) as s:
                s.sendall(line)
                s.shutdown(socket.SHUT_WR)
                with contextlib.suppress(ConnectionResetError):
                    assert s.recv(16) == b""
        small.put(4, "patch", b"y" * 1000)
        assert small.versions("patch") == [4] and small.get(4, "patch") == b"y" * 1000
        small.close()
    finally:
        server.close()


# --- damaged blobs: only the codec's errors, weights untouched --------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=["format2", "format3"])
def chain(request):
    """(anchor, patch, bits at the anchor, bits after the patch): format 3 as written today,
    format 2 the pinned blobs above (no longer written, still read)."""
    if request.param == 2:
        old_w, new_w, new_b = _v1_state()
        return V2_ANCHOR_3, V2_PATCH, {"w": old_w, "b": V2_OLD_B}, {"w": new_w, "b": new_b}
    tr = InProcessTransport()
    codec = CodecConfig(bucket_bytes=256)
    pub = Publisher(tr, config=SyncConfig(anchor_every=10, codec=codec))
    trees = masters(2)
    pub.publish(trees[0])
    v0 = sent(pub)
    pub.publish(trees[1])
    return tr.get(0, "anchor"), tr.get(1, "patch"), v0, sent(pub)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def _paths(x, prefix=()):
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*prefix, i))


def _set(x, path, value):
    if not path:
        return value
    x[path[0]] = _set(x[path[0]], path[1:], value)
    return x


@st.composite
def damage(draw, blob: bytes):
    kind = draw(st.sampled_from(["truncate", "flip", "header", "payload"]))
    if kind == "truncate":
        return blob[: draw(st.integers(0, len(blob) - 1))]
    if kind == "flip":
        bad = bytearray(blob)
        for _ in range(draw(st.integers(1, 4))):
            bad[draw(st.integers(0, len(bad) - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(bad)
    header, payload = split(blob)
    if kind == "header":  # any field replaced by any JSON value, checksum made valid again
        paths = list(_paths(header))
        path = draw(st.sampled_from(paths))
        return repack(_set(header, path, draw(JSON)), payload)
    # A payload byte changed and its bucket checksum recomputed: the deeper checks must hold.
    bad = bytearray(payload)
    pos = draw(st.integers(0, len(bad) - 1))
    bad[pos] ^= draw(st.integers(1, 255))
    start = 0
    for b in header["buckets"]:
        if start <= pos < start + b["size"]:
            b["checksum"] = hashlib.blake2b(
                bad[start : start + b["size"]], digest_size=16
            ).hexdigest()
        start += b["size"]
    return repack(header, bytes(bad))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_damaged_patches_raise_only_sync_errors_and_never_change_weights(chain, data):
    anchor, patch, v0, v1 = chain
    rc = Receiver(sharding)
    at = rc.apply(anchor)
    bad = data.draw(damage(patch))
    with contextlib.suppress(SyncError):
        rdecode(rc, bad)
    try:
        rc.apply(bad)
    except SyncError:
        assert rc.version == at
        assert_bits(rc, v0)
    else:  # accepted only if it rebuilds exactly version 1 (all digests matched)
        assert_bits(rc, v1)


# --- the trainer checkpoints its run id -------------------------------------------------------


@pytest.mark.slow
def test_trainer_checkpoints_its_run_id_and_keeps_it_on_resume(tmp_path):
    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
    common = [f"run_dir={tmp_path}", "train.eval_examples=0", "sft.steps=0", "data.batch_size=4"]
    train(load_config(tiny, [*common, "train.steps=1"]), log_fn=lambda m: None)
    train(load_config(tiny, [*common, "train.steps=2"]), log_fn=lambda m: None)  # resumes at 1
    cfg = load_config(tiny, common)
    model = build_model(cfg.model)
    template = {"learner": Learner(model, cfg.learner).init(model)}
    with CheckpointManager(tmp_path, async_save=False) as mngr:
        metas = {s: mngr.restore(s, template)[1] for s in mngr.steps()}
    assert sorted(metas) == [0, 1, 2]
    ids = {s: m["sync_run_id"] for s, m in metas.items()}
    assert len(set(ids.values())) == 1, ids  # step 0, the first run's step 1, the resumed step 2
    Publisher(run_id=ids[0])  # a valid run id
    assert [metas[s]["sync_version"] for s in (0, 1, 2)] == [0, 1, 2]


# --- format 3's held context: the same bytes as rebuilding it, on both sides ------------------


@pytest.mark.parametrize("cut_slack", [0.0, 0.05])
def test_held_context_changes_no_byte_and_survives_a_refused_patch(cut_slack):
    """Publisher and receiver keep each leaf's class bitmaps across versions (`ContextCache`).
    A publisher that rebuilds them every version writes the same bytes; a receiver that holds
    them applies every patch bit-identically, also after refusing a damaged one. With a cut
    slack the publisher keeps cuts across versions (its own state, not the held context's)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 96)).astype(np.float32) * 0.02
    trees = []
    for _ in range(10):  # nudges, plus some elements scaled across exponents (classes move)
        w = w - 1e-4 * np.sign(w) * (rng.random(w.shape) < 0.3)
        w = np.where(rng.random(w.shape) < 0.02, w * rng.choice([0.3, 3.0], w.shape), w)
        trees.append({"w": jnp.asarray(w), "b": jnp.asarray(w[0, :6] * 10)})
    config = SyncConfig(anchor_every=100, codec=CodecConfig(cut_slack=cut_slack))
    held, fresh = InProcessTransport(), InProcessTransport()
    pub = Publisher(held, config=config, run_id="held")
    ref = Publisher(fresh, config=config, run_id="held")
    for m in trees:
        pub.publish(m)
        fresh_context = ContextCache()  # nothing held: rebuilt from the bits every version
        fresh_context.last_cuts.update(ref._context.last_cuts)  # the cut choice, not the context
        ref._context = fresh_context
        ref.publish(m)
    for v in range(1, len(trees)):
        assert held.get(v, "patch") == fresh.get(v, "patch"), v
    assert any(pub._context._leaves.values())  # the held path was taken
    cuts = {tuple(read_header(held.get(v, "patch"))["tensors"][1]["context"]) for v in range(1, 10)}
    assert len(cuts) == (1 if cut_slack else 2), cuts  # the best cuts move as the classes do

    rc = Receiver(sharding)
    rc.apply(held.get(0, "anchor"))
    pub2 = Publisher(config=config)
    for v, m in enumerate(trees):
        pub2.publish(m)
        if v == 0:
            continue
        blob = held.get(v, "patch")
        if v == 4:
            bad = bytearray(blob)
            bad[-5] ^= 0x40
            with pytest.raises(SyncError):
                rc.apply(bytes(bad))
        rc.apply(blob)
        assert_bits(rc, sent(pub2))
    assert any(rc._context._leaves.values())
