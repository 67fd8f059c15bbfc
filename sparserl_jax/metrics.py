"""Run metrics: one JSON line per step in `<run_dir>/metrics.jsonl`, TensorBoard when asked.

Keys follow verl's names where verl has one (`critic/score/mean`, `response_length/mean`,
`actor/entropy`, `actor/pg_loss`, `actor/ppo_kl`, `actor/grad_norm`, `timing_s/step`, ...), so runs
can be compared with verl's dashboards. Our own signals live under `correction/` (the Sparse-RL
rejection and reweighting), `dgg/` (Dynamic Gradient Gating), `sync/` (PULSESync), `rollout/`
(evicted tokens, KV bytes, weight version), `perf/` and `val/` (held-out evaluation).
`step_metrics` assembles one RL step's row.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sparserl_jax.storage import JsonlFile, run_path


def _scalar(value: Any) -> float | int | str | bool | None:
    if isinstance(value, (str, bool)) or value is None:
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"metric values must be scalars, got shape {arr.shape}")
    v = arr.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible rather than dropping the row
    return v


def jsonable_row(metrics: Mapping[str, Any]) -> dict:
    """`metrics` as the JSON scalars a row holds (non-finite floats as strings)."""
    return {k: _scalar(v) for k, v in metrics.items()}


class MetricsWriter:
    """Append-only JSONL metrics (and optional TensorBoard event files). `run_dir` may be a URL
    (`storage.JsonlFile`: rows are stored at each `flush`, which `write` does)."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = False):
        root = run_path(run_dir)
        self.file = JsonlFile(root / "metrics.jsonl")
        self.path = self.file.path
        if isinstance(root, Path):  # there from the start, for anyone tailing it
            root.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        self._start = time.time()
        self._tb = None
        if tensorboard:
            if not isinstance(root, Path):
                raise ValueError(
                    f"train.tensorboard needs a local run_dir, not {run_dir}: set it false "
                    "(metrics.jsonl holds every value)"
                )
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "tensorboard=True needs the tensorboardX package: pip install tensorboardX"
                ) from e
            self._tb = SummaryWriter(str(root / "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Record one step; `step` and `wall_time_s` are added. Returns the row written."""
        row = {"step": int(step), "wall_time_s": round(time.time() - self._start, 3)}
        row.update(jsonable_row(metrics))
        self.file.append([row])
        self.file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(k, v, global_step=int(step))
        return row

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_metrics(run_dir: str | Path, step: int) -> list[dict]:
    """Make `<run_dir>/metrics.jsonl` read as if the run had stopped right after `step`: rows
    with a larger step and a torn last line (a run killed mid-write) are dropped; the file is
    replaced atomically, so a crash here leaves the old or the new file. Returns the rows kept.
    A missing file is left missing."""
    file = JsonlFile(run_path(run_dir) / "metrics.jsonl")
    kept = [row for row in file.rows() if int(row.get("step", 0)) <= step]
    file.replace(kept)
    return kept


def evaluation_on_record(kept: list[dict], step: int) -> tuple[int, dict[str, float], bool]:
    """The held-out evaluation a run resumed at `step` takes as its "before" instead of decoding
    the held-out set again, from its kept rows: `step`'s own or, when `step`'s row is written
    (resumed between evaluations), the newest earlier one. Returns its step, its `val/*`
    figures (`step, {}`: none, or `step`'s row is missing and must be completed by an
    evaluation), and whether `step`'s row is written."""
    written = any(r.get("step") == step for r in kept)
    on_record = [r["step"] for r in kept if "val/greedy_reward_mean" in r]
    if not on_record or (on_record[-1] != step and not written):
        return step, {}, written
    at = on_record[-1]
    rows = [r for r in kept if r.get("step") == at]
    return at, {k: v for r in rows for k, v in r.items() if k.startswith("val/")}, written


def learner_metrics(history: list[Mapping[str, Any]]) -> dict[str, float | int]:
    """verl-named learner metrics of one batch from its per-pass metrics (`Learner.train_on_batch`):
    means over the passes that ran; DGG's energy of the last pass, its largest z, and each
    pass's increment and z (`dgg/dg_pass{k}`, `dgg/z_pass{k}`)."""
    first = history[0]

    def mean(key):
        return float(np.mean([np.asarray(h[key], np.float64) for h in history]))

    out = {
        "actor/pg_loss": mean("pg_loss"),
        "actor/loss": mean("loss"),
        "actor/entropy": mean("entropy"),
        "actor/kl_loss": mean("kl"),
        "actor/ppo_kl": mean("approx_kl"),
        "actor/pg_clipfrac": mean("clip_fraction"),
        "actor/grad_norm": mean("grad_norm"),
        "actor/lr": float(first["lr"]),
        "dgg/g": float(history[-1]["dgg/g"]),
        "dgg/z": float(np.max([h["dgg/z"] for h in history])),
        "dgg/fires": int(sum(bool(h["dgg/fire"]) for h in history)),
        "dgg/passes_run": int(first["passes_run"]),
        "dgg/passes_applied": np.asarray(first["passes_applied"]).item(),
        "actor/nonfinite_skips": int(sum(bool(h["nonfinite"]) for h in history)),
        "dgg/armed_passes": int(sum(bool(h["dgg/armed"]) for h in history)),
    }
    # Per pass (1-based): the gate's increment and z, to see where it would fire; `dgg/z` above
    # is the largest z over all passes, pass 1 included, where the gate is never armed. With
    # several mini-batches a pass is several updates: their mean increment and energy, their
    # largest z.
    for k in sorted({int(h["pass_index"]) for h in history}):
        updates = [h for h in history if int(h["pass_index"]) == k]
        out[f"dgg/dg_pass{k}"] = float(np.mean([h["dgg/dg"] for h in updates]))
        out[f"dgg/z_pass{k}"] = float(np.max([h["dgg/z"] for h in updates]))
        out[f"dgg/g_pass{k}"] = float(np.mean([h["dgg/g"] for h in updates]))
    out["actor/updates"] = len(history)
    if any(int(h.get("mini_batch", 0)) for h in history):  # every step's energy, in order
        out.update({f"dgg/g_update{i}": float(h["dgg/g"]) for i, h in enumerate(history, 1)})
    # The correction depends on pi_old and mu only: the same on every pass.
    out.update({k: float(v) for k, v in first.items() if k.startswith("correction/")})
    return out


def step_metrics(
    *,
    rewards: np.ndarray,
    advantages: np.ndarray,
    rollout,
    max_new_tokens: int,
    history: list[Mapping[str, Any]],
    published,
    sync_events: list,
    timings: Mapping[str, float],
) -> dict[str, Any]:
    """One RL step's row: rewards and lengths (`rollout`: a `RolloutResult`), the learner's
    passes, the PULSESync publication (`published`: a `Published`) and its apply events on the
    sampler, and the `timing_s/` of each phase."""
    lengths = rollout.completion_lens
    formats = [e.format for e in sync_events if e.format is not None]
    return {
        "critic/score/mean": float(rewards.mean()),
        "critic/score/std": float(rewards.std()),
        "critic/advantages/mean": float(advantages.mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": int(lengths.max()),
        "response_length/clip_ratio": float(np.mean(lengths >= max_new_tokens)),
        **learner_metrics(history),
        "rollout/tokens_evicted": int(rollout.tokens_evicted.sum()),
        "rollout/kv_peak_bytes": int(rollout.stats.get("kv_peak_bytes", 0)),
        "rollout/kv_peak_tokens": int(rollout.stats.get("kv_peak_tokens", 0)),
        "rollout/weight_version": int(rollout.weight_version.max()),
        "sync/version": int(published.version),
        "sync/changed": int(published.total_changed),
        "sync/changed_fraction": published.total_changed / max(published.numel, 1),
        "sync/payload_bytes": published.payload_bytes,
        "sync/dense_bf16_bytes": int(published.dense_bytes),
        "sync/verified": all(e.error is None for e in sync_events) and bool(sync_events),
        # The wire format of the blobs the sampler accepted this step (in-process sampler only).
        **({"sync/format": max(formats)} if formats else {}),
        "perf/rollout_tokens_per_s": float(rollout.stats.get("tokens_per_s", 0.0)),
        **{f"timing_s/{k}": float(v) for k, v in timings.items()},
    }


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a metrics.jsonl (a run directory or the file itself); a torn last line from a
    killed run is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    rows = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def plot_metrics(
    path: str | Path, out: str | Path, keys: list[str] | None = None, *, skip_missing=False
) -> Path:
    """One PNG with a panel per metric (numeric keys; all of them when `keys` is None). A key
    no row has is an error, or left out with `skip_missing` (a run without held-out metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{path}: no metrics rows")
    numeric: list[str] = []  # keys with a number in any row, in order of first appearance
    for row in rows:
        for k, v in row.items():
            is_number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if is_number and k not in ("step", "wall_time_s") and k not in numeric:
                numeric.append(k)
    keys = keys or numeric
    if skip_missing:
        keys = [k for k in keys if k in numeric] or numeric
    missing = [k for k in keys if k not in numeric]
    if missing:
        raise KeyError(f"no numeric metric named {missing}; available: {numeric}")
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def record_evaluation(summary: dict, val: Mapping[str, float], step: int, when: str, log_fn):
    """Keep a "before" or "after" held-out evaluation in `summary` (`val_reward_{when}`, ...)
    and log it in one line; `val` empty (no held-out set): nothing."""
    if not val:
        return
    sampled = ""
    if "val/reward_mean" in val:  # absent with `train.eval_sampled: false`
        summary[f"val_reward_{when}"] = val["val/reward_mean"]
        sampled = f"{val['val/reward_mean']:.3f} (sampled), "
    summary[f"val_greedy_reward_{when}"] = val["val/greedy_reward_mean"]
    log_fn(f"step {step}: held-out reward {sampled}{val['val/greedy_reward_mean']:.3f} (greedy)")


def summarise_rewards(
    summary: dict, rewards_seen: list[float], temperature, start: int, end: int, log_fn
) -> None:
    """Add the run's first- and last-fifth training rewards to `summary` and log them with the
    held-out rewards before and after (`val_reward_before|after` in `summary`)."""
    if rewards_seen:
        k = max(1, len(rewards_seen) // 5)
        summary["train_reward_first"] = float(np.mean(rewards_seen[:k]))
        summary["train_reward_last"] = float(np.mean(rewards_seen[-k:]))
    if "val_greedy_reward_before" in summary and "val_greedy_reward_after" in summary:
        sampled = ""
        if "val_reward_before" in summary and "val_reward_after" in summary:
            sampled = (
                f"(sampled at T={temperature}) {summary['val_reward_before']:.3f} -> "
                f"{summary['val_reward_after']:.3f}, "
            )
        log_fn(
            f"summary: held-out reward {sampled}greedy "
            f"{summary['val_greedy_reward_before']:.3f} -> "
            f"{summary['val_greedy_reward_after']:.3f}, over steps {start}..{end}"
        )
    if rewards_seen:
        log_fn(
            f"summary: sampled (training) reward {summary['train_reward_first']:.3f} in the "
            f"first fifth of the steps -> {summary['train_reward_last']:.3f} in the last fifth"
        )
