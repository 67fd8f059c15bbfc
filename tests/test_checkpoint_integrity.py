"""Checkpoints prove their integrity: a digest of every array and of the metadata is written with
the step and checked on restore; a step that fails is reported in one line, moved aside (never
deleted) and the previous one used, and a run that fell back saves that step again without
colliding; a checkpoint that does not match the config is refused before anything is written."""

import json
import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sparserl_jax.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    array_digests,
)
from sparserl_jax.cli import main
from sparserl_jax.config import load_config
from sparserl_jax.testing import assert_trees_equal
from sparserl_jax.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# 4 prompts x 2 samples = 8 rows: divides the 8 fake devices' data*fsdp shards.
FAST = ["data.batch_size=4", "sft.steps=0", "train.eval_examples=0"]


def _state(seed: int):
    k = jax.random.key(seed)
    return {
        "w": jax.random.normal(k, (64, 32)),
        "b": jnp.arange(5, dtype=jnp.bfloat16) * seed,
        "count": jnp.asarray(seed, jnp.int32),
    }


def _two_steps(run_dir: Path) -> None:
    with CheckpointManager(run_dir, keep=3) as ckpt:
        ckpt.save(1, _state(1), {"data": 1})
        ckpt.save(2, _state(2), {"data": 2})


def _data_files(step_dir: Path) -> list[Path]:
    return [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]


def _fell_back(run_dir: Path, caplog, what: str) -> None:
    """Restoring falls back to step 1 with exactly one log line about step 2 that says `what`."""
    with CheckpointManager(run_dir, keep=3) as ckpt:
        restored, meta = ckpt.restore_latest(_state(0))
        assert ckpt.steps() == [1]
    assert meta == {"data": 1, "step": 1}
    assert_trees_equal(restored, _state(1))
    lines = [r.getMessage() for r in caplog.records if "checkpoint step 2" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "\n" not in lines[0] and what in lines[0] and "moved to" in lines[0], lines[0]
    moved = list((run_dir / "checkpoints.corrupt").glob("2-*"))
    assert len(moved) == 1 and (moved[0] / "_CHECKPOINT_METADATA").exists()


def test_digests_name_every_array_and_change_with_one_bit():
    state = _state(3)
    got = array_digests(state)
    assert set(got) == {"['w']", "['b']", "['count']"}
    assert got["['w']"]["shape"] == [64, 32] and got["['b']"]["dtype"] == "bfloat16"
    flipped = dict(state, w=state["w"].at[7, 3].set(jnp.nextafter(state["w"][7, 3], 9.0)))
    again = array_digests(flipped)
    assert again["['w']"]["digest"] != got["['w']"]["digest"]
    assert again["['b']"] == got["['b']"]
    # Signed zeros and NaN payloads are bits like any other.
    z = array_digests({"z": jnp.zeros(3)})["['z']"]["digest"]
    assert z != array_digests({"z": -jnp.zeros(3)})["['z']"]["digest"]


def test_a_flipped_byte_in_an_array_file_is_caught(tmp_path, caplog):
    _two_steps(tmp_path)
    files = _data_files(tmp_path / "checkpoints" / "2")
    assert files
    for path in files:  # flip one byte in the middle of every data file
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    _fell_back(tmp_path, caplog, "checkpoint step 2")


def test_an_array_that_changed_on_disk_fails_its_digest(tmp_path, caplog):
    # Rewrite step 2's arrays with other values through Orbax itself (a well-formed file whose
    # content is not what was saved): only the digest can tell.
    _two_steps(tmp_path)
    state_dir = tmp_path / "checkpoints" / "2" / "state"
    shutil.rmtree(state_dir)
    tampered = dict(_state(2), w=_state(2)["w"] * 2)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(state_dir, tampered)
    _fell_back(tmp_path, caplog, "array ['w'] (state/) fails its digest")


def test_changed_meta_fails_its_digest(tmp_path, caplog):
    _two_steps(tmp_path)
    path = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps(dict(meta, data=99)))
    _fell_back(tmp_path, caplog, "meta (meta/) fails its digest")


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: shutil.rmtree(d / "digests"),
        lambda d: (d / "digests" / "metadata").write_text("{not json"),
        lambda d: shutil.rmtree(d / "meta"),
        lambda d: [p.unlink() for p in _data_files(d)],
        lambda d: [os.truncate(p, p.stat().st_size // 3) for p in _data_files(d)],
    ],
    ids=["no-digests", "bad-digests", "no-meta", "deleted-arrays", "truncated-arrays"],
)
def test_incomplete_steps_fall_back(tmp_path, caplog, damage):
    _two_steps(tmp_path)
    damage(tmp_path / "checkpoints" / "2")
    _fell_back(tmp_path, caplog, "checkpoint step 2")


def test_every_step_corrupt_restores_nothing_and_keeps_them_all(tmp_path, caplog):
    _two_steps(tmp_path)
    for step in (1, 2):
        shutil.rmtree(tmp_path / "checkpoints" / str(step) / "digests")
    with CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore_latest(_state(0)) is None
        assert ckpt.steps() == []
    assert len(list((tmp_path / "checkpoints.corrupt").iterdir())) == 2


def test_a_checkpoint_of_another_shape_is_a_clear_error_and_nothing_moves(tmp_path):
    _two_steps(tmp_path)
    other = dict(_state(0), w=jnp.zeros((64, 48)))
    with CheckpointManager(tmp_path) as ckpt, pytest.raises(CheckpointMismatchError) as e:
        ckpt.restore_latest(other)
    assert "array ['w'] is float32[64, 32] in the checkpoint but the run expects" in str(e.value)
    assert "float32[64, 48]" in str(e.value)
    missing = {k: v for k, v in _state(0).items() if k != "count"}
    with CheckpointManager(tmp_path) as ckpt, pytest.raises(CheckpointMismatchError, match="count"):
        ckpt.restore_latest(missing)
    with CheckpointManager(tmp_path) as ckpt:
        assert ckpt.steps() == [1, 2]
    assert not (tmp_path / "checkpoints.corrupt").exists()


def test_a_checkpoint_from_before_digests_restores_unverified(tmp_path, caplog):
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(
        tmp_path / "checkpoints", options=options, item_names=("state", "meta")
    ) as old:
        old.save(
            4,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_state(4)), meta=ocp.args.JsonSave({"step": 4})
            ),
        )
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path) as ckpt:
        restored, meta = ckpt.restore_latest(_state(0))
    assert meta["step"] == 4
    assert_trees_equal(restored, _state(4))
    assert any("restored unverified" in r.getMessage() for r in caplog.records)


def test_explicit_restore_of_a_corrupt_step_raises_one_line(tmp_path):
    _two_steps(tmp_path)
    for path in _data_files(tmp_path / "checkpoints" / "2"):
        path.unlink()
    with CheckpointManager(tmp_path) as ckpt, pytest.raises(CheckpointError) as e:
        ckpt.restore(2, _state(0))
    assert str(e.value).startswith("checkpoint step 2: ") and "\n" not in str(e.value)


# ---- whole runs ----------------------------------------------------------------------------------


def _final(run_dir):
    with CheckpointManager(run_dir, async_save=False) as ckpt:
        step = ckpt.steps()[-1]
        path = run_dir / "checkpoints" / str(step) / "digests" / "metadata"
        return step, json.loads(path.read_text())["arrays"]


@pytest.mark.slow
def test_run_falls_back_past_a_corrupt_step_and_finishes_bit_identical(tmp_path, caplog):
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(load_config(TINY, [f"run_dir={full}", *FAST, "train.steps=4"]), log_fn=lambda m: None)
    train(load_config(TINY, [f"run_dir={cut}", *FAST, "train.steps=3"]), log_fn=lambda m: None)
    for path in _data_files(cut / "checkpoints" / "3"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    logs: list[str] = []
    cfg = load_config(TINY, [f"run_dir={cut}", *FAST, "train.steps=4"])
    summary = train(cfg, log_fn=logs.append)
    assert summary["start_step"] == 2 and summary["end_step"] == 4
    assert any("checkpoint step 3" in r.getMessage() for r in caplog.records)
    # Step 3 was trained again and saved again (no StepAlreadyExistsError), and the run's end is
    # the uninterrupted run's, bit for bit (the digests of every array agree).
    assert _final(cut) == _final(full)
    assert len(list((cut / "checkpoints.corrupt").glob("3-*"))) == 1
    # The same command again: nothing to do, nothing breaks.
    again = train(cfg, log_fn=logs.append)
    assert again["start_step"] == 4
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


@pytest.mark.slow
def test_config_that_does_not_match_the_checkpoint_changes_nothing(tmp_path, capsys):
    train(load_config(TINY, [f"run_dir={tmp_path}", *FAST, "train.steps=1"]), log_fn=print)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = main(
        ["train", TINY, f"run_dir={tmp_path}", *FAST, "train.steps=2", "model.arch.hidden_size=64"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "does not match this run's config" in err[0], err
    assert "array " in err[0]
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after.keys() == before.keys()
    assert all(
        np.array_equal(np.frombuffer(after[p], np.uint8), np.frombuffer(before[p], np.uint8))
        for p in before
    )
