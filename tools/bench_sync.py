"""PULSESync benchmark: AdamW on a random ~32M-parameter transformer, one sync per step.

    python tools/bench_sync.py --lr 1e-6 --steps 10 --json

Prints one line per step to stderr (bytes per changed element, the entropy bound given the
receiver's context, timings, and the XLA executables built by the publish and by each receiver's
apply: `compiles_*`) and, with --json, one JSON line last on
stdout (see `benchmarks.sync.run`).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.sync import PRESETS, BenchConfig, run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (one sync each)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="model size")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--anchor-every", type=int, default=10)
    p.add_argument("--zstd-level", type=int, default=1)
    p.add_argument(
        "--cut-slack", type=float, default=BenchConfig.cut_slack,
        help="format 3: keep a leaf's cuts while within this of the bound (0: best every version)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    a = p.parse_args(argv)
    cfg = BenchConfig(
        lr=a.lr, steps=a.steps, preset=a.preset, batch=a.batch, seq_len=a.seq_len,
        anchor_every=a.anchor_every, zstd_level=a.zstd_level, cut_slack=a.cut_slack, seed=a.seed,
    )  # fmt: skip
    result = run(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if a.json:
        print(json.dumps(result), flush=True)
    else:
        keys = (
            "params", "lr", "ratio_median", "bytes_per_changed_median",
            "bound_per_changed_median", "encode_gb_per_cpu_s", "encode_with_anchors_gb_per_s",
            "apply_gb_per_s", "apply_touched_gb_per_s", "apply_before_gb_per_s",
            "last_compiling_step", "all_bit_identical",
        )  # fmt: skip
        print({k: result[k] for k in keys})


if __name__ == "__main__":
    main()
