"""Checkpoints of a state sharded across processes (two processes of 4 CPU devices each joined
by `jax.distributed`, one run_dir both reach): each process writes and reads only its shards; the
restored bits equal what was saved and the digests equal those of the same state in one process;
a step failing its digest is moved aside by process 0 alone (exactly one copy in
`checkpoints.corrupt/`) and both processes fall back to the same previous step."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.testing.processes import join, run_processes

pytestmark = pytest.mark.slow


def state(mesh: Mesh, seed: int) -> dict:
    """A learner-like state: a leaf sharded on its last axis over every device, one on its
    leading axis, a replicated bf16 leaf and a replicated counter; each process fills only its
    shards."""
    rng = np.random.default_rng(seed)
    host = {
        "w": rng.standard_normal((16, 64)).astype(np.float32),
        "m": rng.standard_normal((32, 8)).astype(np.float32),
        "b": (np.arange(5) * seed).astype(jnp.bfloat16),
        "count": np.asarray(seed, np.int32),
    }
    axes = tuple(mesh.axis_names)
    specs = {"w": P(None, axes), "m": P(axes, None), "b": P(), "count": P()}
    return {
        k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
        for k, v in host.items()
    }


def mesh_of(devices) -> Mesh:
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(2, 4), ("p", "d"))


def test_two_processes_save_restore_and_fall_back_together(tmp_path):
    from sparserl_jax.checkpoint import array_digests

    run_dir = tmp_path / "run"
    outs = [tmp_path / f"save{p}.json" for p in range(2)]
    run_processes(__file__, [[run_dir, "save", o] for o in outs], devices_per_process=4, wall_s=150)
    saved = [json.loads(o.read_text()) for o in outs]
    # The same state built in this one process (8 devices): the same digests, bit for bit.
    here = array_digests(state(mesh_of(jax.devices()[:8]), 2))
    for s in saved:
        assert s["step"] == 2 and s["equal"], s
        assert s["digests"] == here

    meta = run_dir / "checkpoints" / "2" / "meta" / "metadata"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), data=99)))
    outs = [tmp_path / f"fallback{p}.json" for p in range(2)]
    run_processes(
        __file__, [[run_dir, "fallback", o] for o in outs], devices_per_process=4, wall_s=150
    )
    back = [json.loads(o.read_text()) for o in outs]
    for b in back:
        assert b["step"] == 1 and b["equal"], b
    assert (
        back[0]["digests"]
        == back[1]["digests"]
        == array_digests(state(mesh_of(jax.devices()[:8]), 1))
    )
    moved = sorted(p.name for p in (run_dir / "checkpoints.corrupt").iterdir())
    assert len(moved) == 1 and moved[0].startswith("2-"), moved
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]


def child(run_dir: str, phase: str, out_path: str) -> None:
    from sparserl_jax.checkpoint import CheckpointManager, array_digests

    mesh = mesh_of(jax.devices())
    with CheckpointManager(run_dir, keep=3) as ckpt:
        if phase == "save":
            for step in (1, 2):
                ckpt.save(step, state(mesh, step), {"data": step})
            ckpt.wait()
        restored, meta = ckpt.restore_latest(state(mesh, 0))
    want = state(mesh, meta["step"])
    equal = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for k in want
        for a, b in zip(restored[k].addressable_shards, want[k].addressable_shards, strict=True)
    )
    result = {"step": meta["step"], "equal": equal, "digests": array_digests(restored)}
    with open(out_path, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    child(*join(sys.argv))
