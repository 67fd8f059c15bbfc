"""Test doubles and oracles shipped with the package, for this project's tests and yours.

- `fixtures`: the tiny model (`tiny_model`, the `test-tiny` preset), bit-exact tree equality and
  `child_env` (a test's `sparserl` child process: one CPU device, a shared compilation cache).
- `kv_oracle`: `greedy_generate`, the static decode loop on the paged cache (prefill, then decode
  and compress each step) that the rollout engine's sparse decoding is checked against.
- `reference_sampler`: `generate`, the static-batch sampler on the dense cache.
- `oracles`: `stepwise_greedy`, greedy decoding by re-running the full forward each token.
- `learner`, `sync`, `kernels`: inputs and references for the learner, PULSESync and kernel tests.
"""

from sparserl_jax.testing.fixtures import (
    assert_trees_equal,
    child_env,
    tiny_model,
    tiny_model_config,
)
from sparserl_jax.testing.kv_oracle import GenerationStats, greedy_generate

__all__ = [
    "GenerationStats",
    "assert_trees_equal",
    "child_env",
    "greedy_generate",
    "tiny_model",
    "tiny_model_config",
]
