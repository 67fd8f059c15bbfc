"""Rollout benchmark: peak KV memory of a greedy generation, dense vs a compression policy.

    python tools/bench_rollout.py --policy rkv --gen-len 4096 --budget 512 --batch 4 --json

Runs a random tiny model (the memory ratio does not depend on its size) twice on the paged
cache, once uncompressed and once with the policy, and prints one JSON line last:
`{"dense": {"kv_peak_bytes": ...}, "sparse": {"kv_peak_bytes": ..., "tokens_evicted": ...},
"ratio": ...}`. Bytes are the peak of pages actually in use, not array capacity.
(The rollout issue extends this tool with speed.)
"""

from __future__ import annotations

import argparse
import json
import time

from flax import nnx

from sparserl_jax.kvcache import CompressionConfig
from sparserl_jax.kvcache.generate import memory_benchmark
from sparserl_jax.models import ModelConfig, Transformer


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
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--impl", choices=["auto", "xla", "pallas_tpu", "pallas_gpu"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args()

    model_cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=2 * args.hidden,
    )
    config = CompressionConfig(
        policy=args.policy,
        budget=args.budget,
        window=args.window,
        interval=args.interval,
        granularity=args.granularity,
    )
    model = Transformer(model_cfg, rngs=nnx.Rngs(args.seed))
    start = time.perf_counter()
    result = memory_benchmark(
        model,
        config,
        batch=args.batch,
        gen_len=args.gen_len,
        prompt_len=args.prompt_len,
        page_size=args.page_size,
        seed=args.seed,
        impl=args.impl,
    )
    result["args"] = vars(args)
    result["wall_s"] = round(time.perf_counter() - start, 2)
    if not args.json:
        d, s = result["dense"], result["sparse"]
        print(
            f"policy={args.policy} L={args.gen_len} B={args.budget} batch={args.batch}: "
            f"dense {d['kv_peak_bytes']} B, sparse {s['kv_peak_bytes']} B "
            f"(ratio {result['ratio']:.4f}, evicted {s['tokens_evicted']})"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
