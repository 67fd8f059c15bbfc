"""The rollout engine's data shards: on a mesh whose `data` axis has D > 1 devices, each data
shard holds its own S / D slots, its own page pool of P / D pages and its own free-page stack.

The engine's device programs (prefill, decode chunk, refill) then run per data shard under
`shard_map` over `data` alone (`tensor` stays automatic: the weights, heads, MLP columns and
vocabulary are split over it by the model's logical axes, and the pools over KV heads where
their count divides by it). Nothing crosses data shards but three small decisions: in decode,
whether any slot of any shard is still live and whether any row of any shard is due for
compression (one boolean each per step); in prefill, the most slots any shard fills. So every
device runs the same program: the same steps, compressions and prefill groups (a shard with
nothing to do runs them as no-ops). That is what one device would do (the compression interval
counts the batch's steps), so tokens equal one device's for the same keys, since a request's keys
do not depend on its slot; and control flow that differed between shards, with the tensor axis'
collectives inside, hangs XLA:CPU's collectives (seen: a compression's `lax.cond` taken by one
shard only).

The shards are the mesh's `data` x `fsdp` devices (`SHARDS`). Over `data` the weights are
replicated; over `fsdp` they stay split as the trainer holds them (`parallel.sharding.RULES`:
the hidden dim) and each part is gathered just before it runs, one layer at a time
(`fsdp_fetch`), so a sampler holds 1 / fsdp of the weights and one layer whole, never all of
them.

The cache of every shard is stacked on a new leading axis of length D, split over `data` (its
page tables hold shard-local page ids, its scalars, such as the free stack's top, are one per
shard); the slot state and each chunk's output keep their slot axis, split over `data` in
contiguous blocks, so global slot i lives on shard i // (S / D). The host admits requests per
shard (`admit` on each shard's slots and free pages).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparserl_jax.models.transformer import AS_STORED, Parts, head_logits
from sparserl_jax.parallel.sharding import state_shardings
from sparserl_jax.rollout.config import ChunkOut, RolloutConfig
from sparserl_jax.rollout.host import admit

SHARDS = ("data", "fsdp")  # the mesh axes that split the engine's slots and pages


def shard_axes(mesh: Mesh | None) -> tuple[str, ...]:
    """The axes of `mesh` its data shards are laid over (those of `SHARDS` it has, of more
    than one device)."""
    if mesh is None:
        return ()
    return tuple(a for a in SHARDS if a in mesh.axis_names and mesh.shape[a] > 1)


def slot_spec(mesh: Mesh | None) -> PartitionSpec:
    """The layout of a `[S, ...]` per-slot array (or a stack of shards' caches): its leading
    axis split over the shard axes."""
    axes = shard_axes(mesh)
    return PartitionSpec(None if not axes else axes[0] if len(axes) == 1 else axes)


def data_shards(mesh: Mesh | None) -> int:
    """How many data shards an engine on `mesh` runs (1: no split)."""
    return math.prod(int(mesh.shape[a]) for a in shard_axes(mesh))


def weight_specs(state: nnx.State, mesh: Mesh | None) -> Any:
    """Per weight (a pure dict like `nnx.to_pure_dict(state)`), its `PartitionSpec` on `mesh`
    (`parallel.sharding`) when some weight is split over a shard axis (`fsdp`); None when none
    is (every shard holds the weights whole, as over `data`)."""
    if data_shards(mesh) == 1:
        return None
    specs = jax.tree.map(
        lambda sh: sh.spec,
        nnx.to_pure_dict(state_shardings(state, mesh)),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    split = any(any(_part(s, SHARDS)) for s in jax.tree.leaves(specs, is_leaf=_is_spec))
    return specs if split else None


def _part(spec: PartitionSpec, axes: tuple[str, ...], keep: bool = True) -> PartitionSpec:
    """`spec` with only the mesh axes in `axes` (`keep`), or only the others."""

    def one(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        names = tuple(a for a in names if a is not None and (a in axes) == keep)
        return None if not names else names[0] if len(names) == 1 else names

    return PartitionSpec(*(one(e) for e in spec))


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


class FsdpParts(Parts):
    """`Transformer.decode`'s parts run from weights split over the shard axes (`specs`,
    `weight_specs`), inside `per_shard`:
    - each layer's weights gathered whole just before it runs, and kept split over the other
      axes as stored (with those automatic, XLA replicated every weight over `tensor` first).
      The barrier ties the gather to the activations the layer receives, so XLA cannot start
      every layer's gather at once (it did: a 16-layer loop held 1.5x all the gathered weights
      as temporaries; with the barrier, one layer's, measured with the TPU compiler);
    - the embedding and the head never gathered (the vocabulary-wide tables): each shard looks
      every shard's tokens up in its part of the hidden dim, and computes every shard's
      partial logits from its part; the rows travel (`all_to_all`, `psum_scatter`), not the
      tables. (Over `fsdp` the shards hold different slots: the rows must go home.)"""

    def __init__(self, specs: Any):
        self.specs = specs

    def layer(self, model, i, x_btd):
        part = model.layers[i]
        graphdef, state = nnx.split(part)
        local, x_btd = jax.lax.optimization_barrier((nnx.to_pure_dict(state), x_btd))
        full = jax.tree.map(_gather, self.specs["layers"][i], local, is_leaf=_is_spec)
        return nnx.merge(graphdef, full), x_btd

    def embed(self, model, tokens_bt):
        names = _part(self.specs["embed"]["embedding"], SHARDS)[1]  # [V, D]: D's split
        if names is None:
            return model.embed_tokens(tokens_bt)
        # Every shard's tokens, looked up in this shard's part of D, then each row sent home.
        every = functools.partial(jax.lax.all_gather, axis_name=names, axis=0, tiled=True)
        rows = jnp.take(model.embed.embedding[...], _per_device(every, tokens_bt), axis=0)
        home = functools.partial(
            jax.lax.all_to_all, axis_name=names, split_axis=0, concat_axis=2, tiled=True
        )
        return _per_device(home, rows).astype(model.cfg.compute_dtype)

    def logits(self, model, h_btd):
        cfg = model.cfg
        tied = cfg.tie_embeddings
        dim = 1 if tied else 0  # [V, D] tied, [D, V] untied: D's place
        spec = self.specs["embed"]["embedding"] if tied else self.specs["lm_head"]["kernel"]
        names = _part(spec, SHARDS)[dim]
        if names is None:
            return model.logits(h_btd)
        # Every shard's rows in this shard's part of D, their partial logits summed over the
        # parts, each row's sum kept by its own shard.
        mine = functools.partial(
            jax.lax.all_to_all, axis_name=names, split_axis=2, concat_axis=0, tiled=True
        )
        part = head_logits(
            _per_device(mine, h_btd), model.head_weight(), tied=tied, dtype=cfg.compute_dtype
        )
        home = functools.partial(
            jax.lax.psum_scatter, axis_name=names, scatter_dimension=0, tiled=True
        )
        vocab = _part(spec, SHARDS, keep=False)[1 - dim]
        return _per_device(home, part, PartitionSpec(None, None, vocab))


def _per_device(fn: Callable, x: jax.Array, spec: PartitionSpec | None = None) -> jax.Array:
    """`fn(x)` (collectives over the shard axes) with the other mesh axes manual too, `x` laid
    out as `spec` over them (with them automatic, XLA replicated every weight over `tensor`
    before gathering it over `fsdp`)."""
    mesh = jax.sharding.get_abstract_mesh()
    others = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)
    if not others:
        return fn(x)
    spec = PartitionSpec() if spec is None else spec
    return jax.shard_map(
        fn, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=others, check_vma=False
    )(x)


def engine_parts(specs: Any) -> Parts:
    """How the engine's programs run the model's parts on weights laid out as `specs`."""
    return AS_STORED if specs is None else FsdpParts(specs)


def _gather(spec: PartitionSpec, w: jax.Array) -> jax.Array:
    """`w`, split as `spec` says, gathered over the shard axes, still split over the others."""
    split = _part(spec, SHARDS)
    if not any(split):
        return w

    def body(w):
        for dim, names in enumerate(split):
            if names is not None:
                w = jax.lax.all_gather(w, names, axis=dim, tiled=True)
        return w

    return _per_device(body, w, _part(spec, SHARDS, keep=False))


def check_split(mesh: Mesh, num_slots: int, pool_pages: int, per_slot: int) -> None:
    """Check that slots and pages divide over `mesh`'s data shards and that a shard's pool can
    hold one sequence (one line naming the setting otherwise)."""
    d = data_shards(mesh)
    if num_slots % d or pool_pages % d:
        raise ValueError(
            f"rollout.num_slots={num_slots} and the pool's {pool_pages} pages must divide over "
            f"the mesh's data x fsdp axes ({d} shards: each shard holds its own slots and pages)"
        )
    if pool_pages // d < per_slot:
        raise ValueError(
            f"a data shard's pool ({pool_pages} / {d} = {pool_pages // d} pages) cannot hold one "
            f"sequence ({per_slot} pages): raise rollout.num_pages or lower mesh.data/fsdp"
        )


def jit_programs(
    mesh: Mesh | None, config: RolloutConfig, empty: Callable, impls: dict, specs: Any = None
):
    """The engine's jitted programs (init, prefill, chunk, refill), per data shard when the mesh
    has more than one (each holding the weights as `specs`, `weight_specs`, says). On a mesh
    the cache is laid out as its kernels split it (pools by KV head) and every program keeps
    that layout; built under jit so every leaf is its own buffer (eager creation shares zero
    arrays, which donation refuses)."""
    d = data_shards(mesh)
    programs = [impls["prefill"], impls["chunk"], impls["refill"], empty]
    if d > 1:
        check_split(mesh, config.num_slots, config.pool_pages, config.pages_per_slot)
        programs = [
            per_shard(f, mesh, n, specs) for f, n in zip(programs[:3], (2, 3, 2), strict=True)
        ]
        programs.append(init_per_shard(empty, mesh))
    out = chunk = None
    if mesh is not None:
        cache, slots = jax.eval_shape(empty)
        # The stacked caches split over the shards (each shard's own), the slot axis likewise.
        by_slot = NamedSharding(mesh, slot_spec(mesh))
        stacked = by_slot.spec[0]
        out = (cache.shardings(stacked=stacked), jax.tree.map(lambda _: by_slot, slots))
        chunk = (*out, ChunkOut(by_slot, by_slot, by_slot))
    init = jax.jit(programs[3], out_shardings=out)
    prefill, step, refill = (
        jax.jit(f, donate_argnums=(1, 2), out_shardings=o)
        for f, o in zip(programs[:3], (out, chunk, out), strict=True)
    )
    return init, prefill, step, refill


def _manual_shards() -> tuple[str, ...]:
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return tuple(a for a in SHARDS if a in manual)


def any_slot(x: jax.Array, d: int) -> jax.Array:
    """`jnp.any(x)` over every data shard (inside `per_shard`; plain `any` when d == 1)."""
    return shard_max(jnp.any(x).astype(jnp.int32), d) > 0


def shard_max(x: jax.Array, d: int) -> jax.Array:
    """The largest `x` of every data shard (inside `per_shard`; `x` when d == 1)."""
    return x if d == 1 else jax.lax.pmax(x, _manual_shards())


def per_shard(fn: Callable, mesh: Mesh, num_out: int, specs: Any = None) -> Callable:
    """`fn(params, cache, *rest)` run per data shard: params as `specs` (`weight_specs`; None:
    replicated over the shards), the stacked cache split on its leading axis (each shard sees
    its own cache, unstacked), every other argument and output split on its leading (slot)
    axis; the first output is the cache."""

    def body(params, cache, *rest):
        out = fn(params, jax.tree.map(lambda x: x[0], cache), *rest)
        return (jax.tree.map(lambda x: x[None], out[0]), *out[1:])

    spec = slot_spec(mesh)

    @functools.wraps(fn)
    def run(params, cache, *rest):
        held = PartitionSpec() if specs is None else _held(specs)
        in_specs = (held, spec) + (spec,) * len(rest)
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(spec,) * num_out,
            axis_names=frozenset(shard_axes(mesh)),
            check_vma=False,
        )(params, cache, *rest)

    return run


def _held(specs: Any) -> Any:
    """What a shard holds of each weight: its split over the shard axes only."""
    return jax.tree.map(lambda s: _part(s, SHARDS), specs, is_leaf=_is_spec)


def init_per_shard(empty: Callable, mesh: Mesh) -> Callable:
    """`empty()` -> (cache, slots) run per data shard: the caches stacked, the slots joined."""

    def body():
        cache, slots = empty()
        return jax.tree.map(lambda x: x[None], cache), slots

    return jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=slot_spec(mesh))


def shard_admit(slot_req, waiting, free_d, pages_s, config: RolloutConfig) -> np.ndarray:
    """`admit` on each data shard's slots (contiguous blocks, in shard order) within that
    shard's free pages `free_d`; returns the slots to prefill."""
    free_d = np.atleast_1d(free_d)  # one shard's free count is a scalar
    d, per_slot, pool_pages = len(free_d), config.pages_per_slot, config.pool_pages
    n = len(slot_req) // d
    fill = np.zeros(slot_req.shape, bool)
    for i in range(d):
        if not waiting:
            break
        block = slice(i * n, (i + 1) * n)  # views: admit writes slot_req in place
        fill[block] = admit(
            slot_req[block], waiting, free_d[i], pages_s[block], per_slot, pool_pages // d
        )
    return fill


def slot_record(evict_pos, d: int):
    """A stacked cache's eviction record `[D, Y', S / D, K', T]` as `[Y', S, K', T]` (on the
    host; unchanged when d == 1)."""
    if d == 1:
        return evict_pos
    x = np.asarray(jax.device_get(evict_pos))
    return np.moveaxis(x, 0, 1).reshape((x.shape[1], -1) + x.shape[3:])


def flat_slots(x: np.ndarray | jax.Array, d: int):
    """A stacked cache's per-slot field `[D, S / D, ...]` as `[S, ...]` (unchanged when d == 1)."""
    return x if d == 1 else x.reshape((-1,) + x.shape[2:])
