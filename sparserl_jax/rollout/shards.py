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

The cache of every shard is stacked on a new leading axis of length D, split over `data` (its
page tables hold shard-local page ids, its scalars, such as the free stack's top, are one per
shard); the slot state and each chunk's output keep their slot axis, split over `data` in
contiguous blocks, so global slot i lives on shard i // (S / D). The host admits requests per
shard (`admit` on each shard's slots and free pages).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparserl_jax.rollout.config import ChunkOut, RolloutConfig
from sparserl_jax.rollout.host import admit

DATA = "data"


def data_shards(mesh: Mesh | None) -> int:
    """How many data shards an engine on `mesh` runs (1: no split)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(DATA, 1))


def check_split(mesh: Mesh, num_slots: int, pool_pages: int, per_slot: int) -> None:
    """Check that slots and pages divide over `mesh`'s data shards and that a shard's pool can
    hold one sequence (one line naming the setting otherwise)."""
    d = data_shards(mesh)
    if num_slots % d or pool_pages % d:
        raise ValueError(
            f"rollout.num_slots={num_slots} and the pool's {pool_pages} pages must divide over "
            f"the mesh's data axis ({d} shards: each shard holds its own slots and pages)"
        )
    if pool_pages // d < per_slot:
        raise ValueError(
            f"a data shard's pool ({pool_pages} / {d} = {pool_pages // d} pages) cannot hold one "
            f"sequence ({per_slot} pages): raise rollout.num_pages or lower mesh.data"
        )


def jit_programs(mesh: Mesh | None, config: RolloutConfig, empty: Callable, impls: dict):
    """The engine's jitted programs (init, prefill, chunk, refill), per data shard when the mesh
    has more than one. On a mesh the cache is laid out as its kernels split it (pools by KV
    head) and every program keeps that layout; built under jit so every leaf is its own buffer
    (eager creation shares zero arrays, which donation refuses)."""
    d = data_shards(mesh)
    programs = [impls["prefill"], impls["chunk"], impls["refill"], empty]
    if d > 1:
        check_split(mesh, config.num_slots, config.pool_pages, config.pages_per_slot)
        programs = [per_shard(f, mesh, n) for f, n in zip(programs[:3], (2, 3, 2), strict=True)]
        programs.append(init_per_shard(empty, mesh))
    out = chunk = None
    if mesh is not None:
        cache, slots = jax.eval_shape(empty)
        # The stacked caches split over data (each shard's own), the slot axis likewise.
        by_slot = NamedSharding(mesh, PartitionSpec(DATA if d > 1 else None))
        stacked = DATA if d > 1 else None
        out = (cache.shardings(stacked=stacked), jax.tree.map(lambda _: by_slot, slots))
        chunk = (*out, ChunkOut(by_slot, by_slot, by_slot))
    init = jax.jit(programs[3], out_shardings=out)
    prefill, step, refill = (
        jax.jit(f, donate_argnums=(1, 2), out_shardings=o)
        for f, o in zip(programs[:3], (out, chunk, out), strict=True)
    )
    return init, prefill, step, refill


def any_slot(x: jax.Array, d: int) -> jax.Array:
    """`jnp.any(x)` over every data shard (inside `per_shard`; plain `any` when d == 1)."""
    got = jnp.any(x)
    if d == 1:
        return got
    return jax.lax.psum(got.astype(jnp.int32), DATA) > 0


def per_shard(fn: Callable, mesh: Mesh, num_out: int) -> Callable:
    """`fn(params, cache, *rest)` run per data shard: params replicated over `data`, the
    stacked cache split on its leading axis (each shard sees its own cache, unstacked), every
    other argument and output split on its leading (slot) axis; the first output is the cache."""

    def body(params, cache, *rest):
        out = fn(params, jax.tree.map(lambda x: x[0], cache), *rest)
        return (jax.tree.map(lambda x: x[None], out[0]), *out[1:])

    spec = PartitionSpec(DATA)

    @functools.wraps(fn)
    def run(params, cache, *rest):
        in_specs = (PartitionSpec(), spec) + (spec,) * len(rest)
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(spec,) * num_out,
            axis_names=frozenset({DATA}),
            check_vma=False,
        )(params, cache, *rest)

    return run


def init_per_shard(empty: Callable, mesh: Mesh) -> Callable:
    """`empty()` -> (cache, slots) run per data shard: the caches stacked, the slots joined."""

    def body():
        cache, slots = empty()
        return jax.tree.map(lambda x: x[None], cache), slots

    return jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=PartitionSpec(DATA))


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
