"""The `sparserl` command (also `python -m sparserl_jax`).

sparserl train CONFIG.yaml [dotted.key=value ...]      RL post-training (see sparserl_jax.train)
sparserl generate CONFIG.yaml [dotted.key=value ...]   generate with a model (sparserl_jax.generate)
sparserl trainer CONFIG.yaml [k=v ...]                 the decoupled trainer job (docs/decoupled.md)
    [--coordinator HOST:PORT --num-processes P --process-id I]   one of P trainer processes
sparserl sampler CONFIG.yaml --id I [k=v ...]          a decoupled sampler job
sparserl launch CONFIG.yaml --samplers N [k=v ...]     the trainer and N samplers, locally

Errors print as one line, `sparserl: error: <message>`: exit status 2 for a bad config or usage
(found before any training starts), 1 for a failure while running, 5 for a decoupled trainer
that a newer one superseded on its exchange. `--debug` re-raises them with the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from sparserl_jax.checkpoint import CheckpointMismatchError
from sparserl_jax.config import ConfigError, load_config, to_dict
from sparserl_jax.decoupled.config import check_partial_cache, refuse_adaptive_kv
from sparserl_jax.decoupled.exchange import SupersededError
from sparserl_jax.decoupled.launch import launch, parse_cpus
from sparserl_jax.decoupled.processes import init_processes
from sparserl_jax.decoupled.sampler_job import run_sampler
from sparserl_jax.decoupled.trainer import exchange_url, run_trainer
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
    job = sub.add_parser("trainer", help="decoupled trainer job: learner, data, checkpoints")
    job.add_argument("--coordinator", help="HOST:PORT of trainer process 0 (jax.distributed)")
    job.add_argument("--num-processes", type=int, help="trainer processes (with --coordinator)")
    job.add_argument("--process-id", type=int, help="this trainer process's index, 0 = leader")
    smp = sub.add_parser("sampler", help="decoupled sampler job: pulls weights, returns rollouts")
    smp.add_argument("--id", required=True, help="this sampler's id (any short name)")
    lau = sub.add_parser("launch", help="the trainer and N samplers as local subprocesses")
    lau.add_argument("--samplers", type=int, required=True, help="how many sampler jobs")
    lau.add_argument("--trainer-cpus", help="pin the trainer to these CPUs, e.g. 0-7 (Linux)")
    lau.add_argument("--sampler-cpus", help="pin every sampler to these CPUs, e.g. 8-15")
    lau.add_argument("--trainer-processes", type=int, default=1, help="trainer processes")
    debug_help = "re-raise errors with the traceback instead of a one-line message"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    for p in (tr, gen, job, smp, lau):
        p.add_argument("config", help="YAML preset, e.g. configs/demo.yaml")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    # Overrides may follow an option (`launch CONFIG --samplers 2 k=v`): argparse leaves those.
    args, extra = parser.parse_known_args(argv)
    if any(a.startswith("-") or "=" not in a for a in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    try:
        if args.command == "trainer":  # before anything touches a JAX backend
            init_processes(args.coordinator, args.num_processes, args.process_id)
        cfg = load_config(args.config, args.overrides)
        if args.command in ("trainer", "sampler", "launch"):
            refuse_adaptive_kv(cfg.rollout)
            check_partial_cache(cfg.async_, cfg.rollout)
        if args.command in ("train", "trainer", "launch"):
            check_config(cfg)
        if args.command == "launch":
            if args.samplers < 1:
                raise ValueError(f"--samplers must be >= 1, got {args.samplers}")
            pins = {"trainer_cpus": parse_cpus(args.trainer_cpus)}
            pins["sampler_cpus"] = parse_cpus(args.sampler_cpus)
            pins["trainer_processes"] = args.trainer_processes
    except USAGE_ERRORS as e:
        if args.debug:
            raise
        print(_error(e), file=sys.stderr)
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if args.command == "train":
            summary = train(cfg, log_fn=log)
        elif args.command == "trainer":
            summary = run_trainer(cfg, log_fn=log)
        elif args.command == "sampler":
            try:
                summary = run_sampler(cfg, args.id, url=exchange_url(cfg), log_fn=log)
            except KeyboardInterrupt:  # a sampler holds nothing to save: just stop
                log(f"sampler {args.id}: interrupted")
                return 130
            print(json.dumps(summary))
            return summary["exit_code"]
        elif args.command == "launch":
            return launch(cfg, args.config, args.overrides, args.samplers, **pins, log_fn=log)
        else:
            summary = run_generate(cfg)
            summary["config"] = to_dict(cfg)
    except SupersededError as e:  # a newer trainer took over the exchange: stop, one line
        if args.debug:
            raise
        print(_error(e), file=sys.stderr)
        return 5
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
