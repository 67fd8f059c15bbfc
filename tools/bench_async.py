"""Synchronous vs decoupled training: steps/s, trainer idle fraction and the final reward.

    python tools/bench_async.py                      # the demo config, 12 RL steps per variant
    python tools/bench_async.py --config configs/tiny.yaml --steps 12 --samplers 1 2

Runs `sparserl train` once and `sparserl launch --samplers N` for N in --samplers, each
`async.max_staleness` in --staleness and, above 0, with and without partial rollouts
(`benchmarks.async_runs`), every job a subprocess with one CPU device; the trainer pinned to
the first half of the CPUs, the samplers (all of them) to the rest, `sparserl train` on all
(--no-pin: no pinning). The config's SFT warm start runs once; every variant starts from its
checkpoint. Every variant runs with ROLLOUT_HEAVY (then the command line's overrides). Prints
one JSON object per variant, then a last line {"results": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from benchmarks.async_runs import run_variant, warm_start

# The demo with a rollout that is most of a step (so overlapping it with learning matters): one
# update per batch (no reuse passes) and 2 slots for its 128 sequences, decoded in waves.
ROLLOUT_HEAVY = ["learner.gating.max_passes=1", "rollout.num_slots=2"]


def _halves() -> tuple[str | None, str | None]:
    """The trainer on the first half of this process's CPUs, the samplers on the rest (None,
    None with one CPU)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps left out (compiles)")
    p.add_argument("--samplers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--partial", choices=["both", "on", "off"], default="both",
        help="async.partial_rollouts for staleness > 0 (it has no effect at 0)",
    )  # fmt: skip
    p.add_argument("--no-pin", action="store_true", help="let every job use every CPU")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every variant")
    a = p.parse_args()
    overrides = [
        *ROLLOUT_HEAVY,
        f"train.steps={a.steps}",
        f"train.save_every={a.steps}",
        "train.eval_examples=0",
        "train.plot=false",  # (`sparserl train` cannot plot held-out curves it did not measure)
        "train.progress=false",
        "exchange.poll_s=0.02",
        *a.overrides,
    ]
    trainer_cpus, sampler_cpus = (None, None) if a.no_pin else _halves()
    partial = {"both": [True, False], "on": [True], "off": [False]}[a.partial]
    variants = [(0, 0, True)] + [
        (n, s, pr) for n in a.samplers for s in a.staleness for pr in (partial if s else [True])
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = warm_start(a.config, overrides, Path(tmp) / "warm")
        for n, s, pr in variants:
            r = run_variant(
                a.config,
                overrides,
                samplers=n,
                staleness=s,
                warmup=a.warmup,
                checkpoints=ckpts,
                partial=pr,
                trainer_cpus=trainer_cpus,
                sampler_cpus=sampler_cpus,
            )
            print(json.dumps(r), flush=True)
            results.append(r)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
