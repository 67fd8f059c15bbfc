"""Test doubles and oracles shipped with the package, for this project's tests and yours.

- `fixtures`: the tiny model (`tiny_model`, the `test-tiny` preset) and bit-exact tree equality.
- `kv_oracle`: `greedy_generate`, the static decode loop on the paged cache (prefill, then decode
  and compress each step) that the rollout engine's sparse decoding is checked against.
- `reference_sampler`: `generate`, the static-batch sampler on the dense cache.
- `oracles`: `stepwise_greedy`, greedy decoding by re-running the full forward each token.
- `learner`, `sync`, `kernels`: inputs and references for the learner, PULSESync and kernel tests.
"""

from sparserl_jax.testing.fixtures import (
    assert_trees_equal,
    tiny_model,
    tiny_model_config,
)
from sparserl_jax.testing.kv_oracle import GenerationStats, greedy_generate

__all__ = [
    "GenerationStats",
    "assert_trees_equal",
    "greedy_generate",
    "tiny_model",
    "tiny_model_config",
]
