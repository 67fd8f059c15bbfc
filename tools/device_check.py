"""Check and time every accelerator path on the machine at hand, within a time budget.

    python tools/device_check.py --out runs/device-check            # a GPU or TPU machine
    python tools/device_check.py --smoke --out /tmp/dc              # tiny shapes, any machine
    python tools/device_check.py --only kernels engine --total-s 300

Runs each task (env + HBM bandwidth, the three kernels vs XLA, learner attention, the learner
step at T = 4096 / 16384, a PULSESync format-3 apply, the rollout engine dense vs R-KV through
XLA and through the kernels, the engine's sampler-vs-teacher-forced contract on both paths) in its
own process with its own time budget; the whole run stops starting tasks when `--total-s` is
spent (`benchmarks.device_check`). Writes `OUT/device_check.json` and `OUT/device_check.md` and
prints the summary. Exit status 0 when every task that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.device_check import orchestrate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/device-check"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU test)")
    p.add_argument("--total-s", type=float, default=560.0, help="budget of the whole run")
    p.add_argument("--only", nargs="*", help="tasks or task families (engine, learner, ...)")
    p.add_argument("--task-s", type=float, help="every task's budget (default: each its own)")
    args = p.parse_args()
    report = orchestrate(
        args.out, smoke=args.smoke, total_s=args.total_s, only=args.only, task_s=args.task_s
    )
    print((args.out / "device_check.md").read_text())
    ran = [r for r in report["tasks"].values() if not r["status"].startswith("skipped")]
    sys.exit(0 if ran and all(r["status"] == "ok" for r in ran) else 1)


if __name__ == "__main__":
    main()
