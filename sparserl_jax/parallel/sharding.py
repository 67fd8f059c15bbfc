"""Meshes and the one logical-axis rules table.

Parameters carry logical axis names (`nnx.Param(..., logical_axes=("embed", "mlp"))`); `RULES`
maps each name to mesh axes. A mesh axis that does not divide a dimension, or that an earlier
dimension of the same tensor already uses, is dropped for that dimension (the dimension is then
replicated over it), so every config runs on any mesh shape, including one CPU device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axes (in order). One table for parameters and activations.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # parameters
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("head_dim", ()),
    ("norm", ()),
    # activations
    ("batch", ("data", "fsdp")),
    ("length", ()),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh `data x fsdp x tensor`. One entry may be -1: it takes the remaining devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got data/fsdp/tensor = {sizes}")
        for name, s in zip(MESH_AXES, sizes, strict=True):
            if s != -1 and s < 1:
                raise ValueError(f"mesh.{name} must be >= 1 or -1, got {s}")

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(
                    f"{num_devices} devices cannot be split into mesh data/fsdp/tensor = "
                    f"{tuple(sizes)}"
                )
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"mesh data*fsdp*tensor = {math.prod(sizes)} but {num_devices} devices are given"
            )
        return tuple(sizes)


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with axes (data, fsdp, tensor) over `devices` (default: all devices)."""
    cfg = cfg or MeshConfig()
    devices = list(devices if devices is not None else jax.devices())
    shape = cfg.shape(len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Sequence[tuple[str, tuple[str, ...]]] = RULES,
    units: Sequence[int] | None = None,
) -> PartitionSpec:
    """PartitionSpec for a tensor of `shape` whose dimensions have these logical names.
    `units[i]`: how many consecutive elements of dimension i belong together (a fused
    `heads * head_dim` dimension: `head_dim`, so a shard holds whole heads); a mesh axis must
    divide the dimension's count of units."""
    units = units or (1,) * len(shape)
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, dim, unit in zip(logical_axes, shape, units, strict=True):
        dim //= unit
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        chosen = []
        size = 1
        for axis in table.get(name, ()) if name is not None else ():
            n = mesh.shape.get(axis, 1)
            if axis in used or n == 1 or dim % (size * n):
                continue
            chosen.append(axis)
            size *= n
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`x` pinned to the layout its logical axes name on the mesh the program is traced under
    (`jax.sharding.use_abstract_mesh`, as the learner's step and logprobs are); unchanged when
    traced without one, or when the mesh's axes are manual (inside `shard_map`).

    The model pins its activations with it (rows over data x fsdp, heads and MLP columns over
    tensor): without them XLA's sharding propagation lays activations out like the fsdp-sharded
    weights they meet, hidden dimension split and every row replicated, so each chip computes
    the whole batch's activations and logits (the 8-chip 7B step held `[8, T, 18944]` MLP
    activations per chip instead of `[1, T, 18944]`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return x
    spec = logical_to_spec(logical_axes, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state, mesh: Mesh, rules=RULES):
    """NamedShardings for every variable of an `nnx.State` (from `logical_axes` metadata).

    Variables without logical axes (RNG counters, scalars) are replicated.
    """

    def one(var):
        meta = var.get_metadata()
        axes, units = meta.get("logical_axes"), meta.get("shard_units")
        shape = var.shape if hasattr(var, "shape") else ()
        spec = PartitionSpec() if axes is None else logical_to_spec(axes, shape, mesh, rules, units)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=_is_var)


def create_sharded(model_fn: Callable[[], nnx.Module], mesh: Mesh, rules=RULES) -> nnx.Module:
    """Build a model with every parameter created directly in its sharded layout.

    `eval_shape` -> shardings from logical axes -> `jit(init, out_shardings=...)`: no full copy
    of the weights ever sits on one device.
    """
    abstract = nnx.eval_shape(model_fn)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh, rules)

    init = jax.jit(lambda: nnx.split(model_fn())[1], out_shardings=shardings)
    return nnx.merge(graphdef, init())


def shard_model(model: nnx.Module, mesh: Mesh, rules=RULES) -> nnx.Module:
    """Move an existing model's state onto the mesh in its logical layout (e.g. after `from_hf`)."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    return nnx.merge(graphdef, jax.device_put(state, shardings))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding for `[B, ...]` inputs: batch over data and fsdp, the rest replicated."""
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    lead = axes if len(axes) > 1 else (axes[0] if axes else None)
    return NamedSharding(mesh, PartitionSpec(lead, *([None] * (ndim - 1))))


def batch_shards(mesh: Mesh | None) -> int:
    """How many shards a `[B, ...]` batch's rows are split over (`batch_sharding`): data x fsdp,
    1 without a mesh. A learner batch must hold a multiple of `num_micro_batches` x this."""
    return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
