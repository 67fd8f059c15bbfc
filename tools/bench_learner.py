"""Learner benchmark: train-step tokens/s of a preset model on a synthetic GRPO batch.

    python tools/bench_learner.py --preset tiny --batch 16 --seq-len 128 --steps 10
    python tools/bench_learner.py --preset qwen2.5-0.5b --batch 32 --seq-len 1024 \
        --micro-batches 4 --dtype bfloat16            # GPU/TPU

A randomly initialised model with the preset's architecture (no weights are read) runs the full
learner step (Sparse-RL correction, PPO-clip, DGG, AdamW) on random tokens
(`benchmarks.learner`). The last line printed is one JSON object:
{"tokens_per_s": ..., "step_ms": ..., ...}.

With `--old-logp-passes 1 2 4` it times instead a rollout batch's whole learner work, pi_old
plus K update passes for each K, with pi_old from a separate recompute and from the first
pass's forward, side by side with the same learner (`benchmarks.learner.benchmark_old_logp`):

    python tools/bench_learner.py --preset small --batch 16 --seq-len 256 --old-logp-passes 1 2 4

and the JSON line is {"old_logp": [{"passes": K, "recompute_ms": ..., "first_pass_ms": ...,
"saved_ms": ..., "saved_fraction": ...}, ...], "old_logp_ms": ..., ...}.
"""

from __future__ import annotations

import argparse
import json

from flax import nnx

from benchmarks.learner import (
    PRESETS,
    benchmark_learner,
    benchmark_old_logp,
    model_config,
    synthetic_batch,
    synthetic_evictions,
)
from sparserl_jax.models import Transformer
from sparserl_jax.parallel import MeshConfig, make_mesh
from sparserl_jax.rl.config import LearnerConfig, OptimizerConfig
from sparserl_jax.rl.gating import DGGConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset",
        default="tiny",
        help=f"{sorted(PRESETS)}, a sparserl_jax.models.MODEL_PRESETS name or a configs/ name",
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--remat", action="store_true")
    p.add_argument(
        "--attention-block",
        type=int,
        default=None,
        help="the chunked attention's query/key block (default: the preset's)",
    )
    p.add_argument("--fsdp", type=int, default=-1, help="mesh fsdp size (-1: all devices)")
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--no-mesh", action="store_true", help="run on the default device only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attention-mask",
        choices=["dense", "replay"],
        default="dense",
        help="replay: the learner replays a synthetic eviction record (per layer and KV head, "
        "keys cached for up to 2 x --replay-budget queries)",
    )
    p.add_argument("--replay-budget", type=int, default=32)
    p.add_argument(
        "--old-logp-passes",
        type=int,
        nargs="+",
        metavar="K",
        help="time pi_old + K passes per batch, recomputed vs from the first pass (--steps "
        "timed batches per K and way)",
    )
    args = p.parse_args()

    cfg = model_config(args.preset, args.dtype, args.remat)
    if args.attention_block is not None:
        cfg = cfg.replace(attention_block=args.attention_block)
    model = Transformer(cfg, rngs=nnx.Rngs(args.seed))
    learner_cfg = LearnerConfig(
        optimizer=OptimizerConfig(learning_rate=1e-6),
        # Every step applies its update, so the timing is that of the full step.
        gating=DGGConfig(enabled=False),
        num_micro_batches=args.micro_batches,
        attention_mask=args.attention_mask,
    )
    mesh = None if args.no_mesh else make_mesh(MeshConfig(fsdp=args.fsdp, tensor=args.tensor))
    batch = synthetic_batch(
        batch=args.batch,
        seq_len=args.seq_len,
        prompt_len=args.prompt_len,
        vocab=cfg.vocab_size,
        group_size=args.group_size,
        seed=args.seed,
    )
    if args.attention_mask == "replay":
        batch = synthetic_evictions(
            batch,
            layers=cfg.num_layers,
            kv_heads=cfg.num_kv_heads,
            budget=args.replay_budget,
            seed=args.seed,
        )
    if args.old_logp_passes:
        result = benchmark_old_logp(
            model,
            learner_cfg,
            batch,
            passes=tuple(args.old_logp_passes),
            batches=args.steps,
            mesh=mesh,
        )
        result.update(preset=args.preset, dtype=args.dtype, micro_batches=args.micro_batches)
        for row in result["old_logp"]:
            print(
                f"K={row['passes']}: recompute {row['recompute_ms']:.1f} ms, first pass "
                f"{row['first_pass_ms']:.1f} ms per batch ({100 * row['saved_fraction']:.1f}% "
                "saved)"
            )
        print(json.dumps(result))
        return
    result = benchmark_learner(model, learner_cfg, batch, steps=args.steps, mesh=mesh)
    result.update(
        preset=args.preset,
        dtype=args.dtype,
        micro_batches=args.micro_batches,
        attention_mask=args.attention_mask,
        attention_block=cfg.attention_block,
    )
    print(
        f"{args.preset} {args.dtype} B={args.batch} T={args.seq_len} "
        f"M={args.micro_batches}: {result['tokens_per_s']:.0f} tokens/s, "
        f"{result['step_ms']:.1f} ms/step (compile {result['compile_s']:.1f} s)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
