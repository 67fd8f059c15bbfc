"""`sparserl generate`: generate with a model from a config, on the rollout engine.

The model is built from the config, exported to a Hugging Face directory and re-imported (the
logits of both are compared), then the re-imported model generates the config's prompts with the
same continuous-batching engine (and, with `generate.kv`, the same compressed KV cache) that
produces training rollouts.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax.numpy as jnp

from sparserl_jax.build import build_model, build_tokenizer
from sparserl_jax.config import Config, GenerateConfig
from sparserl_jax.models.hf import from_hf, to_hf
from sparserl_jax.rollout import RolloutConfig, RolloutEngine
from sparserl_jax.sampler import completion_texts
from sparserl_jax.storage import is_url

__all__ = ["engine_config", "run_generate"]


def engine_config(g: GenerateConfig, prompts: list[list[int]], stop_ids) -> RolloutConfig:
    """The engine settings for `g`: one slot per prompt (at most 8), prompts up to the longest."""
    return RolloutConfig(
        num_slots=min(len(prompts), 8),
        max_prompt_len=max(len(p) for p in prompts),
        max_new_tokens=g.max_new_tokens,
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        stop_token_ids=tuple(stop_ids),
        seed=g.seed,
        kv=g.kv,
    )


def run_generate(cfg: Config, *, log_fn=print) -> dict:
    """Build the model, round-trip it through a Hugging Face directory, and generate.

    The round trip (export, re-import, compare logits) runs on every call: it is cheap on small
    models and proves the checkpoint path end to end. `log_fn` receives one line per prompt.
    """
    if is_url(cfg.run_dir):
        raise ValueError(
            f"run_dir={cfg.run_dir}: `sparserl generate` exports a Hugging Face directory "
            "there; give it a local path"
        )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg.model)
    tok = build_tokenizer(cfg.tokenizer, cfg.model)
    prompts = [tok.encode(p, add_bos=True) for p in cfg.generate.prompts]

    export_dir = to_hf(model, run_dir / "model")
    reloaded = from_hf(export_dir, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    probe = jnp.asarray([prompts[0]], jnp.int32)
    drift = float(jnp.max(jnp.abs(model(probe) - reloaded(probe))))

    engine = RolloutEngine(reloaded, engine_config(cfg.generate, prompts, tok.eos_ids))
    engine.generate(prompts)  # compile
    start = time.perf_counter()
    out = engine.generate(prompts)
    seconds = time.perf_counter() - start
    completions = completion_texts(out, tok)
    for prompt, text in zip(cfg.generate.prompts, completions, strict=True):
        log_fn(f"{prompt!r} -> {text!r}")
    generated = int(out.completion_lens.sum())
    return {
        "num_params": model.cfg.num_params(),
        "export_dir": str(export_dir),
        "reload_max_abs_logit_diff": drift,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "tokens_evicted": int(out.tokens_evicted.sum()),
        "completions": completions,
    }
