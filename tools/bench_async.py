"""Synchronous vs decoupled training: steps/s, trainer idle fraction and the final reward.

    python tools/bench_async.py                      # the demo config, 16 RL steps per variant
    python tools/bench_async.py --config configs/tiny.yaml --steps 12

Runs `sparserl train` once and `sparserl launch --samplers N` for N in --samplers and each
`async.max_staleness` in --staleness (`benchmarks.async_runs`), every job a subprocess with one
CPU device. The config's SFT warm start runs once; every variant starts from its checkpoint.
Prints one JSON object per variant, then a last line {"results": [...]}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.async_runs import run_variant, warm_start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2, help="steps left out (compiles)")
    p.add_argument("--samplers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every variant")
    a = p.parse_args()
    overrides = [
        f"train.steps={a.steps}",
        f"train.save_every={a.steps}",
        "train.eval_examples=0",
        "train.plot=false",  # (`sparserl train` cannot plot held-out curves it did not measure)
        "train.progress=false",
        "exchange.poll_s=0.02",
        *a.overrides,
    ]
    variants = [(0, 0)] + [(n, s) for n in a.samplers for s in a.staleness]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = warm_start(a.config, overrides, Path(tmp) / "warm")
        for n, s in variants:
            r = run_variant(
                a.config, overrides, samplers=n, staleness=s, warmup=a.warmup, checkpoints=ckpts
            )
            print(json.dumps(r), flush=True)
            results.append(r)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
