"""The `sparserl` command (also `python -m sparserl_jax`).

sparserl train CONFIG.yaml [dotted.key=value ...]      RL post-training (see sparserl_jax.train)
sparserl generate CONFIG.yaml [dotted.key=value ...]   generate with a model (sparserl_jax.generate)
"""

from __future__ import annotations

import argparse
import json
import sys

from sparserl_jax.config import ConfigError, load_config, to_dict
from sparserl_jax.generate import run_generate
from sparserl_jax.train import train

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparserl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="RL post-training: rollouts, rewards, learner, sync")
    gen = sub.add_parser("generate", help="generate text with a model from a config")
    for p in (tr, gen):
        p.add_argument("config", help="YAML preset, e.g. configs/demo.yaml")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"sparserl: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "train":
        summary = train(cfg, log_fn=lambda msg: print(msg, file=sys.stderr))
    else:
        summary = run_generate(cfg)
        summary["config"] = to_dict(cfg)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
