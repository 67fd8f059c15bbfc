"""Run metrics: one JSON line per step in `<run_dir>/metrics.jsonl`, TensorBoard when asked.

Keys follow verl's names where verl has one (`critic/score/mean`, `response_length/mean`,
`actor/entropy`, `actor/pg_loss`, `actor/ppo_kl`, `actor/grad_norm`, `timing_s/step`, ...), so runs
can be compared with verl's dashboards; our own signals live under `sparse_rl/`, `dgg/`, `sync/`
and `kv/`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


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


class MetricsWriter:
    """Append-only JSONL metrics (and optional TensorBoard event files)."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._start = time.time()
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "tensorboard=True needs the tensorboardX package: pip install tensorboardX"
                ) from e
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Record one step; `step` and `wall_time_s` are added. Returns the row written."""
        row = {"step": int(step), "wall_time_s": round(time.time() - self._start, 3)}
        row.update({k: _scalar(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(k, v, global_step=int(step))
        return row

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def plot_metrics(path: str | Path, out: str | Path, keys: list[str] | None = None) -> Path:
    """One PNG with a panel per metric (numeric keys; all of them when `keys` is None)."""
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
