"""`sparserl launch` watches its samplers: a dead sampler is started again (a bounded number of
times); when none is left the trainer is stopped and launch exits non-zero saying which; it ends
with the trainer's `summary:` lines, as `sparserl train` does. The jobs here are stand-in
processes (no JAX), so the watching alone is tested."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparserl_jax.config import load_config
from sparserl_jax.decoupled import launch as launch_module
from sparserl_jax.testing import child_env

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def _fake_jobs(monkeypatch, *, trainer: str, sampler: list[str]):
    """Replace each job's command: the trainer runs `trainer`, the k-th sampler start runs
    `sampler[min(k, len - 1)]` (Python source)."""
    starts = []
    spawn = launch_module._spawn

    def fake(argv, log, out=None, cpus=None):
        if "trainer" in argv:
            code = trainer
        else:
            code = sampler[min(len(starts), len(sampler) - 1)]
            starts.append(argv)
        return spawn([sys.executable, "-c", code], log, out, cpus)

    monkeypatch.setattr(launch_module, "_spawn", fake)
    return starts


def test_a_dead_sampler_is_restarted(tmp_path, monkeypatch):
    starts = _fake_jobs(
        monkeypatch,
        trainer=(
            "import sys, time; time.sleep(4); print('{\"end_step\": 2}'); "
            "print('summary: reward 0.1 -> 0.5', file=sys.stderr)"
        ),
        sampler=["import os; os.kill(os.getpid(), 9)", "import time; time.sleep(5)"],
    )
    lines = []
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "exchange.poll_s=0.05"])
    assert launch_module.launch(cfg, TINY, [], 1, log_fn=lines.append) == 0
    assert len(starts) == 2
    assert "launch: sampler 0 exited -9; restart 1 of 3" in lines
    assert lines[-2:] == ["summary: reward 0.1 -> 0.5", "launch: trainer exited 0; samplers [0]"]


def test_no_sampler_left_stops_the_trainer_and_says_which(tmp_path, monkeypatch):
    starts = _fake_jobs(
        monkeypatch,
        trainer="import time; time.sleep(120)",
        sampler=["raise SystemExit(3)"],
    )
    lines = []
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "exchange.poll_s=0.05"])
    code = launch_module.launch(cfg, TINY, [], 2, log_fn=lines.append)
    assert code == launch_module.NO_SAMPLERS
    assert len(starts) == 2 * (1 + launch_module.RESTARTS)
    assert (
        "launch: no sampler left (sampler 0 exited 3 after 3 restarts, sampler 1 exited 3 after "
        "3 restarts); stopping the trainer"
    ) in lines


def test_jobs_are_pinned_to_the_cpus_asked_for(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    assert launch_module.parse_cpus(f"{cpu}") == {cpu}
    assert launch_module.parse_cpus(None) is None
    log = tmp_path / "job.log"
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    proc = launch_module._spawn([sys.executable, "-c", code], log, None, {cpu})
    assert proc.wait(timeout=60) == 0 and log.read_text().strip() == f"[{cpu}]"
    for bad, why in [("x", "not like 0,2,4-7"), ("100000", "not within the CPUs allowed")]:
        with pytest.raises(ValueError, match=why):
            launch_module.parse_cpus(bad)
    out = subprocess.run(
        [sys.executable, "-m", "sparserl_jax", "launch", TINY, "--samplers", "1"]
        + ["--sampler-cpus", "100000", f"run_dir={tmp_path}"],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "not within the CPUs allowed here" in out.stderr
