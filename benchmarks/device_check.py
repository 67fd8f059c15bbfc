"""`make device-check`: every accelerator path, checked and timed in one bounded run.

The orchestrator runs each task of `plan()` in its own child process (`python -m
benchmarks.device_check --task NAME`), so a crash, a hang or an out-of-memory in one task is
recorded and the next one runs, and each task's `peak_bytes_in_use` is its own. Every task has
its own budget in seconds and the whole run has one (`total_s`): a task gets the smaller of its
budget and what is left, is killed when it runs over (its finished records are kept: children
write one JSON line per record as they go), and a task that cannot start with at least
`MIN_TASK_S` left is recorded as skipped. The run writes `device_check.json` (everything) and
`device_check.md` (a short summary with the roofline) into `out_dir`.

`--smoke` runs the same tasks at tiny shapes (`device_checks.SMOKE`); on a CPU the kernels run
in interpret mode. The tests run it so this file cannot rot.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import device_checks, device_runs

MIN_TASK_S = 15.0
REPO = Path(__file__).resolve().parents[1]


# The modules a task imports beyond jax/flax/optax/orbax/numpy; a child blocks those named in
# SPARSERL_DEVICE_CHECK_BLOCK that its task does not need (the smoke test blocks grain and
# zstandard, which the device machine may lack).
NEEDS = {"sync": {"zstandard"}}


def plan(shapes: device_checks.Shapes) -> list[tuple[str, float]]:
    """(task, budget seconds) in the order they run, most wanted first: the device, the kernels,
    the engine at the most slots through XLA, attention, the learner with the platform's attention
    kernel, the engine through the kernels, R-KV's contract on both paths; then sync, dense's
    contract, the learner with chunked attention, and the engine at fewer slots."""
    slots = shapes.engine_slots
    engine = [
        f"engine-{s}-{policy}-{path}"
        for s in slots
        for path in ("xla", "kernel")
        for policy in ("dense", "rkv")
    ]
    first, kernel, rest = engine[:2], engine[2:4], engine[4:]
    t0, *longer = shapes.learner_ts
    # Budgets from the H100 (2026-11-26) and H200 (2026-11-27) runs: XLA's compile with
    # autotuning is most of an engine or learner task (29 s dense engine, 68 s R-KV, 34 s learner
    # at 4096); the engine through the kernels and the cuDNN learner step end in 37-43 s; sync's
    # 0.5B anchor and three versions take about 150 s; the learner at 16384 about 76 s.
    tasks = [("env", 30.0), ("kernels", 90.0)] + [(t, 110.0) for t in first]
    # The platform's attention kernel (cuDNN on GPU, splash on TPU): `attention` has checked
    # its numerics by then.
    tasks += [("attention", 45.0), (f"learner-{t0}-auto", 90.0)] + [(t, 90.0) for t in kernel]
    # The engine's contract through both paths (the kernels are the GPU default since
    # 2026-11-28): XLA's and the kernels' compiles, teacher-forced passes. R-KV runs all three
    # kernels; dense and the chunked learner step (measured alike on 2026-11-26/27/28) after sync.
    tasks += [("engine-contract-rkv", 110.0), ("sync", 150.0), ("engine-contract-dense", 100.0)]
    tasks += [(f"learner-{t}-chunked", 110.0) for t in (t0, *longer)]
    tasks += [(t, 110.0) for t in rest]
    return tasks


def run_task(name: str, shapes: device_checks.Shapes, emit) -> None:
    """Run task `name` in this process."""
    if name in ("env", "attention", "kernels"):
        getattr(device_checks, f"check_{name}")(shapes, emit)
    elif name.startswith("learner-"):
        _, t, attention = name.split("-")
        device_runs.check_learner(shapes, emit, seq_len=int(t), attention=attention)
    elif name == "sync":
        device_runs.check_sync(shapes, emit)
    elif name.startswith("engine-contract-"):
        device_runs.check_engine_contract(shapes, emit, policy=name.split("-")[2])
    elif name.startswith("engine-"):
        _, slots, policy, path = name.split("-")
        device_runs.check_engine(shapes, emit, slots=int(slots), policy=policy, path=path)
    else:
        raise ValueError(f"unknown task {name!r}; expected one of {[t for t, _ in plan(shapes)]}")


def child_main(argv: list[str]) -> None:
    """`--task NAME --records FILE [--smoke]`: run one task, one JSON line per record."""
    task, records = argv[argv.index("--task") + 1], Path(argv[argv.index("--records") + 1])
    shapes = device_checks.SMOKE if "--smoke" in argv else device_checks.REAL
    blocked = set(filter(None, os.environ.get("SPARSERL_DEVICE_CHECK_BLOCK", "").split(",")))
    for name in blocked - NEEDS.get(task, set()):
        sys.modules[name] = None  # type: ignore[assignment]  # prove the task never needs it
    with records.open("a") as f:

        def emit(record: dict[str, Any]) -> None:
            f.write(json.dumps(record, default=float) + "\n")
            f.flush()

        try:
            run_task(task, shapes, emit)
        except BaseException as e:  # recorded, then the exit status says it failed
            lines = traceback.format_exception_only(type(e), e)
            emit({"error": "".join(lines).strip()[-2000:], "traceback": traceback.format_exc()})
            raise SystemExit(1) from None


def _run_child(task: str, budget: float, smoke: bool, out_dir: Path) -> dict[str, Any]:
    records = out_dir / f"{task}.jsonl"
    records.unlink(missing_ok=True)
    log = out_dir / f"{task}.log"
    cmd = [sys.executable, "-m", "benchmarks.device_check", "--task", task]
    cmd += ["--records", str(records)] + (["--smoke"] if smoke else [])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.perf_counter()
    with log.open("w") as lf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=budget)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timeout ({budget:.0f} s)"
    got = (
        [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
    )
    if status == "ok" and any(r.get("pass") is False for r in got):
        status = "failed (a check is out of tolerance)"
    error = next((r["error"] for r in got if "error" in r), None)
    if error is None and not status.startswith("ok"):
        error = "".join(log.read_text().splitlines(keepends=True)[-5:]).strip()
    return {
        "status": status,
        "seconds": round(time.perf_counter() - start, 2),
        "budget_s": round(budget, 1),
        "records": [{k: v for k, v in r.items() if k != "traceback"} for r in got],
        "error": error,
    }


def roofline(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each engine run's decode step time beside bytes moved / measured HBM bandwidth."""
    env = results.get("env", {}).get("records", [])
    bw = next((r["gb_per_s"] for r in env if r.get("what") == "hbm_bandwidth"), None)
    rows = []
    for task, res in results.items():
        for r in res.get("records", []) if task.startswith("engine-") else []:
            if "step_ms" not in r or not bw:
                continue
            floor_ms = r["bytes_per_step"] / bw / 1e6
            frac = floor_ms / r["step_ms"]
            rows.append({"task": task, "step_ms": r["step_ms"], "floor_ms": floor_ms,
                         "fraction_of_roofline": frac, "hbm_gb_per_s": bw})  # fmt: skip
    return rows


def orchestrate(
    out_dir: Path,
    *,
    smoke: bool,
    total_s: float,
    only: list[str] | None,
    task_s: float | None = None,
) -> dict:
    """Run the plan within `total_s` (`task_s`: every task's budget instead of the plan's, e.g.
    real shapes on a CPU); write and return the JSON report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = device_checks.SMOKE if smoke else device_checks.REAL
    # "env" always runs: the device, versions and bandwidth every other figure is read against.
    keep = {"env", *(only or [])}
    tasks = [(t, b) for t, b in plan(shapes) if not only or t in keep or t.split("-")[0] in keep]
    start, results = time.perf_counter(), {}
    for task, budget in tasks:
        left = total_s - (time.perf_counter() - start)
        if left < MIN_TASK_S:
            results[task] = {"status": "skipped (total budget spent)", "records": []}
            continue
        results[task] = _run_child(task, min(task_s or budget, left), smoke, out_dir)
        print(f"[device-check] {task}: {results[task]['status']} "
              f"({results[task]['seconds']:.0f} s)", flush=True)  # fmt: skip
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "smoke": smoke,
        "total_budget_s": total_s,
        "total_s": round(time.perf_counter() - start, 2),
        "tasks": results,
        "roofline": roofline(results),
    }
    (out_dir / "device_check.json").write_text(json.dumps(report, indent=1, default=float))
    (out_dir / "device_check.md").write_text(summary(report))
    return report


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def summary(report: dict[str, Any]) -> str:
    """The markdown summary: one table per task, then the roofline."""
    env = report["tasks"].get("env", {}).get("records", [])
    dev = next((r for r in env if r.get("what") == "device"), {})
    lines = [
        f"# Device check, {report['date']}",
        "",
        f"Device: {dev.get('device_kind', '?')} ({dev.get('platform', '?')}), jax "
        f"{dev.get('jax', '?')}; total {report['total_s']:.0f} s of {report['total_budget_s']:.0f}"
        f" s budget{' (smoke shapes)' if report['smoke'] else ''}.",
        "",
    ]
    for task, res in report["tasks"].items():
        lines.append(f"## {task}: {res['status']}")
        if res.get("error"):
            lines.append(f"\n```\n{res['error']}\n```")
        recs = res.get("records", [])
        keys = list(dict.fromkeys(k for r in recs for k in r if k != "error"))
        if recs and keys:
            lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in recs]
        lines.append("")
    if report["roofline"]:
        lines += [
            "## decode roofline",
            "",
            "| task | step ms | floor ms | fraction |",
            "|---|---|---|---|",
        ]
        lines += [f"| {r['task']} | {r['step_ms']:.3g} | {r['floor_ms']:.3g} | "
                  f"{r['fraction_of_roofline']:.2f} |" for r in report["roofline"]]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    child_main(sys.argv[1:])
