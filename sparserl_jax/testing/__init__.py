"""Test doubles shipped with the package: tiny model configs, tree assertions, and the reference
greedy decode loop (`greedy_generate`) the KV cache and the rollout engine are checked against."""

from sparserl_jax.testing.fixtures import (
    assert_trees_equal,
    tiny_model,
    tiny_model_config,
)
from sparserl_jax.testing.kv_oracle import GenerationStats, greedy_generate
