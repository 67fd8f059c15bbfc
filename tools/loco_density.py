"""Where PULSELoCo's gate fires: per round and per parameter leaf, on the bench_loco set-up.

    python tools/loco_density.py --rounds 4 --json

Runs `rounds` PULSELoCo rounds of `tools/bench_loco.py`'s default task (same pretraining, data
and settings) and, for each round, recomputes the gate from the trainer's own θ, replica weights
and residuals: the fraction of entries that fire, the median per-round |Δ| and, for the first and
last round, the same per leaf with the leaf's median |w|. One JSON line last with --json.
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--task", default="rl", choices=("rl", "shift"))
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    a = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import ml_dtypes
    import numpy as np

    from sparserl_jax.sync import loco
    from sparserl_jax.sync.loco_bench import (
        PRESETS,
        LoCoBenchConfig,
        _adamw,
        _at,
        build_model,
        chain,
        grpo_loss,
        next_token_loss,
        pretrain,
        rl_problem,
        shift_problem,
    )  # fmt: skip
    from sparserl_jax.sync.loco_runtime import LoCoTrainer, replica_mesh

    cfg = LoCoBenchConfig(rounds=a.rounds, task=a.task)
    graphdef, params = build_model(cfg.preset, cfg.seed, cfg.dtype)
    base = chain(PRESETS[cfg.preset][0], cfg.seed + 1)
    params = pretrain(next_token_loss(graphdef), params, base, cfg)
    if cfg.task == "rl":
        loss_fn = grpo_loss(graphdef, cfg.clip_eps)
        data, _ = rl_problem(graphdef, params, base, cfg)
    else:
        loss_fn = next_token_loss(graphdef)
        data, _ = shift_problem(loss_fn, base, cfg)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    bounds = np.cumsum([0] + [x.size for _, x in leaves])
    mesh = replica_mesh(cfg.replicas, jax.devices()[: cfg.replicas])
    lcfg = loco.LoCoConfig(inner_steps=cfg.inner_steps, pad_multiple=cfg.pad_multiple)
    trainer = LoCoTrainer(loss_fn, params, _adamw(cfg.lr, cfg.weight_decay), lcfg, mesh=mesh)

    def bits(x):
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)

    out = []
    for k in range(cfg.rounds):
        theta = trainer.global_params_flat().copy()
        residual = np.asarray(trainer.residual).copy()
        stats = trainer.round({r: _at(data, k, slice(None), r) for r in trainer.local})
        delta = theta[None] - np.asarray(trainer.last_local)
        fired = bits(theta)[None] != bits(theta[None] - (residual + delta))
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
        print(f"round {k + 1}: density {row['density']:.4f}, median |Δ| "
              f"{row['delta_abs_median']:.2e}")  # fmt: skip
    if a.json:
        print(json.dumps({"rounds": out, "config": {"task": cfg.task, "rounds": cfg.rounds}}))


if __name__ == "__main__":
    main()
