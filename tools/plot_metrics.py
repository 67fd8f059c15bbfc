"""Plot a run's metrics.jsonl as PNG curves.

python tools/plot_metrics.py runs/demo [--out runs/demo/metrics.png] [--keys critic/score/mean ...]
"""

import argparse
import json

from sparserl_jax.metrics import plot_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory or metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default: <run>/metrics.png)")
    parser.add_argument("--keys", nargs="*", default=None, help="metrics to plot (default: all)")
    args = parser.parse_args()
    out = args.out or (args.run.rstrip("/").removesuffix("metrics.jsonl") + "/metrics.png")
    path = plot_metrics(args.run, out, args.keys)
    print(json.dumps({"png": str(path)}))


if __name__ == "__main__":
    main()
