"""`sparserl trainer` as two processes (`--coordinator/--num-processes/--process-id`, one CPU
device each, gloo) with one sampler: process 0 leads (queue, ledger, metrics, verdicts), process
1 follows its events; both train every step together, publish their shards and save together.
The run completes, the ledger is exactly-once, every consumed rollout was made with weights the
sampler verified bit-identical (assembled from the two parts), and a relaunch with more steps
resumes from the checkpoint both processes saved."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparserl_jax.decoupled.ledger import Ledger, check_exactly_once
from sparserl_jax.testing import child_env
from sparserl_jax.testing.processes import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
FAST = ["data.batch_size=4", "sft.steps=0", "train.eval_examples=0", "exchange.lease_s=20"]
WALL_S = 300


def _run(tmp_path: Path, steps: int, tag: str) -> list[str]:
    run = tmp_path / "run"
    common = [TINY, f"run_dir={run}", f"train.steps={steps}", "train.save_every=2", *FAST]
    port = free_port()
    cmds = [
        ["trainer", *common, "--coordinator", f"localhost:{port}", "--num-processes", "2",
         "--process-id", str(p)]
        for p in range(2)
    ] + [["sampler", *common, "--id", "0"]]  # fmt: skip
    logs = [tmp_path / f"{tag}-{i}.log" for i in range(3)]
    procs = []
    for cmd, log in zip(cmds, logs, strict=True):
        with log.open("wb") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "sparserl_jax", *cmd],
                    cwd=ROOT,
                    env=child_env(),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [p.wait(timeout=WALL_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [log.read_text() for log in logs]
    for code, text in zip(codes, texts, strict=True):
        assert code == 0, text[-3000:]
    return texts


def _verified(text: str) -> set[tuple[int, int]]:
    epoch, out = None, set()
    for line in text.splitlines():
        if m := re.search(r"following trainer epoch (\d+)", line):
            epoch = int(m.group(1))
        if m := re.search(r"(?:anchor|patch) (\d+) verified bit-identical", line):
            out.add((epoch, int(m.group(1))))
    return out


def test_two_trainer_processes_and_a_sampler_complete_exactly_once(tmp_path):
    leader, follower, sampler = _run(tmp_path, 3, "first")
    run = tmp_path / "run"
    summary = json.loads(leader.strip().splitlines()[-1])
    assert summary["end_step"] == 3
    assert json.loads(follower.strip().splitlines()[-1])["end_step"] == 3
    assert check_exactly_once(run)["steps"] == 3
    verified = _verified(sampler)
    rows = Ledger(run).rows("consumed")
    assert rows
    for r in rows:
        assert r["verified"] and (r["rollout_epoch"], r["weight_version"]) in verified, r
    # Relaunched with more steps: both processes resume from the step-3 checkpoint.
    leader, follower, sampler = _run(tmp_path, 5, "second")
    assert json.loads(leader.strip().splitlines()[-1])["start_step"] == 3
    assert json.loads(follower.strip().splitlines()[-1])["end_step"] == 5
    assert check_exactly_once(run)["steps"] == 5


def test_launch_two_trainer_processes_one_killed_then_the_same_command_completes(tmp_path):
    """`launch --trainer-processes 2`: trainer process 1 killed with -9 after checkpoint 2; the
    launcher stops the other processes and exits non-zero within a bound, leaving none running;
    the same command again resumes and completes, exactly once."""
    import os
    import signal
    import time

    from sparserl_jax.decoupled.launch import STOP_GRACE_S, TRAINER_PROCESS_DIED

    run = tmp_path / "run"
    args = [sys.executable, "-m", "sparserl_jax", "launch", TINY, "--samplers", "1"]
    args += ["--trainer-processes", "2", f"run_dir={run}", "train.steps=6", "train.save_every=2"]
    args += FAST
    log = tmp_path / "launch.log"
    with log.open("wb") as f:
        launcher = subprocess.Popen(args, cwd=ROOT, env=child_env(), stdout=f, stderr=f)
    try:
        deadline = time.monotonic() + WALL_S
        while not (run / "checkpoints" / "2").is_dir():
            assert time.monotonic() < deadline and launcher.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        pids = [int(p) for p in re.findall(r"pid (\d+)", log.read_text())]
        follower = int(re.search(r"trainer process 1 pid (\d+)", log.read_text()).group(1))
        os.kill(follower, signal.SIGKILL)
        t0 = time.monotonic()
        code = launcher.wait(timeout=STOP_GRACE_S + 60)
        assert code == TRAINER_PROCESS_DIED, log.read_text()[-3000:]
        assert time.monotonic() - t0 < STOP_GRACE_S + 60
        for pid in pids:  # no orphans
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in _state(pid), pid
    finally:
        if launcher.poll() is None:
            launcher.kill()
    with log.open("ab") as f:
        again = subprocess.run(args, cwd=ROOT, env=child_env(), stdout=f, stderr=f, timeout=WALL_S)
    assert again.returncode == 0, log.read_text()[-3000:]
    assert check_exactly_once(run)["steps"] == 6


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"
