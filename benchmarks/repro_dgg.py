"""DGG's sample-efficiency claim on this stack (used by `tools/repro_dgg.py`; issue 18 item 4).

Paper: "When to Stop Reusing: Dynamic Gradient Gating for Sample-Efficient RLVR" (arXiv
2605.19425): reusing each rollout batch for up to K = 4 passes with the gate reaches the
single-use GRPO run's final score with 2.0-2.9x fewer rollout batches, never ending below it.

Every arm is one `sparserl train` run (a subprocess, one CPU device) of the same config, seed,
prompts and hyperparameters, started from one shared SFT checkpoint (`async_runs.warm_start`,
its step-0 checkpoint copied byte for byte into each run directory). The arms differ only in
`learner.gating`:

- `single`: K = 1 (one update per rollout batch, the baseline);
- `fixed2`, `fixed4`, `fixed8`: K passes on every batch, gate off (it still logs g and z);
- `dgg4`, `dgg8`: K passes at most, the gate on (tau 0.3), increments counted across batches
  (`reset_each_batch=false`, the default);
- `dgg4_batch`, `dgg8_batch`: the same with increments only between passes of one batch;
- `dgg4_rising`: K = 4 with `rule=rising` (fire when a mini-batch's energy rose since its
  previous pass; `rl.gating`).

A regime is a set of overrides for every arm (e.g. a higher learning rate, where fixed reuse
hurts). Figures, per arm (`summarise_arm`): the rollout batches needed to reach the single-use
run's final reward, on the training reward (the batch's sampled reward, a trailing mean over
`smooth` steps) and on the held-out reward (`val/reward_mean`, sampled at T = 1 on held-out
prompts, every `train.eval_every` steps); the final rewards; gate fires and passes applied per
batch; and from the per-pass `dgg/z_pass{k}`, what the gate saw (`gate_diagnostics`). With
uncertainty over the seeds (`bootstrap_ratio`, each arm paired with the single-use run of its
seed): the area under the held-out reward curve (its mean over the evaluations after step 0)
against single use's, and single use's rollout batches to the target over the arm's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.async_runs import ROOT, _env
from benchmarks.repro_sparse_rl import bootstrap_ratio
from sparserl_jax.metrics import read_metrics

ARMS: dict[str, list[str]] = {
    "single": ["learner.gating.max_passes=1", "learner.gating.enabled=false"],
    "fixed2": ["learner.gating.max_passes=2", "learner.gating.enabled=false"],
    "fixed4": ["learner.gating.max_passes=4", "learner.gating.enabled=false"],
    "fixed8": ["learner.gating.max_passes=8", "learner.gating.enabled=false"],
    "dgg4": ["learner.gating.max_passes=4", "learner.gating.enabled=true"],
    "dgg4_rising": [
        "learner.gating.max_passes=4",
        "learner.gating.enabled=true",
        "learner.gating.rule=rising",
    ],
    "dgg8": ["learner.gating.max_passes=8", "learner.gating.enabled=true"],
    "dgg4_batch": [
        "learner.gating.max_passes=4",
        "learner.gating.enabled=true",
        "learner.gating.reset_each_batch=true",
    ],
    "dgg8_batch": [
        "learner.gating.max_passes=8",
        "learner.gating.enabled=true",
        "learner.gating.reset_each_batch=true",
    ],
}


def run_arm(
    config: str,
    overrides: list[str],
    run_dir: Path,
    checkpoints: Path,
    *,
    rerun: bool = True,
    keep_finished: bool = False,
) -> dict:
    """One `sparserl train` run in `run_dir`, started from a copy of `checkpoints` (the shared
    SFT step 0). Returns its metrics rows, resolved config and wall time. `rerun=False` reads
    what a finished run left in `run_dir` instead (to re-analyse, e.g. with another smoothing);
    `keep_finished` does so only when the run there finished with these very overrides."""

    def result(wall_s: float) -> dict:
        rows = read_metrics(run_dir / "metrics.jsonl")
        config = json.loads((run_dir / "config.json").read_text())
        return {"rows": rows, "config": config, "wall_s": wall_s}

    done = run_dir / "done.json"
    if not rerun or (keep_finished and done.exists() and json.loads(done.read_text()) == overrides):
        return result(0.0)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    shutil.copytree(checkpoints, run_dir / "checkpoints")
    cmd = [sys.executable, "-m", "sparserl_jax", "train", config, f"run_dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (run_dir / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    # `sparserl train` stopped by a signal exits 0 with its checkpoint saved: not finished.
    if json.loads(proc.stdout.strip().splitlines()[-1]).get("stopped_by_signal"):
        raise RuntimeError(f"{run_dir} was stopped by a signal; run the same command again")
    if "resumed from" not in proc.stderr:
        raise RuntimeError(f"{run_dir} did not start from the shared checkpoint:\n{proc.stderr}")
    done.write_text(json.dumps(overrides))
    return result(wall)


def curves(rows: list[dict]) -> dict[str, np.ndarray]:
    """Per-step training reward (steps 1..N) and the held-out evaluations (step, reward)."""
    train = sorted((r["step"], r["critic/score/mean"]) for r in rows if "critic/score/mean" in r)
    val = sorted(
        (
            (r["step"], r["val/reward_mean"], r.get("val/greedy_reward_mean"))
            for r in rows
            if "val/reward_mean" in r
        ),
        key=lambda v: v[0],
    )
    greedy = [g for _, _, g in val]
    return {
        "train_step": np.array([s for s, _ in train], np.int64),
        "train_reward": np.array([v for _, v in train], np.float64),
        "val_step": np.array([s for s, _, _ in val], np.int64),
        "val_reward": np.array([v for _, v, _ in val], np.float64),
        "val_greedy": np.array(greedy if None not in greedy else [], np.float64),
    }


def area(steps: np.ndarray, values: np.ndarray) -> float | None:
    """The area under a held-out curve as its mean over the evaluations after step 0 (the
    shared start): with an evaluation after every batch, the mean reward over the run."""
    after = values[steps > 0]
    return float(after.mean()) if after.size else None


def trailing_mean(x: np.ndarray, window: int) -> np.ndarray:
    """`out[i] = mean(x[max(0, i - window + 1) : i + 1])`."""
    c = np.concatenate([[0.0], np.cumsum(x, dtype=np.float64)])
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(0, i - window)
    return (c[i] - c[lo]) / (i - lo)


def batches_to_reach(steps: np.ndarray, values: np.ndarray, target: float, *, first: int = 0):
    """The first step (rollout batches used) whose value is >= target, among steps >= `first`;
    None if never."""
    hit = np.nonzero((values >= target - 1e-12) & (steps >= first))[0]
    return int(steps[hit[0]]) if hit.size else None


def gate_diagnostics(rows: list[dict], tau: float) -> dict:
    """What the gate saw on the per-pass logs: z on pass 1 (never armed), z on later passes,
    how often a later pass had z > tau (the gate fires there once its window is full; for a
    gate that is off, where it would have fired), and the mean increment per pass."""
    steps = [r for r in rows if "dgg/z_pass1" in r]
    if not steps:
        return {}
    z1 = np.array([r["dgg/z_pass1"] for r in steps])
    later = [(k, r[f"dgg/z_pass{k}"]) for r in steps for k in range(2, 9) if f"dgg/z_pass{k}" in r]
    z_later = np.array([z for _, z in later]) if later else np.zeros(0)
    dg = {}
    for k in range(1, 9):
        vals = [r[f"dgg/dg_pass{k}"] for r in steps if f"dgg/dg_pass{k}" in r]
        if vals:
            dg[f"pass{k}"] = float(np.mean(vals))
    return {
        "z_pass1_mean": float(z1.mean()),
        "z_pass1_above_tau": float(np.mean(z1 > tau)),
        "z_later_mean": float(z_later.mean()) if z_later.size else None,
        "z_later_max": float(z_later.max()) if z_later.size else None,
        "z_later_above_tau": float(np.mean(z_later > tau)) if z_later.size else None,
        "armed_passes_per_batch": float(np.mean([r["dgg/armed_passes"] for r in steps])),
        "dg_mean_by_pass": dg,
    }


# Gate rules replayed on a fixed-reuse run's per-pass log (`replay_gates`). The statistic x of
# pass k (k > 1) is compared with a window of earlier x: "pooled" is the gate as built (the
# increment dg against every earlier increment, pass 1's included); "pooled_rising" also needs
# dg > 0 (a real surge); "pooled_later" keeps pass 1's steps out of the window (the window
# holds only the increments of later passes, of every earlier batch); the "per_pass" rules
# compare pass k only with earlier batches' pass k (of dg, of the energy g, or of g relative to
# the batch's pass-1 energy).
REPLAY_RULES = (
    "pooled",
    "pooled_rising",
    "pooled_later",
    "per_pass_dg",
    "per_pass_g",
    "per_pass_ratio",
)


def pass_energies(rows: list[dict]) -> tuple[np.ndarray, int]:
    """`([batches, K * M], M)`: the lm_head gradient energy of every step of a run whose every
    batch ran K passes of M mini-batches, in order: the logged `dgg/g_update{i}` with several
    mini-batches, else (M = 1) rebuilt from the last pass's `dgg/g` and the logged increments
    `dgg/dg_pass{k}`."""
    steps = [r for r in rows if "dgg/dg_pass1" in r]
    k_max = min(r["dgg/passes_run"] for r in steps)
    if "dgg/g_update1" in steps[0]:
        m = steps[0]["actor/updates"] // steps[0]["dgg/passes_run"]
        return np.array(
            [[r[f"dgg/g_update{i}"] for i in range(1, k_max * m + 1)] for r in steps]
        ), m
    g = np.zeros((len(steps), k_max))
    for b, r in enumerate(steps):
        g[b, -1] = r["dgg/g"]
        for k in range(k_max - 1, 0, -1):
            g[b, k - 1] = g[b, k] - r[f"dgg/dg_pass{k + 1}"]
    return g, 1


def replay_gates(rows: list[dict], *, tau: float, window: int, eps: float = 1e-8) -> dict:
    """Where each rule of `REPLAY_RULES` would fire on a fixed-reuse run (gate off, K passes on
    every batch), the trajectory held fixed (so only the first fire is exact; later ones show how
    often the rule trips). Armed as the gate is: pass k > 1, window full. With M mini-batches
    per pass every step is tested, and the "per_pass" rules compare a step with earlier
    batches' steps at the same pass and mini-batch. Per rule: the fires, the batches with one
    and the first such batch (1-based)."""
    g, m = pass_energies(rows)
    dg = np.diff(g, axis=1, prepend=np.nan)
    dg[1:, 0] = g[1:, 0] - g[:-1, -1]
    if m == 1:
        dg[:, 0] = [r["dgg/dg_pass1"] for r in rows if "dgg/dg_pass1" in r]
    x_of = {
        "pooled": dg,
        "pooled_rising": dg,
        "pooled_later": dg,
        "per_pass_dg": dg,
        "per_pass_g": g,
        "per_pass_ratio": g / g[:, :1],
    }
    out = {}
    for rule in REPLAY_RULES:
        x = x_of[rule]
        pooled = rule.startswith("pooled")
        windows = [[] for _ in range(1 if pooled else x.shape[1])]
        fired = []
        for b in range(x.shape[0]):
            for u in range(x.shape[1]):
                win = windows[0 if pooled else u]
                if u >= m and len(win) >= window:  # pass > 1
                    w = np.asarray(win[-window:])
                    z = (x[b, u] - w.mean()) / (w.std() + eps)
                    if z > tau and (rule != "pooled_rising" or x[b, u] > 0):
                        fired.append(b + 1)
                if np.isfinite(x[b, u]) and (rule != "pooled_later" or u >= m):
                    win.append(x[b, u])
        out[rule] = {
            "fires": len(fired),
            "batches_fired": len(set(fired)),
            "first_fire_batch": fired[0] if fired else None,
        }
    half = g.shape[0] // 2
    ratio = g[:, -1] / g[:, 0]
    out["g_last_over_first"] = {
        "first_half": float(ratio[:half].mean()),
        "second_half": float(ratio[half:].mean()),
    }
    return out


def summarise_arm(
    arm_rows: list[list[dict]],
    base_rows: list[list[dict]],
    *,
    smooth: int,
    tau: float,
    window: int | None = None,
    val_smooth: int = 1,
) -> dict:
    """Figures of one arm over its seeds (`arm_rows[i]` and `base_rows[i]`, the single-use run,
    share seed i): batches to reach the single-use final reward (training reward as a trailing
    mean over `smooth` steps, counted from step `smooth` on; held-out at its evaluation steps),
    final rewards, gate fires and passes applied per batch, and the gate diagnostics. With
    `window`, an arm that ran more than one pass on every batch without a fire (fixed reuse)
    also gets `gate_replay`: `replay_gates` per seed. `val_smooth`: the held-out curve as a
    trailing mean over that many evaluations for the target and the batches to reach it
    (counted from the first evaluation that has them all). With uncertainty (`bootstrap_ratio`
    over seeds paired with single use): `auc_val_vs_single` and `auc_greedy_vs_single` (the
    areas under the held-out sampled / greedy curves, `area`), and `rollouts_single_over_arm`
    (single use's batches to the held-out target over the arm's, seeds where both reach it)."""
    per_seed = []
    for rows, base in zip(arm_rows, base_rows, strict=True):
        c, b = curves(rows), curves(base)
        tr, btr = trailing_mean(c["train_reward"], smooth), trailing_mean(b["train_reward"], smooth)
        target_train = float(btr[-1])
        n_train = batches_to_reach(c["train_step"], tr, target_train, first=smooth)
        cv, bv = (trailing_mean(x["val_reward"], val_smooth) for x in (c, b))
        target_val = float(bv[-1]) if bv.size else None
        first_val = max(1, int(c["val_step"][min(val_smooth, len(cv)) - 1])) if cv.size else 1
        n_val = (
            batches_to_reach(c["val_step"], cv, target_val, first=first_val)
            if target_val is not None
            else None
        )
        base_train = batches_to_reach(b["train_step"], btr, target_train, first=smooth)
        base_val = (
            batches_to_reach(b["val_step"], bv, target_val, first=first_val)
            if target_val is not None
            else None
        )
        learn = [r for r in rows if "dgg/fires" in r]
        final_val = float(c["val_reward"][-1]) if c["val_reward"].size else None
        per_seed.append(
            {
                "target_train": target_train,
                "target_val": target_val,
                "batches_to_target_train": n_train,
                "batches_to_target_val": n_val,
                "single_batches_to_target_train": base_train,
                "single_batches_to_target_val": base_val,
                "final_train_smoothed": float(tr[-1]),
                "final_val": final_val,
                "final_val_smoothed": float(cv[-1]) if cv.size else None,
                "auc_val": area(c["val_step"], c["val_reward"]),
                "single_auc_val": area(b["val_step"], b["val_reward"]),
                "auc_greedy": area(c["val_step"], c["val_greedy"])
                if c["val_greedy"].size
                else None,
                "single_auc_greedy": (
                    area(b["val_step"], b["val_greedy"]) if b["val_greedy"].size else None
                ),
                # The paper's second half: never ending below the single-use run.
                "ends_below_single_train": bool(tr[-1] < target_train - 1e-12),
                "ends_below_single_val": (  # on the same trailing mean as the target
                    bool(cv[-1] < target_val - 1e-12) if target_val is not None else None
                ),
                "start_val": float(c["val_reward"][0]) if c["val_reward"].size else None,
                "fires_per_batch": float(np.mean([r["dgg/fires"] for r in learn])),
                "passes_applied_per_batch": float(
                    np.mean([r["dgg/passes_applied"] for r in learn])
                ),
                "learner_passes": int(sum(r["dgg/passes_run"] for r in learn)),
            }
        )

    def mean(key):
        vals = [s[key] for s in per_seed]
        if any(v is None for v in vals):
            return None
        return float(np.mean(vals))

    def speedup(base_key, key):
        ratios = [s[base_key] / s[key] for s in per_seed if s[key] is not None and s[base_key]]
        return float(np.mean(ratios)) if len(ratios) == len(per_seed) else None

    out = {k: mean(k) for k in per_seed[0] if not k.startswith("ends_below")}
    for key in ("ends_below_single_train", "ends_below_single_val"):
        out[key] = sum(bool(s[key]) for s in per_seed)  # how many seeds
    out["reached_train"] = sum(s["batches_to_target_train"] is not None for s in per_seed)
    out["reached_val"] = sum(s["batches_to_target_val"] is not None for s in per_seed)
    out["speedup_train"] = speedup("single_batches_to_target_train", "batches_to_target_train")
    out["speedup_val"] = speedup("single_batches_to_target_val", "batches_to_target_val")

    def paired(key, base_key, swap=False):
        pairs = [(s[key], s[base_key]) for s in per_seed if s[key] is not None and s[base_key]]
        return bootstrap_ratio([(b, a) for a, b in pairs] if swap else pairs)

    out["auc_val_vs_single"] = paired("auc_val", "single_auc_val")
    out["auc_greedy_vs_single"] = paired("auc_greedy", "single_auc_greedy")
    out["rollouts_single_over_arm"] = paired(
        "batches_to_target_val", "single_batches_to_target_val", swap=True
    )
    out["seeds"] = per_seed
    out["gate"] = gate_diagnostics([r for rows in arm_rows for r in rows], tau)
    learn = [r for rows in arm_rows for r in rows if "dgg/passes_run" in r]
    fixed = learn and all(r["dgg/fires"] == 0 for r in learn)
    if window is not None and fixed and min(r["dgg/passes_run"] for r in learn) > 1:
        out["gate_replay"] = [replay_gates(rows, tau=tau, window=window) for rows in arm_rows]
    return out


def plot_arms(results: dict, out: Path, *, smooth: int) -> Path:
    """One column per regime: the smoothed training reward (top) and the held-out reward,
    sampled and greedy, against rollout batches, mean over seeds with a min-max band when
    seeds > 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = list(results)
    fig, axes = plt.subplots(3, len(regimes), figsize=(6 * len(regimes), 12), squeeze=False)
    for j, regime in enumerate(regimes):
        for arm, seeds in results[regime].items():
            cs = [curves(rows) for rows in seeds]
            for i, (xk, yk, f) in enumerate(
                [
                    ("train_step", "train_reward", lambda y: trailing_mean(y, smooth)),
                    ("val_step", "val_reward", lambda y: y),
                    ("val_step", "val_greedy", lambda y: y),
                ]
            ):
                n = min(len(c[yk]) for c in cs)
                if n == 0:
                    continue
                ys = np.stack([f(c[yk])[:n] for c in cs])
                x = cs[0][xk][:n]
                ax = axes[i, j]
                (line,) = ax.plot(x, ys.mean(0), label=arm, lw=1.5)
                if len(cs) > 1:
                    ax.fill_between(x, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
        axes[0, j].set_title(f"{regime}: training reward (trailing mean of {smooth})")
        axes[1, j].set_title(f"{regime}: held-out reward (sampled, T=1)")
        axes[2, j].set_title(f"{regime}: held-out reward (greedy)")
        for ax in axes[:, j]:
            ax.set_xlabel("rollout batches")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
