"""Synchronous vs decoupled training throughput (used by `tools/bench_async.py`).

Each variant is a real run in subprocesses with one CPU device each (`sparserl train`, or
`sparserl launch --samplers N async.max_staleness=S async.partial_rollouts=P`, the trainer and
the samplers pinned to their own CPU sets when given), from the same config and seed. Read from
its `metrics.jsonl`, after `warmup` steps (compiles):

- `steps_per_s`: steps over the wall time between the warm-up step's row and the last row;
- `trainer_idle_fraction`: the trainer's time waiting for a rollout (`async/trainer_wait_s`)
  over its step time (`timing_s/step`); for `sparserl train` the rollout time (`timing_s/gen`),
  during which its learner is idle;
- `reward_last`: the mean sampled training reward over the last fifth of the steps;
- `dropped_stale`: rollouts dropped for staleness (pacing should make it 0);
- `token_staleness_mean`, `spanning_fraction`: per completion token, versions behind; the
  fraction of sequences whose tokens came from more than one version (partial rollouts);
- `data_order_ok`: the ledger proves whole batches trained in data order, exactly once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from sparserl_jax.decoupled.ledger import check_exactly_once
from sparserl_jax.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per job
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # Every variant runs the same programs: compile them once (JAX's persistent cache).
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return env


def warm_start(config: str, overrides: list[str], out: Path) -> Path:
    """Run the config's SFT warm start once (`sparserl train ... train.steps=0`); its step-0
    checkpoint, copied into each variant's run directory, starts every variant from it."""
    cmd = [sys.executable, "-m", "sparserl_jax", "train", config, f"run_dir={out}"]
    proc = subprocess.run(
        [*cmd, *overrides, "train.steps=0"], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"warm start failed:\n{proc.stderr[-3000:]}")
    return out / "checkpoints"


def run_variant(
    config: str,
    overrides: list[str],
    *,
    samplers: int,
    staleness: int,
    warmup: int,
    checkpoints: Path | None = None,
    partial: bool = True,
    trainer_cpus: str | None = None,
    sampler_cpus: str | None = None,
) -> dict:
    """One run (`samplers=0`: `sparserl train`), from `checkpoints` if given; its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        if checkpoints is not None:
            shutil.copytree(checkpoints, run / "checkpoints")
        base = [sys.executable, "-m", "sparserl_jax"]
        args = [config, f"run_dir={run}", *overrides]
        if samplers:
            cmd = [*base, "launch", *args, "--samplers", str(samplers)]
            cmd += [f"async.max_staleness={staleness}", f"async.partial_rollouts={partial}"]
            for flag, cpus in (("--trainer-cpus", trainer_cpus), ("--sampler-cpus", sampler_cpus)):
                if cpus is not None:
                    cmd += [flag, cpus]
        else:
            cmd = [*base, "train", *args]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rows = [r for r in read_metrics(run / "metrics.jsonl") if "timing_s/step" in r]
        order_ok = True
        if samplers:
            try:
                check_exactly_once(run)
            except ValueError:
                order_ok = False
    timed = rows[warmup:]
    if len(timed) < 2:
        raise ValueError(f"need more than warmup={warmup} + 1 steps, got {len(rows)}")
    span = timed[-1]["wall_time_s"] - timed[0]["wall_time_s"]
    step_s = sum(r["timing_s/step"] for r in timed[1:])
    idle_key = "async/trainer_wait_s" if samplers else "timing_s/gen"
    idle = sum(r[idle_key] for r in timed[1:])
    scores = [r["critic/score/mean"] for r in rows]
    k = max(1, len(scores) // 5)
    return {
        "mode": f"decoupled x{samplers}" if samplers else "sync (sparserl train)",
        "samplers": samplers,
        "max_staleness": staleness if samplers else None,
        "partial_rollouts": partial if samplers and staleness else None,
        "trainer_cpus": trainer_cpus if samplers else None,
        "sampler_cpus": sampler_cpus if samplers else None,
        "steps_per_s": (len(timed) - 1) / span,
        "trainer_idle_fraction": idle / step_s,
        "staleness_mean": float(np.mean([r.get("async/staleness", 0) for r in timed])),
        "dropped": int(rows[-1].get("async/dropped", 0)),
        "dropped_stale": int(rows[-1].get("async/dropped_stale", 0)),
        "token_staleness_mean": float(
            np.mean([r.get("async/token_staleness_mean", 0) for r in timed])
        ),
        "spanning_fraction": float(
            np.mean([r.get("async/spanning_versions_fraction", 0) for r in timed])
        ),
        "data_order_ok": order_ok,
        "rollout_fraction_sync": None
        if samplers
        else float(sum(r["timing_s/gen"] for r in timed) / sum(r["timing_s/step"] for r in timed)),
        "reward_last": float(np.mean(scores[-k:])),
        "wall_s": wall,
    }
