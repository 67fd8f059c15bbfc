"""`make device-check` on CPU at tiny shapes (kernels in interpret mode), so it cannot rot: every
task runs in its own process and passes its references, grain and zstandard are never imported
where not needed (the device machine may lack them), and the time budgets are enforced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import device_check, device_checks

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_smoke_run_passes_every_task(tmp_path):
    env = {**os.environ, "SPARSERL_DEVICE_CHECK_BLOCK": "grain,zstandard", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "tools/device_check.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = json.loads((tmp_path / "device_check.json").read_text())
    failed = {t: r for t, r in report["tasks"].items() if r["status"] != "ok"}
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tasks = report["tasks"]
    assert list(tasks) == [t for t, _ in device_check.plan(device_checks.SMOKE)]
    # Every kernel op was checked against XLA, within its written tolerance.
    ops = {r["op"] for r in tasks["kernels"]["records"]}
    assert ops == {"paged_attention", "paged_attention+probs", "window_scores", "compaction"}
    for task in ("kernels", "attention", "sync"):
        assert all(r["pass"] and r["err"] <= r["tol"] for r in tasks[task]["records"] if "tol" in r)
    phases = [r["what"] for r in tasks["sync"]["records"]]
    assert phases == ["anchor"] + ["publish", "apply", "bits"] * 4
    assert all(r["changed"] > 0 for r in tasks["sync"]["records"] if r["what"] == "publish")
    rkv = tasks["engine-4-rkv-xla"]["records"][0]
    assert (
        rkv["tokens_evicted"] > 0
        and rkv["kv_bytes_per_step"]
        < (tasks["engine-4-dense-xla"]["records"][0]["kv_bytes_per_step"])
    )
    assert tasks["learner-64-chunked"]["records"][0]["grad_norm"] > 0
    # The engine's contract on both paths; on CPU the interpreted kernels sample what XLA does.
    for policy in ("dense", "rkv"):
        *paths, versus = tasks[f"engine-contract-{policy}"]["records"]
        assert [r["path"] for r in paths] == ["xla", "kernel"] and versus["pass"]
        assert all(0 < r["mean_abs_err"] < 0.05 for r in paths)
        assert [r["decode_ran"] for r in paths] == ["xla", "pallas_gpu"]
        assert versus["rows_identical"] == 1.0
    xla = tasks["engine-contract-rkv"]["records"][0]
    # It evicted, and the check can see a broken contract: the teacher without the replay.
    assert xla["tokens_evicted"] > 0 and xla["mean_abs_err_no_replay"] > 10 * xla["mean_abs_err"]
    assert len(report["roofline"]) == 4
    assert "## decode roofline" in (tmp_path / "device_check.md").read_text()


def test_a_task_over_its_budget_is_killed_and_recorded(tmp_path):
    start = time.perf_counter()
    got = device_check._run_child("engine-4-dense-xla", 2.0, True, tmp_path)
    assert got["status"] == "timeout (2 s)"
    assert time.perf_counter() - start < 15


def test_the_total_budget_skips_what_cannot_start(tmp_path):
    report = device_check.orchestrate(tmp_path, smoke=True, total_s=5.0, only=["sync"])
    skipped = {"status": "skipped (total budget spent)", "records": []}
    assert report["tasks"] == {"env": skipped, "sync": skipped}  # env always comes along
    assert (tmp_path / "device_check.md").exists()


def test_a_failing_task_is_recorded_with_its_error(tmp_path):
    got = device_check._run_child("engine-4-sparse-xla", 60.0, True, tmp_path)
    assert got["status"] == "failed (exit 1)"
    assert "policy 'sparse' unknown" in got["error"]
