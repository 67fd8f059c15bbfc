"""PULSELoCo benchmark: DDP vs DiLoCo vs PULSELoCo from one pretrained start, same data and steps.

    python tools/bench_loco.py --json                 # GRPO post-training at lr 3e-6
    python tools/bench_loco.py --value-dtype float32 --payload auto --json   # fp32, uncoded
    python tools/bench_loco.py --lr 1e-4 --json       # where the savings shrink
    python tools/bench_loco.py --task shift --json    # supervised fine-tuning on a shifted chain

Prints progress to stderr and, with --json, one JSON line last on stdout:
`{"ddp": {"final_loss", "bytes", ...}, "diloco": {...}, "pulseloco": {...}, "summary": {...},
"config": {...}}` (see `benchmarks.loco.run`). Each replica is one fake CPU device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lr", type=float, default=3e-6, help="inner AdamW learning rate (all methods)")
    p.add_argument("--replicas", type=int, default=4, help="R trainer replicas (2..4)")
    p.add_argument("--inner-steps", type=int, default=10, help="H inner steps per round (10..50)")
    p.add_argument("--rounds", type=int, default=10, help="outer rounds; DDP runs rounds*H steps")
    p.add_argument(
        "--preset", default="small", help="model size: tiny, small, base (benchmarks.loco.PRESETS)"
    )
    p.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--pretrain-steps", type=int, default=150)
    p.add_argument("--pretrain-lr", type=float, default=1e-3)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="compute dtype of every forward (master weights stay fp32)",
    )
    p.add_argument("--task", default="rl", choices=("rl", "shift"), help="post-training task")
    p.add_argument("--shift", type=float, default=0.5, help="shift task: chain rows changed")
    p.add_argument("--group-size", type=int, default=8, help="rl task: completions per prompt")
    p.add_argument(
        "--target-mod", type=int, default=8, help="rl task: target ids are multiples of this"
    )
    p.add_argument("--eval-prompts", type=int, default=128, help="rl task: held-out prompts")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument(
        "--value-dtype", default="bfloat16", choices=("bfloat16", "float32"),
        help="PULSELoCo's sent values (bf16: rounding errors stay in the residual)",
    )  # fmt: skip
    p.add_argument(
        "--payload", default="coded", choices=("coded", "auto", "index", "bitmask"),
        help="PULSELoCo's payload: entropy-coded bytes, or padded index / bitmask arrays",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    a = p.parse_args(argv)
    # One fake CPU device per replica; must be set before JAX starts its backend.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={a.replicas}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from benchmarks.loco import LoCoBenchConfig, run

    cfg = LoCoBenchConfig(
        lr=a.lr, replicas=a.replicas, inner_steps=a.inner_steps, rounds=a.rounds,
        preset=a.preset, dtype=a.dtype, batch=a.batch, seq_len=a.seq_len,
        pretrain_steps=a.pretrain_steps,
        pretrain_lr=a.pretrain_lr, task=a.task, shift=a.shift, group_size=a.group_size,
        target_mod=a.target_mod, eval_prompts=a.eval_prompts, outer_lr=a.outer_lr,
        outer_momentum=a.outer_momentum, value_dtype=a.value_dtype, payload=a.payload,
        seed=a.seed,
    )  # fmt: skip
    result = run(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if a.json:
        print(json.dumps(result), flush=True)
    else:
        methods = ("ddp", "diloco", "pulseloco")
        brief = {
            k: {"final_loss": result[k]["final_loss"], "bytes": result[k]["bytes"]} for k in methods
        }
        print(brief | {"summary": result["summary"]})


if __name__ == "__main__":
    main()
