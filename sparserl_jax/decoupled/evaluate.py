"""Held-out evaluation in the decoupled trainer: a sampler inside the trainer process that reads
the trainer's own PULSESync chain from the exchange (so it holds, and is verified to hold, exactly
the published weights a remote sampler would) and scores them as `sparserl train` does."""

from __future__ import annotations

import dataclasses
from typing import Any

from sparserl_jax.config import Config
from sparserl_jax.data import encode_prompts
from sparserl_jax.sampler import Sampler, sampler_shardings
from sparserl_jax.sync import Transport

__all__ = ["Evaluator"]


class Evaluator:
    """Held-out `examples` (`train.eval_examples` of them) scored with the newest published
    weights."""

    def __init__(self, cfg: Config, learner, model, params, mesh, tokenizer, reward_fn, examples):
        rcfg = cfg.rollout
        if rcfg.stop_token_ids == ():
            rcfg = dataclasses.replace(rcfg, stop_token_ids=tuple(tokenizer.eos_ids))
        self.examples = examples
        self.prompts = encode_prompts(self.examples, tokenizer, max_len=rcfg.max_prompt_len)
        self.tokenizer, self.reward_fn = tokenizer, reward_fn
        self.how = cfg.train.evaluation  # decoded as `sparserl train` decodes its held-out set
        self.sampler = Sampler.create(
            learner.model(params),
            params,
            rcfg,
            shardings=sampler_shardings(model, mesh),
            publish_dtype=cfg.sync.jnp_publish_dtype,
            mesh=mesh,
        )

    def __call__(self, transport: Transport) -> dict[str, Any]:
        """Catch up with `transport` (patches checked bit-identical), then evaluate."""
        for e in self.sampler.sync(transport):
            if e.error is not None:
                raise RuntimeError(f"evaluator: {e.kind} {e.version} refused: {e.error}")
        return self.sampler.evaluate(
            self.examples, self.prompts, self.tokenizer, self.reward_fn, **self.how
        )
