"""Rollout benchmark: speed and peak KV memory, dense vs a compression policy vs tunix.

    python tools/bench_rollout.py --gen-len 4096 --budget 512 --policy rkv --batch 4
    python tools/bench_rollout.py --gen-len 4096 --budget 512 --peer none --preset tiny  # memory

Greedy generation on a random-weight Qwen2-shaped model (`--preset cpu`: 4 layers, d=256, 8 query
/ 2 KV heads, vocab 4096; `tiny` is the KV-cache memory benchmark's model; `qwen2.5-*` for GPUs;
`--layers/--hidden/--heads/--kv-heads/--vocab` override the preset) with the rollout engine on
the paged cache, once dense and once with the policy, and, with `--peer tunix` (the default when
google-tunix is installed), tunix's vanilla sampler on tunix's Qwen2 holding identical weights.
Same batch, prompt and generated length everywhere; compilation is excluded (warm-up first);
tokens/s counts generated tokens only; KV bytes are the peak of pages in use, not capacity.
The last line printed is one JSON object: `{"config": {...}, "dense": {"tokens_per_s": ...,
"kv_peak_bytes": ...}, "sparse": {..., "tokens_evicted": ...}, "tunix": {"tokens_per_s": ...}
or null, "greedy_match_tunix": true/false/null, "ratio": sparse/dense KV bytes, ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
from flax import nnx

from benchmarks.rollout import PRESETS, bench_model_config, speed_benchmark, tunix_available
from pallas_kernels._dispatch import KERNEL_IMPL_ENV
from sparserl_jax.kvcache import CompressionConfig
from sparserl_jax.models import Transformer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policy", choices=["none", "streaming", "snapkv", "h2o", "rkv"], default="rkv")
    p.add_argument("--gen-len", type=int, default=4096)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--interval", type=int, default=128)
    p.add_argument("--granularity", choices=["sequence", "layer", "head"], default="sequence")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--layers", type=int, default=None, help="override the preset")
    p.add_argument("--hidden", type=int, default=None, help="override the preset")
    p.add_argument("--heads", type=int, default=None, help="override the preset")
    p.add_argument("--kv-heads", type=int, default=None, help="override the preset")
    p.add_argument("--vocab", type=int, default=None, help="override the preset")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--chunk-steps", type=int, default=64, help="decode steps per host sync")
    p.add_argument("--repeats", type=int, default=1, help="timed runs each (best is kept)")
    p.add_argument(
        "--peer",
        choices=["tunix", "none"],
        default="tunix" if tunix_available() else "none",
        help="tunix's sampler as the peer (default when google-tunix is installed)",
    )
    p.add_argument("--impl", choices=["auto", "xla", "pallas_tpu", "pallas_gpu"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args()
    if args.peer == "tunix" and not tunix_available():
        p.error("--peer tunix needs google-tunix (pip install -e '.[bench]')")
    if args.impl != "auto":
        os.environ[KERNEL_IMPL_ENV] = args.impl

    hidden = args.hidden
    model_cfg = bench_model_config(
        args.preset,
        hidden_size=hidden,
        intermediate_size=None if hidden is None else 4 * hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        dtype=args.dtype,
    )
    kv = CompressionConfig(
        policy=args.policy,
        budget=args.budget,
        window=args.window,
        interval=args.interval,
        granularity=args.granularity,
    )
    model = Transformer(model_cfg, rngs=nnx.Rngs(args.seed))
    start = time.perf_counter()
    result = speed_benchmark(
        model,
        kv,
        batch=args.batch,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        page_size=args.page_size,
        chunk_steps=args.chunk_steps,
        peer=args.peer,
        repeats=args.repeats,
        seed=args.seed,
    )
    config = dict(vars(args))
    config["model"] = {
        k: getattr(model_cfg, k)
        for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim")
        + ("intermediate_size", "vocab_size", "dtype")
    }
    config["backend"] = jax.default_backend()
    config["wall_s"] = round(time.perf_counter() - start, 2)
    result = {"config": config, **result}
    if not args.json:
        d, s, t = result["dense"], result["sparse"], result["tunix"]
        peer = "" if t is None else f", tunix {t['tokens_per_s']:.0f} tok/s"
        print(
            f"policy={args.policy} L={args.gen_len} B={args.budget} batch={args.batch}: "
            f"dense {d['tokens_per_s']:.0f} tok/s {d['kv_peak_bytes']} B, sparse "
            f"{s['tokens_per_s']:.0f} tok/s {s['kv_peak_bytes']} B (ratio {result['ratio']:.4f},"
            f" evicted {s['tokens_evicted']}){peer}, greedy match {result['greedy_match_tunix']}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
