"""Where PULSELoCo's gate fires: per round and per parameter leaf, on the `benchmarks.loco` set-up.

Runs `rounds` PULSELoCo rounds of the benchmark's task (same pretraining, data and settings) and,
for each round, recomputes the gate from the trainer's own θ, replica weights and residuals: the
fraction of entries that fire, the median per-round |Δ| and, for the first and last round, the
same per leaf with the leaf's median |w|.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

from benchmarks.loco import LoCoBenchConfig, adamw, at, prepare
from sparserl_jax.sync import loco
from sparserl_jax.sync.loco_runtime import LoCoTrainer, replica_mesh


def _bits(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def gate_densities(cfg: LoCoBenchConfig, log=None) -> list[dict]:
    """One row per round: `density`, `delta_abs_median` and, first and last, per-leaf `leaves`."""
    loss_fn, params, data, _ = prepare(cfg)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    bounds = np.cumsum([0] + [x.size for _, x in leaves])
    mesh = replica_mesh(cfg.replicas, jax.devices()[: cfg.replicas])
    lcfg = loco.LoCoConfig(
        inner_steps=cfg.inner_steps, pad_multiple=cfg.pad_multiple,
        value_dtype=cfg.value_dtype, payload=cfg.payload,
    )  # fmt: skip
    trainer = LoCoTrainer(loss_fn, params, adamw(cfg.lr, cfg.weight_decay), lcfg, mesh=mesh)

    out = []
    for k in range(cfg.rounds):
        theta = trainer.global_params_flat().copy()
        residual = np.asarray(trainer.residual).copy()
        stats = trainer.round({r: at(data, k, slice(None), r) for r in trainer.local})
        delta = theta[None] - np.asarray(trainer.last_local)
        s = residual + delta
        fired = _bits(theta)[None] != _bits(theta[None] - s)
        if cfg.value_dtype == "bfloat16":  # entries too tiny to split exactly are held back
            fired &= (np.abs(s) >= loco.BF16_SPLIT_MIN) | (s.view(np.uint32) & 0xFFFF == 0)
        assert tuple(int(n) for n in fired.sum(axis=1)) == stats.counts  # the trainer's own gate
        row = {"round": k + 1, "density": float(fired.mean()),
               "delta_abs_median": float(np.median(np.abs(delta)))}  # fmt: skip
        if k in (0, cfg.rounds - 1):
            row["leaves"] = {
                n: {
                    "size": int(hi - lo),
                    "density": float(fired[:, lo:hi].mean()),
                    "w_abs_median": float(np.median(np.abs(theta[lo:hi]))),
                }  # fmt: skip
                for n, lo, hi in zip(names, bounds[:-1], bounds[1:], strict=True)
            }
        out.append(row)
        if log is not None:
            log(f"round {k + 1}: density {row['density']:.4f}, median |Δ| "
                f"{row['delta_abs_median']:.2e}")  # fmt: skip
    return out
