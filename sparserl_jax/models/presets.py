"""Named architectures: the shapes of published checkpoints and the small random models that the
tests, benchmarks and configs build.

    cfg = model_preset("qwen2.5-0.5b", dtype="bfloat16")   # random init needs only the shape
    model = Transformer(cfg, rngs=nnx.Rngs(0))

The published shapes take their values from each checkpoint's `config.json`; loading weights is
`models.from_hf`. The small ones are random-init architectures whose names say who uses them;
distinct architectures keep distinct names, and the benchmarks' figures depend on every value.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from types import MappingProxyType

from sparserl_jax.models.config import ModelConfig, RopeScaling

# Qwen2/2.5: QKV bias, RoPE base 1e6, RMSNorm eps 1e-6.
_QWEN2 = dict(family="qwen2", qkv_bias=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
# The benchmarks' random models: untied lm_head, every other field at ModelConfig's default.
_BENCH = dict(tie_embeddings=False)

_PRESETS = {
    # ---- published checkpoints (config.json values) ------------------------------------------
    "qwen2.5-0.5b": ModelConfig(
        **_QWEN2, vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, intermediate_size=4864, tie_embeddings=True,
        max_position_embeddings=32768,
    ),
    # max_position_embeddings as in Qwen2.5-1.5B-Instruct (the base checkpoint says 131072).
    "qwen2.5-1.5b": ModelConfig(
        **_QWEN2, vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
        num_kv_heads=2, head_dim=128, intermediate_size=8960, tie_embeddings=True,
        max_position_embeddings=32768,
    ),
    # Untied lm_head; max_position_embeddings as in Qwen2.5-7B-Instruct (the base says 131072).
    "qwen2.5-7b": ModelConfig(
        **_QWEN2, vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, intermediate_size=18944, tie_embeddings=False,
        max_position_embeddings=32768,
    ),
    # Shapes only (no checkpoint in tests): the rollout that fits a v5p-4 only with eviction.
    "qwen2.5-32b": ModelConfig(
        **_QWEN2, vocab_size=152064, hidden_size=5120, num_layers=64, num_heads=40,
        num_kv_heads=8, head_dim=128, intermediate_size=27648, tie_embeddings=False,
        max_position_embeddings=32768,
    ),
    "qwen3-0.6b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, intermediate_size=3072, qk_norm=True,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_embeddings=True,
        max_position_embeddings=40960,
    ),
    "llama3.2-1b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, intermediate_size=8192, rope_theta=500_000.0,
        rope_scaling=RopeScaling(
            rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=131072,
    ),
    # ---- tests (prime-ish sizes, so a transposed or mis-split tensor cannot line up) ---------
    # `sparserl_jax.testing.tiny_model`: the test suite's default model.
    "test-tiny": ModelConfig(
        family="qwen2", vocab_size=67, hidden_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=12, intermediate_size=88, qkv_bias=True,
    ),
    # tests/kvcache/test_long_generation.py: generations of 8x the KV budget.
    "kv-longgen-tiny": ModelConfig(
        vocab_size=53, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
        intermediate_size=24,
    ),
    # tests/kvcache/test_paged_decode.py: paged decode against teacher forcing.
    "kv-paged-tiny": ModelConfig(
        vocab_size=61, hidden_size=24, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=6,
        intermediate_size=40, qkv_bias=True,
    ),
    # tests/models/test_hf_parity.py: the shape shared by its Qwen2 / Qwen3 / Llama checkpoints.
    "hf-parity-tiny": ModelConfig(
        vocab_size=61, hidden_size=40, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=56, max_position_embeddings=256,
    ),
    # ---- configs/ (the character tokenizer's 96 ids) -----------------------------------------
    "char-tiny": ModelConfig(  # configs/tiny.yaml, the tests' end-to-end config
        family="qwen2", vocab_size=96, hidden_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=12, intermediate_size=88, qkv_bias=True, tie_embeddings=True,
    ),
    "char-demo": ModelConfig(  # configs/demo.yaml, the CPU demo
        family="qwen2", vocab_size=96, hidden_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, intermediate_size=384, qkv_bias=True, tie_embeddings=True,
    ),
    "char-study": ModelConfig(  # configs/repro_sparse_rl.yaml, the Sparse-RL study (1.6M)
        family="qwen2", vocab_size=96, hidden_size=192, num_layers=4, num_heads=6,
        num_kv_heads=2, head_dim=32, intermediate_size=512, qkv_bias=True, tie_embeddings=True,
    ),
    # ---- benchmarks (random weights; docs/results.md's figures come from these) -----------
    # benchmarks/loco.py (`tools/bench_loco.py --preset tiny|small|base`).
    "loco-tiny": ModelConfig(
        **_BENCH, vocab_size=128, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=16, intermediate_size=64,
    ),
    "loco-small": ModelConfig(  # 0.87M parameters
        **_BENCH, vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32, intermediate_size=352,
    ),
    "loco-base": ModelConfig(  # 4.0M parameters
        **_BENCH, vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
        head_dim=32, intermediate_size=704,
    ),
    # benchmarks/sync.py (`tools/bench_sync.py --preset tiny|cpu`).
    "sync-tiny": ModelConfig(
        **_BENCH, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128,
    ),
    "sync-cpu": ModelConfig(  # 31.99M parameters
        **_BENCH, vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
        head_dim=64, intermediate_size=1408,
    ),
    # benchmarks/rollout.py (`tools/bench_rollout.py --preset tiny|cpu`): Qwen2-shaped.
    "rollout-tiny": ModelConfig(  # the KV-cache memory benchmark's model
        **_QWEN2, **_BENCH, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128,
    ),
    "rollout-cpu": ModelConfig(  # the rollout speed benchmark's model
        **_QWEN2, **_BENCH, vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=32, intermediate_size=1024,
    ),
    # benchmarks/learner.py (`tools/bench_learner.py --preset small`).
    "learner-small": ModelConfig(  # 26.7M parameters
        vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
        head_dim=64, intermediate_size=1408, tie_embeddings=True,
    ),
    # tests/test_tpu_programs.py: 2 kv heads of dim 64 (as Qwen2.5-0.5B), so a TPU decode
    # step packs them into one 128-lane block and runs the Mosaic kernels.
    "tpu-lanes-small": ModelConfig(
        family="qwen2", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=64, intermediate_size=256, qkv_bias=True, tie_embeddings=True,
    ),
}  # fmt: skip

MODEL_PRESETS: Mapping[str, ModelConfig] = MappingProxyType(_PRESETS)


def model_preset(name: str, **overrides) -> ModelConfig:
    """The architecture registered as `name`, with `overrides` (ModelConfig fields) applied.

    An unknown name is a `ValueError` naming the closest registered ones.
    """
    if name not in MODEL_PRESETS:
        close = difflib.get_close_matches(name, list(MODEL_PRESETS), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise ValueError(
            f"unknown model preset {name!r}; {hint}known presets: {sorted(MODEL_PRESETS)}"
        )
    config = MODEL_PRESETS[name]
    return config.replace(**overrides) if overrides else config
