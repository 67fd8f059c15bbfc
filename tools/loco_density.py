"""Where PULSELoCo's gate fires: per round and per parameter leaf, on the bench_loco set-up.

    python tools/loco_density.py --rounds 4 --json

Runs `rounds` PULSELoCo rounds of `tools/bench_loco.py`'s default task (same pretraining, data
and settings) and, for each round, recomputes the gate from the trainer's own θ, replica weights
and residuals: the fraction of entries that fire, the median per-round |Δ| and, for the first and
last round, the same per leaf with the leaf's median |w| (`benchmarks.loco_density`). One JSON
line last with --json.
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
    # One fake CPU device per replica; must be set before JAX starts its backend.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from benchmarks.loco import LoCoBenchConfig
    from benchmarks.loco_density import gate_densities

    cfg = LoCoBenchConfig(rounds=a.rounds, task=a.task)
    out = gate_densities(cfg, log=print)
    if a.json:
        print(json.dumps({"rounds": out, "config": {"task": cfg.task, "rounds": cfg.rounds}}))


if __name__ == "__main__":
    main()
