"""Meshes, logical-axis sharding rules and sharded model creation."""

from sparserl_jax.parallel.sharding import (
    MESH_AXES,
    RULES,
    MeshConfig,
    batch_sharding,
    batch_shards,
    constrain,
    create_sharded,
    logical_to_spec,
    make_mesh,
    shard_model,
    state_shardings,
)

__all__ = [
    "MESH_AXES",
    "MeshConfig",
    "RULES",
    "batch_sharding",
    "batch_shards",
    "constrain",
    "create_sharded",
    "logical_to_spec",
    "make_mesh",
    "shard_model",
    "state_shardings",
]
