"""Test doubles shipped with the package: tiny model configs and tree assertions."""

from sparserl_jax.testing.fixtures import (
    assert_trees_equal,
    tiny_model,
    tiny_model_config,
)
