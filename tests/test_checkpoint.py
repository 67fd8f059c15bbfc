"""Orbax checkpoints: bit-exact sharded round trip, keep-N, corrupt-latest fallback, SIGTERM."""

import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from sparserl_jax.checkpoint import CheckpointManager, PreemptionGuard
from sparserl_jax.parallel import MeshConfig, make_mesh
from sparserl_jax.testing import assert_trees_equal


def _state(seed: int):
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    k = jax.random.key(seed)
    w = jax.device_put(
        jax.random.normal(k, (8, 6)), NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))
    )
    return {
        "params": {"w": w, "b": jnp.arange(3, dtype=jnp.bfloat16) * seed},
        "opt": {"count": jnp.asarray(seed, jnp.int32), "mu": jnp.full((4,), -0.0)},
        "rng": jax.random.key_data(k),
        "special": jnp.array([np.nan, np.inf, -np.inf, 1e-45], jnp.float32),
    }


def test_round_trip_bit_exact_and_sharded(tmp_path):
    state = _state(1)
    with CheckpointManager(tmp_path, keep=2) as ckpt:
        ckpt.save(5, state, {"data": {"pos": 17}, "sync_version": 3})
        ckpt.wait()
        restored, meta = ckpt.restore(5, state)
    assert_trees_equal(restored, state)
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding
    assert meta == {"data": {"pos": 17}, "sync_version": 3, "step": 5}


def test_keep_n_and_latest(tmp_path):
    with CheckpointManager(tmp_path, keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step))
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
        restored, meta = ckpt.restore_latest(_state(0))
    assert meta["step"] == 3
    assert_trees_equal(restored, _state(3))


def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog):
    with CheckpointManager(tmp_path, keep=3) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        ckpt.wait()
    # Truncate every file of the newest checkpoint's arrays to a third (a half-written copy).
    latest = tmp_path / "checkpoints" / "2" / "state"
    damaged = 0
    for root, _, files in os.walk(latest):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 3)
            damaged += 1
    assert damaged
    with CheckpointManager(tmp_path, keep=3) as ckpt:
        restored, meta = ckpt.restore_latest(_state(0))
        assert ckpt.steps() == [1]
    assert meta["step"] == 1
    assert_trees_equal(restored, _state(1))
    _assert_reported_and_moved(caplog, tmp_path, 2)


def _assert_reported_and_moved(caplog, run_dir, step):
    """One log line names the step and says where it went; the step is kept, moved aside."""
    lines = [r.getMessage() for r in caplog.records if f"checkpoint step {step}" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "moved to" in lines[0], lines
    moved = list((run_dir / "checkpoints.corrupt").glob(f"{step}-*"))
    assert len(moved) == 1 and (moved[0] / "state").exists() or (moved[0] / "meta").exists()
    assert not (run_dir / "checkpoints" / str(step)).exists()


def test_missing_checkpoint_dir_item(tmp_path, caplog):
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
        ckpt.wait()
    shutil.rmtree(tmp_path / "checkpoints" / "2" / "state")
    with CheckpointManager(tmp_path) as ckpt:
        _, meta = ckpt.restore_latest(_state(0))
    assert meta["step"] == 1
    _assert_reported_and_moved(caplog, tmp_path, 2)


def test_a_refused_checkpoint_is_moved_aside_and_the_previous_one_restored(tmp_path, caplog):
    """`restore_latest(refuse=...)`: a step whose meta the caller refuses (the decoupled
    trainer's: saved by a superseded incarnation) goes the way of a corrupt one."""
    with CheckpointManager(tmp_path, keep=3) as ckpt:
        ckpt.save(1, _state(1), {"epoch": 2})
        ckpt.save(2, _state(2), {"epoch": 1})
        ckpt.wait()
    with CheckpointManager(tmp_path, keep=3) as ckpt:
        refuse = lambda meta: "is epoch 1's" if meta["epoch"] == 1 else None  # noqa: E731
        restored, meta = ckpt.restore_latest(_state(0), refuse)
        assert ckpt.steps() == [1] and not ckpt.has(2) and ckpt.meta(1) == {"epoch": 2, "step": 1}
    assert meta["step"] == 1
    assert_trees_equal(restored, _state(1))
    _assert_reported_and_moved(caplog, tmp_path, 2)
    assert any("checkpoint step 2 is epoch 1's; moved to" in r.getMessage() for r in caplog.records)


def test_a_step_already_saved_is_moved_aside_only_when_an_older_epoch_saved_it(tmp_path):
    """The decoupled trainer's check before it saves a step: absent, save; an older epoch's
    (saved past its fence check), move it aside; its own epoch's or a newer one's, stop."""
    from sparserl_jax.decoupled.exchange import SupersededError
    from sparserl_jax.decoupled.processes import older_checkpoint

    with CheckpointManager(tmp_path, async_save=False) as ckpt:
        ckpt.save(4, _state(4), {"epoch": 1})
        ckpt.save(6, _state(6), {"epoch": 3})
        assert older_checkpoint(ckpt, 2, epoch=2) is False
        assert older_checkpoint(ckpt, 4, epoch=2) is True
        with pytest.raises(SupersededError, match="step 6 is a newer trainer's: epoch 2 stops"):
            older_checkpoint(ckpt, 6, epoch=2)
        assert ckpt.has(6) and ckpt.steps() == [4, 6]
        (tmp_path / "checkpoints" / "8" / "state").mkdir(parents=True)  # a save cut off
        assert older_checkpoint(ckpt, 8, epoch=2) is True


def test_saving_a_donated_state_is_one_line_not_a_crash(tmp_path):
    state = _state(1)
    jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)(state)
    with CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"step 3: \d+ arrays of the state were deleted"):
            ckpt.save(3, state)
        assert ckpt.steps() == []


def test_empty_run_has_nothing_to_restore(tmp_path):
    with CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore_latest(_state(0)) is None


def test_sigterm_sets_flag_and_restores_handler():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not guard.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested and guard.signal_received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
