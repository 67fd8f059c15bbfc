"""The `sparserl` command (also `python -m sparserl_jax`).

sparserl train CONFIG.yaml [dotted.key=value ...]      RL post-training (see sparserl_jax.train)
sparserl generate CONFIG.yaml [dotted.key=value ...]   generate with a model (sparserl_jax.generate)

Errors print as one line, `sparserl: error: <message>`: exit status 2 for a bad config or usage
(found before any training starts), 1 for a failure while running. `--debug` re-raises them
with the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from sparserl_jax.checkpoint import CheckpointMismatchError
from sparserl_jax.config import ConfigError, load_config, to_dict
from sparserl_jax.generate import run_generate
from sparserl_jax.train import check_config, train

__all__ = ["main"]

# Errors whose message already says what to change; raised before any work is done they are
# the user's to fix (exit 2), not crashes.
USAGE_ERRORS = (ConfigError, ValueError, FileNotFoundError, IsADirectoryError, yaml.YAMLError)


def _error(e: BaseException) -> str:
    message = " ".join(str(e).split()) or type(e).__name__
    return f"sparserl: error: {message}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparserl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="RL post-training: rollouts, rewards, learner, sync")
    gen = sub.add_parser("generate", help="generate text with a model from a config")
    debug_help = "re-raise errors with the traceback instead of a one-line message"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    for p in (tr, gen):
        p.add_argument("config", help="YAML preset, e.g. configs/demo.yaml")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "train":
            check_config(cfg)
    except USAGE_ERRORS as e:
        if args.debug:
            raise
        print(_error(e), file=sys.stderr)
        return 2
    try:
        if args.command == "train":
            summary = train(cfg, log_fn=lambda msg: print(msg, file=sys.stderr))
        else:
            summary = run_generate(cfg)
            summary["config"] = to_dict(cfg)
    except CheckpointMismatchError as e:  # the config does not match the run directory
        if args.debug:
            raise
        print(_error(e), file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            raise
        print(_error(e) + " (run with --debug for the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops the run at a safe point)
        print(
            "sparserl: interrupted at once; the next run resumes from the newest checkpoint",
            file=sys.stderr,
        )
        return 130
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
