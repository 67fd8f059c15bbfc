"""Rollout speed and memory benchmark: dense vs sparse on the engine, and tunix's sampler as peer.

Used by `tools/bench_rollout.py`. Every run is greedy on a random-weight Qwen2-shaped model,
same batch, same prompt, same number of generated tokens (no stop token), and is timed after a
warm-up so compilation is excluded; tokens/s counts generated tokens only. The peer is tunix's
vanilla `Sampler` (google-tunix, the `bench` extra) on tunix's own Qwen2 module holding the
identical weights (`tunix_qwen2`), which checks that both produce the same greedy tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparserl_jax.kvcache import CompressionConfig
from sparserl_jax.models import ModelConfig, Transformer, model_preset
from sparserl_jax.rollout.config import RolloutConfig
from sparserl_jax.rollout.engine import RolloutEngine

# `--preset` names -> `sparserl_jax.models.MODEL_PRESETS` names, all Qwen2-shaped (QKV bias,
# RoPE theta 1e6): "cpu" is the default CPU benchmark model, "tiny" the KV-cache memory
# benchmark's model, the others the shapes of published checkpoints.
PRESETS = {
    "tiny": "rollout-tiny",
    "cpu": "rollout-cpu",
    "qwen2.5-0.5b": "qwen2.5-0.5b",
    "qwen2.5-1.5b": "qwen2.5-1.5b",
}


def bench_model_config(preset: str = "cpu", **overrides) -> ModelConfig:
    """The preset's Qwen2-family config with the overrides that are not None.

    Overriding `hidden_size` or `num_heads` re-derives `head_dim` as D // N (unless given).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    if changes.keys() & {"hidden_size", "num_heads"}:
        changes.setdefault("head_dim", None)
    return model_preset(PRESETS[preset], **changes)


def random_prompts(vocab: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `prompt_len` uniform token ids."""
    ids = np.random.default_rng(seed).integers(0, vocab, size=(batch, prompt_len))
    return ids.tolist()


def engine_runner(
    model: Transformer,
    prompts: list[list[int]],
    *,
    gen_len: int,
    kv: CompressionConfig | None,
    page_size: int = 16,
    chunk_steps: int = 64,
) -> Callable[[], dict[str, Any]]:
    """A warmed-up greedy run of `gen_len` tokens per prompt on the engine; each call returns
    tokens/s, seconds, KV peak bytes, tokens evicted and the tokens."""
    config = RolloutConfig(
        num_slots=len(prompts),
        max_prompt_len=max(len(p) for p in prompts),
        max_new_tokens=gen_len,
        temperature=0.0,
        chunk_steps=chunk_steps,
        kv=kv,
        page_size=page_size,
    )
    engine = RolloutEngine(model, config)
    engine.warmup()

    def run() -> dict[str, Any]:
        result = engine.generate(prompts)
        assert int(result.completion_lens.sum()) == gen_len * len(prompts)
        return {
            "tokens_per_s": result.stats["tokens_per_s"],
            "seconds": result.stats["seconds"],
            "kv_peak_bytes": result.stats["kv_peak_bytes"],
            "tokens_evicted": int(result.tokens_evicted.sum()),
            "pool_pages": config.pool_pages,
            "tokens": result.completion_ids,
        }

    return run


# ---- tunix peer --------------------------------------------------------------------------------


def tunix_available() -> bool:
    try:
        import tunix.generate.sampler  # noqa: F401
        import tunix.models.qwen2.model  # noqa: F401
    except ImportError:
        return False
    return True


def tunix_config(cfg: ModelConfig, **fields):
    """tunix's Qwen2 `ModelConfig` of architecture `cfg` (`fields`: its other fields, e.g.
    dtype, param_dtype, remat_config)."""
    from tunix.models.qwen2 import model as tq

    if not cfg.qkv_bias or cfg.qk_norm or cfg.o_bias or cfg.mlp_bias or cfg.rope_scaling:
        raise ValueError("tunix's Qwen2 has QKV bias and nothing else: use a qwen2 preset")
    return tq.ModelConfig(
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads,
        rope_theta=int(cfg.rope_theta),
        norm_eps=cfg.rms_norm_eps,
        use_tied_embedding=cfg.tie_embeddings,
        **fields,
    )


def tunix_qwen2(model: Transformer):
    """tunix's Qwen2 module holding exactly `model`'s weights (fp32).

    Name map (ours -> tunix): embed.embedding -> embedder.input_embedding; per layer
    attn.{q,k,v,o}_proj -> attn.{q,k,v,o}_proj.w (same [D, N, H] / [N, H, D] layouts),
    attn.{q,k,v}_bias [N, H] -> flat [N * H], input_norm / post_attn_norm .weight ->
    input_layernorm / post_attention_layernorm .w, mlp.*_proj -> mlp.*_proj.kernel,
    final_norm.weight -> final_norm.w, lm_head.kernel -> lm_head.w.
    """
    from tunix.models.qwen2 import model as tq

    cfg = model.cfg
    peer = tq.Qwen2(tunix_config(cfg), rngs=nnx.Rngs(0))
    src = nnx.to_pure_dict(nnx.state(model))
    dst = nnx.to_pure_dict(nnx.state(peer))
    dst["embedder"]["input_embedding"] = src["embed"]["embedding"]
    dst["final_norm"]["w"] = src["final_norm"]["weight"]
    if not cfg.tie_embeddings:
        dst["lm_head"]["w"] = src["lm_head"]["kernel"]
    for i in range(cfg.num_layers):
        s, d = src["layers"][i], dst["layers"][i]
        for name in ("q_proj", "k_proj", "v_proj"):  # tunix keeps [D, heads, H]
            d["attn"][name]["w"] = s["attn"][name].reshape(cfg.hidden_size, -1, cfg.head_dim)
        d["attn"]["o_proj"]["w"] = s["attn"]["o_proj"]
        for name in ("q_bias", "k_bias", "v_bias"):
            d["attn"][name] = s["attn"][name].reshape(-1)
        d["input_layernorm"]["w"] = s["input_norm"]["weight"]
        d["post_attention_layernorm"]["w"] = s["post_attn_norm"]["weight"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            d["mlp"][name]["kernel"] = s["mlp"][name]
    state = nnx.state(peer)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dst))
    nnx.update(peer, state)
    return peer


class _IdTokenizer:
    """Token ids written as space-separated integers: what tunix's sampler needs to be fed ids.

    Pad and stop ids lie outside the vocabulary: tunix masks every buffer entry equal to the pad
    id out of attention, so an in-vocabulary pad id (e.g. 0) would hide generated tokens.
    """

    def __init__(self, vocab_size: int):
        self._vocab = vocab_size

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self) -> None:
        return None

    def eos_id(self) -> int:
        return self._vocab + 1

    def pad_id(self) -> int:
        return self._vocab


def tunix_runner(
    model: Transformer, prompts: list[list[int]], *, gen_len: int
) -> Callable[[], dict[str, Any]]:
    """tunix's vanilla sampler, greedy, `gen_len` tokens per prompt, warmed up by one full run
    (its programs depend on the lengths). Each call returns tokens/s, seconds and the tokens.

    The stop id is outside the vocabulary, so every row generates exactly `gen_len` tokens;
    prompts must all have the same length (tunix would left-pad shorter ones).
    """
    from tunix.generate import sampler as ts

    cfg = model.cfg
    prompt_len = len(prompts[0])
    if any(len(p) != prompt_len for p in prompts):
        raise ValueError("the tunix comparison needs prompts of one length")
    sampler = ts.Sampler(
        tunix_qwen2(model),
        _IdTokenizer(cfg.vocab_size),
        ts.CacheConfig(
            cache_size=prompt_len + gen_len,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        ),
    )
    texts = [" ".join(map(str, p)) for p in prompts]

    def run() -> dict[str, Any]:
        start = time.perf_counter()
        out = sampler(texts, max_generation_steps=gen_len, max_prompt_length=prompt_len)
        tokens = np.stack([np.asarray(t[:gen_len]) for t in out.tokens])
        seconds = time.perf_counter() - start
        assert tokens.shape == (len(prompts), gen_len), tokens.shape
        return {"tokens_per_s": tokens.size / seconds, "seconds": seconds, "tokens": tokens}

    run()
    return run


def speed_benchmark(
    model: Transformer,
    kv: CompressionConfig,
    *,
    batch: int,
    prompt_len: int,
    gen_len: int,
    page_size: int = 16,
    chunk_steps: int = 64,
    peer: str = "tunix",
    repeats: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Dense, sparse (`kv`) and peer runs on one prompt batch; speed fields per arm
    plus the memory fields (`ratio` = sparse / dense peak KV bytes)."""
    prompts = random_prompts(model.cfg.vocab_size, batch, prompt_len, seed)
    runners = {
        name: engine_runner(
            model, prompts, gen_len=gen_len, kv=cfg, page_size=page_size, chunk_steps=chunk_steps
        )
        for name, cfg in (("dense", None), ("sparse", kv))
    }
    if peer == "tunix":
        runners["tunix"] = tunix_runner(model, prompts, gen_len=gen_len)
    # Interleaved repeats, best of each: the box is shared, so load hits all runs alike.
    runs: dict[str, dict[str, Any]] = {}
    for _ in range(repeats):
        for name, run in runners.items():
            r = run()
            if name not in runs or r["seconds"] < runs[name]["seconds"]:
                runs[name] = r
    tunix = runs.get("tunix")
    dense_tokens = runs["dense"].pop("tokens")
    sparse_tokens = runs["sparse"].pop("tokens")
    out: dict[str, Any] = {
        "dense": runs["dense"],
        "sparse": runs["sparse"],
        "tunix": None,
        "greedy_match_tunix": None,
        "ratio": runs["sparse"]["kv_peak_bytes"] / runs["dense"]["kv_peak_bytes"],
        "target_ratio": (kv.budget + kv.interval + page_size) / (prompt_len + gen_len),
        "greedy_match_sparse_dense": float(np.mean(sparse_tokens == dense_tokens)),
    }
    if tunix is not None:
        tunix_tokens = tunix.pop("tokens")
        out["tunix"] = tunix
        out["greedy_match_tunix"] = bool(np.array_equal(tunix_tokens, dense_tokens))
        out["greedy_match_tunix_fraction"] = float(np.mean(tunix_tokens == dense_tokens))
        for name in ("dense", "sparse"):
            out[f"{name}_over_tunix"] = runs[name]["tokens_per_s"] / tunix["tokens_per_s"]
    return out
