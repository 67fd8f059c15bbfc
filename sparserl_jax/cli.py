"""The `sparserl` command.

sparserl train CONFIG.yaml [dotted.key=value ...]      RL post-training (see sparserl_jax.train)
sparserl generate CONFIG.yaml [dotted.key=value ...]   generate with a model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp

from sparserl_jax.build import build_model, build_tokenizer
from sparserl_jax.config import Config, ConfigError, load_config, to_dict
from sparserl_jax.models.hf import from_hf, to_hf
from sparserl_jax.rollout.generate import generate


def run_generate(cfg: Config) -> dict:
    """Build the model, round-trip it through a Hugging Face directory, and generate.

    The round trip (export, re-import, compare logits) runs on every call: it is cheap on the
    demo model and proves the checkpoint path end to end.
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg.model)
    tok = build_tokenizer(cfg.tokenizer, cfg.model)
    prompts = [tok.encode(p, add_bos=True) for p in cfg.generate.prompts]

    export_dir = to_hf(model, run_dir / "model")
    reloaded = from_hf(export_dir, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    probe = jnp.asarray([prompts[0]], jnp.int32)
    drift = float(jnp.max(jnp.abs(model(probe) - reloaded(probe))))

    g = cfg.generate
    kwargs = dict(
        max_new_tokens=g.max_new_tokens,
        stop_ids=tok.eos_ids,
        pad_id=tok.pad_id,
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        seed=g.seed,
    )
    generate(reloaded, prompts, **kwargs)  # compile
    start = time.perf_counter()
    out = generate(reloaded, prompts, **kwargs)
    seconds = time.perf_counter() - start
    completions = [tok.decode(out.tokens[i, : out.lengths[i]]) for i in range(len(prompts))]
    for prompt, text in zip(cfg.generate.prompts, completions, strict=True):
        print(f"{prompt!r} -> {text!r}")
    return {
        "num_params": model.cfg.num_params(),
        "export_dir": str(export_dir),
        "reload_max_abs_logit_diff": drift,
        "generated_tokens": int(out.lengths.sum()),
        "tokens_per_s": float(out.lengths.sum() / seconds),
        "completions": completions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparserl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="RL post-training: rollouts, rewards, learner, sync")
    gen = sub.add_parser("generate", help="generate text with a model from a config")
    for p in (tr, gen):
        p.add_argument("config", help="YAML preset, e.g. configs/demo.yaml")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"sparserl: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "train":
        from sparserl_jax.train import train

        summary = train(cfg, log_fn=lambda msg: print(msg, file=sys.stderr))
        print(json.dumps(summary))
        return 0
    if args.command == "generate":
        summary = run_generate(cfg)
        summary["config"] = to_dict(cfg)
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
