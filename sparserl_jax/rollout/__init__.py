"""Sampling and generation (the continuous-batching engine on the paged cache builds on these)."""

from sparserl_jax.rollout.generate import Generation, generate, pad_prompts
from sparserl_jax.rollout.sampling import sample, token_logprobs
