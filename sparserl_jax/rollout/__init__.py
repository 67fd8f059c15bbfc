"""Rollouts: the jitted continuous-batching engine on the paged (optionally compressed) KV cache,
sampling with the logprob contract, dense old-policy logprobs."""

from sparserl_jax.rollout.config import RolloutAborted, RolloutConfig, RolloutResult
from sparserl_jax.rollout.engine import RolloutEngine
from sparserl_jax.rollout.logprobs import dense_logprobs, head_logprobs, teacher_forced_logprobs
from sparserl_jax.rollout.sampling import request_keys, sample, step_keys, token_logprobs

__all__ = [
    "RolloutAborted",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutResult",
    "dense_logprobs",
    "head_logprobs",
    "request_keys",
    "sample",
    "step_keys",
    "teacher_forced_logprobs",
    "token_logprobs",
]
