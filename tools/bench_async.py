"""Synchronous vs decoupled training: steps/s, trainer idle fraction and the final reward.

    python tools/bench_async.py                          # tiny config, 12 steps per variant
    python tools/bench_async.py --config configs/demo.yaml --steps 40 --warmup 4 sft.steps=300

Runs `sparserl train` once and `sparserl launch --samplers N` for N in --samplers and each
`async.max_staleness` in --staleness (`benchmarks.async_runs`), every job a subprocess with one
CPU device. Prints one JSON object per variant, then a last line {"results": [...]}.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.async_runs import run_variant


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps left out (compiles)")
    p.add_argument("--samplers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every variant")
    a = p.parse_args()
    overrides = [
        f"train.steps={a.steps}",
        f"train.save_every={a.steps}",
        "train.eval_examples=0",
        "exchange.poll_s=0.02",
        *a.overrides,
    ]
    variants = [(0, 0)] + [(n, s) for n in a.samplers for s in a.staleness]
    results = []
    for n, s in variants:
        r = run_variant(a.config, overrides, samplers=n, staleness=s, warmup=a.warmup)
        print(json.dumps(r), flush=True)
        results.append(r)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
