"""Reproduce DGG's sample-efficiency claim: rollout batches to reach the single-use reward.

    python tools/repro_dgg.py --quick                       # CI smoke: tiny config, 3 steps
    python tools/repro_dgg.py --steps 24 --seeds 0 --lrs 1e-4 5e-4 --out runs/repro_dgg

Arms (`benchmarks.repro_dgg.ARMS`): single use (K=1), fixed reuse K=2 / 4 / 8, DGG K=4 / K=8
(tau 0.3) with increments across batches, and the same with increments only within a batch.
Each learning rate in --lrs is a regime (all arms at that lr; a high one is where fixed reuse
hurts). Rollouts are dense (`rollout.kv.policy=none`), so reuse is the only difference. One SFT
warm start is shared by every arm. Prints one JSON object per arm, then one last line with all
of them; writes curves.png (seed bands when --seeds has more than one) under --out.
Several optimiser steps per pass: add `learner.num_mini_batches=N` to the overrides.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from benchmarks.async_runs import warm_start
from benchmarks.repro_dgg import ARMS, plot_arms, run_arm, summarise_arm

QUICK_ARMS = ["single", "dgg4"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=24, help="rollout batches per arm")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed and data.seed")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 5e-4], help="one regime each")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-examples", type=int, default=32)
    p.add_argument("--smooth", type=int, default=4, help="trailing mean of the training reward")
    p.add_argument(
        "--val-smooth",
        type=int,
        default=1,
        help="trailing mean over this many held-out evaluations for the target and the batches "
        "to reach it (use with --eval-every 1)",
    )
    p.add_argument("--tau", type=float, default=0.3)
    p.add_argument("--out", default="runs/repro_dgg")
    p.add_argument(
        "--warm-checkpoints",
        help="a run's checkpoints dir whose step 0 is the SFT start to share (default: run the "
        "config's SFT warm start once)",
    )
    p.add_argument(
        "--analyse-only",
        action="store_true",
        help="run nothing: re-read the arms' metrics under --out (same flags as the run)",
    )
    p.add_argument(
        "--keep-finished",
        action="store_true",
        help="keep runs under --out that finished with the same overrides (run only the rest)",
    )
    p.add_argument("--quick", action="store_true", help="tiny config, 3 steps, 2 arms")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every arm")
    a = p.parse_args()
    if a.quick:
        a.config, a.steps, a.arms, a.lrs, a.seeds = "configs/tiny.yaml", 3, QUICK_ARMS, [1e-3], [0]
        a.eval_every, a.eval_examples, a.smooth = 1, 4, 1
    if "single" not in a.arms:
        raise SystemExit("--arms must include single (the baseline every arm is compared with)")
    out = Path(a.out)
    common = [
        "rollout.kv.policy=none",
        f"learner.gating.tau={a.tau}",
        f"train.steps={a.steps}",
        f"train.save_every={a.steps}",
        f"train.eval_every={a.eval_every}",
        f"train.eval_examples={a.eval_examples}",
        "train.plot=false",
        "train.progress=false",
        *a.overrides,
    ]
    if a.analyse_only:
        ckpts = out / "warm" / "checkpoints"
    elif a.warm_checkpoints:  # step 0 only: a later checkpoint would be resumed instead
        ckpts = out / "warm" / "checkpoints"
        shutil.rmtree(ckpts, ignore_errors=True)
        shutil.copytree(Path(a.warm_checkpoints) / "0", ckpts / "0")
    else:
        ckpts = warm_start(a.config, [*common, "train.eval_examples=0"], out / "warm")
    results: dict[str, dict[str, list]] = {}
    summary = []
    for lr in a.lrs:
        regime = f"lr={lr:g}"
        results[regime] = {}
        for arm in ["single", *[x for x in a.arms if x != "single"]]:
            results[regime][arm] = []
            walls = []
            for seed in a.seeds:
                run = run_arm(
                    a.config,
                    [
                        *common,
                        f"learner.optimizer.learning_rate={lr}",
                        *ARMS[arm],
                        f"train.seed={seed}",
                        f"data.seed={seed}",
                    ],
                    out / regime / f"{arm}_s{seed}",
                    ckpts,
                    rerun=not a.analyse_only,
                    keep_finished=a.keep_finished,
                )
                results[regime][arm].append(run["rows"])
                walls.append(run["wall_s"])
            fig = summarise_arm(
                results[regime][arm],
                results[regime]["single"],
                smooth=a.smooth,
                tau=a.tau,
                window=run["config"]["learner"]["gating"]["window"],
                val_smooth=a.val_smooth,
            )
            row = {"regime": regime, "arm": arm, "wall_s": round(sum(walls), 1), **fig}
            print(json.dumps({k: v for k, v in row.items() if k != "seeds"}), flush=True)
            summary.append(row)
    png = plot_arms(results, out / "curves.png", smooth=a.smooth)
    print(
        json.dumps(
            {
                "config": a.config,
                "steps": a.steps,
                "seeds": a.seeds,
                "plot": str(png),
                "arms": summary,
            }
        )
    )


if __name__ == "__main__":
    main()
