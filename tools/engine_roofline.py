"""The rollout engine's decode roofline per chip on a data x fsdp x tensor mesh, counted
analytically.

    python tools/engine_roofline.py     # the shapes of docs/results.md's engine-on-mesh table

A decode step must read every weight once (bf16, split over tensor and, with
`rollout.fsdp_shards`, fsdp; replicated over data) and every kept K and V of its shard's slots
in every layer (KV heads split over tensor where
their count divides, else replicated); over the chip's HBM bandwidth that is the step's floor.
Kept tokens: dense, the mean over a rollout from the prompt to `max_len`; R-KV, the budget plus
half a compression interval. (XLA's own `bytes accessed` of the decode chunk is no per-step
figure: its loops run a data-dependent number of steps.) Prints one JSON line per case.
"""

from __future__ import annotations

import json

from sparserl_jax.models import model_preset

# Google Cloud's per-chip HBM bandwidth, GB/s.
HBM_GBPS = {"v5e": 819, "v5p": 2765, "v6e": 1640}
# (preset, chip, chips, data, fsdp, tensor, slots, prompt, max_len, budget, interval)
CASES = [
    ("qwen2.5-7b", "v5e", 8, 2, 1, 4, 256, 512, 4096, 512, 128),
    ("qwen2.5-7b", "v5e", 8, 1, 2, 4, 256, 512, 4096, 512, 128),
    ("qwen2.5-32b", "v5p", 4, 1, 1, 4, 256, 512, 8192, 1024, 128),
    ("qwen2.5-0.5b", "v5e", 1, 1, 1, 1, 256, 512, 4096, 512, 128),
]


def roofline(preset, chip, chips, data, fsdp, tensor, slots, prompt, max_len, budget, interval):
    cfg = model_preset(preset)
    weights = cfg.num_params() * 2 / tensor / fsdp
    data = data * fsdp  # the slots split over both
    kv_heads = cfg.num_kv_heads // tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
    per_token = cfg.num_layers * kv_heads * cfg.head_dim * 2 * 2  # K and V, bf16
    kept = {"dense": (prompt + max_len) / 2}
    kept["rkv"] = min(budget + interval / 2, kept["dense"])
    out = {"preset": preset, "chip": chip, "chips": chips, "mesh": [data // fsdp, fsdp, tensor]}
    for policy, tokens in kept.items():
        nbytes = weights + slots / data * tokens * per_token
        ms = nbytes / (HBM_GBPS[chip] * 1e9) * 1e3
        out[policy] = {
            "kept_tokens": tokens,
            "bytes_per_step": nbytes,
            "floor_ms": ms,
            "tokens_per_s_per_chip": slots / chips / ms * 1e3,
        }
    out["rkv_speedup"] = out["dense"]["floor_ms"] / out["rkv"]["floor_ms"]
    return out


def main() -> None:
    for case in CASES:
        print(json.dumps(roofline(*case)))


if __name__ == "__main__":
    main()
