"""The rollout engine's data shards: on a mesh whose `data` axis has D > 1 devices, each data
shard holds its own S / D slots, its own page pool of P / D pages and its own free-page stack.

The engine's device programs (prefill, decode chunk, refill) then run per data shard under
`shard_map` over `data` (and `fsdp`, below) alone (`tensor` stays automatic: the weights, heads,
MLP columns and vocabulary are split over it by the model's logical axes, and the pools over KV
heads where their count divides by it). Nothing crosses data shards but three small decisions:
in decode, whether any slot of any shard is still live and whether any row of any shard is due
for compression (one boolean each per step); in prefill, the most slots any shard fills. So every
device runs the same program: the same steps, compressions and prefill groups (a shard with
nothing to do runs them as no-ops). That is what one device would do (the compression interval
counts the batch's steps), so tokens equal one device's for the same keys, since a request's keys
do not depend on its slot; and control flow that differed between shards, with the tensor axis'
collectives inside, hangs XLA:CPU's collectives (seen: a compression's `lax.cond` taken by one
shard only).

With `rollout.fsdp_shards` the shards are the mesh's `data` x `fsdp` devices (`SHARDS`). Over
`data` the weights are replicated; over `fsdp` they stay split as the trainer holds them
(`parallel.sharding.RULES`: the hidden dim) and are never gathered: each matmul moves the rows
of the fsdp shards instead (`FsdpParts`), so a sampler holds 1 / fsdp of the weights. Without
it, an fsdp axis is left to XLA (weights split over it are gathered as XLA sees fit).

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
from sparserl_jax.parallel.sharding import logical_to_spec, state_shardings
from sparserl_jax.rollout.config import ChunkOut, RolloutConfig
from sparserl_jax.rollout.host import admit

SHARDS = ("data", "fsdp")  # the mesh axes that split the engine's slots and pages


def shard_axes(mesh: Mesh | None, fsdp: bool = False) -> tuple[str, ...]:
    """The axes of `mesh` the data shards are laid over: `data`, and `fsdp` with `fsdp`
    (`rollout.fsdp_shards`), those of more than one device."""
    if mesh is None:
        return ()
    names = SHARDS if fsdp else SHARDS[:1]
    return tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)


def slot_spec(mesh: Mesh | None, fsdp: bool = False) -> PartitionSpec:
    """The layout of a `[S, ...]` per-slot array (or a stack of shards' caches): its leading
    axis split over the shard axes."""
    axes = shard_axes(mesh, fsdp)
    return PartitionSpec(None if not axes else axes[0] if len(axes) == 1 else axes)


def data_shards(mesh: Mesh | None, fsdp: bool = False) -> int:
    """How many data shards an engine on `mesh` runs (1: no split)."""
    return math.prod(int(mesh.shape[a]) for a in shard_axes(mesh, fsdp))


def weight_specs(state: nnx.State, mesh: Mesh | None, fsdp: bool = False) -> Any:
    """Per weight (a pure dict like `nnx.to_pure_dict(state)`), its `PartitionSpec` on `mesh`
    (`parallel.sharding`) when the shards include `fsdp` and some weight is split over it;
    None else (every shard holds the weights whole, as over `data`)."""
    if not fsdp or "fsdp" not in shard_axes(mesh, fsdp):
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
    """`Transformer.decode`'s parts run from weights split over `fsdp` by their hidden dim
    (`specs`, `weight_specs`), inside `per_shard`, where each fsdp shard holds other slots.
    No weight is ever gathered: the rows travel instead (a decode step's rows are a few KB; a
    layer's weights, tens of MB).
    - A matmul whose weight's hidden dim is contracted (q, k, v, gate, up): every shard's rows
      in this shard's part of the hidden dim (`all_to_all`), their partial products, summed
      over the parts with each row's sum sent home (`psum_scatter`).
    - One whose weight's hidden dim is the output (o, down): every shard's rows
      (`all_gather`), this shard's part of their outputs, each row's parts sent home
      (`all_to_all`).
    - The embedding likewise: every shard's tokens looked up in this shard's part of the table,
      the rows sent home; the head like a contracted matmul.
    (Gathering each layer's weights instead cost the 7B decode chunk 0.55 GiB of temporaries
    per chip: XLA relayouts every layer's `down_proj` part to gather it on its minor dim.)"""

    def __init__(self, specs: Any, hidden_size: int, mesh: Mesh):
        self.specs = specs
        self.hidden = hidden_size
        self.names = _split_names(specs)
        names = self.names if isinstance(self.names, tuple) else (self.names,)
        self.shards = math.prod(int(mesh.shape[n]) for n in names)

    def layer(self, model, i):
        # Vectors split by the hidden dim (`o_bias`, `down_bias`) are added whole: gathered.
        specs, part = self.specs["layers"][i], model.layers[i]
        graphdef, state = nnx.split(part)
        local = nnx.to_pure_dict(state)
        vectors = jax.tree.map(
            lambda s, w: _gather(s, w) if w.ndim == 1 else w, specs, local, is_leaf=_is_spec
        )
        return nnx.merge(graphdef, vectors)

    def dot(self, spec, x, w):
        value = w[...].astype(x.dtype)
        meta = w.get_metadata()
        axes = meta.get("logical_axes") or ()
        dim = axes.index("embed") if "embed" in axes else None
        if dim is None or value.shape[dim] == self.hidden:  # not split
            return jnp.einsum(spec, x, value)
        ins, out = spec.split("->")
        x_axes, w_axes = ins.split(",")
        hidden = w_axes[dim]
        # The other axes (tensor) as the weight is split over them, by einsum letter: the
        # activations keep that layout through the collectives (laid out whole, the MLP's
        # [rows, T, F] products were held unsplit: prefill 0.48 GiB of temporaries at 7B).
        whole = value.shape[:dim] + (self.hidden,) + value.shape[dim + 1 :]
        mesh = jax.sharding.get_abstract_mesh()
        full = logical_to_spec(axes, whole, mesh, units=meta.get("shard_units"))
        by_letter = dict(zip(w_axes, _part(full, SHARDS, keep=False), strict=True))
        x_spec = PartitionSpec(*(by_letter.get(a) for a in x_axes))
        y_spec = PartitionSpec(*(by_letter.get(a) for a in out))
        go = functools.partial
        if hidden in out:  # every shard's rows, this part of their outputs, sent home
            every = _per_device(go(_all_rows, names=self.names), x, x_spec)
            y = jnp.einsum(spec, every, value)
            return _per_device(go(_home, names=self.names, axis=out.index(hidden)), y, y_spec)
        mine = go(_my_part, names=self.names, axis=x_axes.index(hidden))
        y = jnp.einsum(spec, _per_device(mine, x, x_spec), value)
        return _per_device(go(_sum_home, names=self.names), y, y_spec)

    def embed(self, model, tokens_bt):
        if _part(self.specs["embed"]["embedding"], SHARDS)[1] is None:  # [V, D]: D not split
            return model.embed_tokens(tokens_bt)
        every = _per_device(functools.partial(_all_rows, names=self.names), tokens_bt)
        rows = jnp.take(model.embed.embedding[...], every, axis=0)
        home = _per_device(functools.partial(_home, names=self.names, axis=2), rows)
        return home.astype(model.cfg.compute_dtype)

    def logits(self, model, h_btd):
        cfg = model.cfg
        tied = cfg.tie_embeddings
        dim = 1 if tied else 0  # [V, D] tied, [D, V] untied: D's place
        spec = self.specs["embed"]["embedding"] if tied else self.specs["lm_head"]["kernel"]
        if _part(spec, SHARDS)[dim] is None:
            return model.logits(h_btd)
        mine = _per_device(functools.partial(_my_part, names=self.names, axis=2), h_btd)
        part = head_logits(mine, model.head_weight(), tied=tied, dtype=cfg.compute_dtype)
        vocab = _part(spec, SHARDS, keep=False)[1 - dim]
        home = functools.partial(_sum_home, names=self.names)
        return _per_device(home, part, PartitionSpec(None, None, vocab))


def _split_names(specs: Any) -> str | tuple[str, ...]:
    """The shard axes that split the weights (`fsdp`), as a collective's axis name."""
    found = {
        e
        for s in jax.tree.leaves(specs, is_leaf=_is_spec)
        for e in _part(s, SHARDS)
        if e is not None
    }
    if len(found) != 1:
        raise ValueError(f"weights split over several shard axis groups: {sorted(found)}")
    return found.pop()


def _all_rows(x, *, names):
    """Every shard's rows (the leading axis), in shard order."""
    return jax.lax.all_gather(x, names, axis=0, tiled=True)


def _home(y, *, names, axis):
    """Every shard's rows with this shard's part of `axis` -> this shard's rows, whole."""
    return jax.lax.all_to_all(y, names, split_axis=0, concat_axis=axis, tiled=True)


def _my_part(x, *, names, axis):
    """This shard's rows, whole on `axis` -> every shard's rows, this shard's part of `axis`."""
    return jax.lax.all_to_all(x, names, split_axis=axis, concat_axis=0, tiled=True)


def _sum_home(y, *, names):
    """Every shard's rows, partial sums -> this shard's rows, summed over the shards."""
    return jax.lax.psum_scatter(y, names, scatter_dimension=0, tiled=True)


def _per_device(fn: Callable, x: jax.Array, spec: PartitionSpec | None = None) -> jax.Array:
    """`fn(x)` (collectives over the shard axes) with the other mesh axes manual too, `x` laid
    out as `spec` over them (with them automatic, an `all_gather` over `fsdp` had XLA
    replicate its operand over `tensor` first)."""
    mesh = jax.sharding.get_abstract_mesh()
    others = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)
    if not others:
        return fn(x)
    spec = PartitionSpec() if spec is None else spec
    return jax.shard_map(
        fn, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=others, check_vma=False
    )(x)


def engine_parts(specs: Any, hidden_size: int, mesh: Mesh | None) -> Parts:
    """How the engine's programs run the model's parts on weights laid out as `specs`."""
    return AS_STORED if specs is None else FsdpParts(specs, hidden_size, mesh)


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


def check_split(
    mesh: Mesh, num_slots: int, pool_pages: int, per_slot: int, fsdp: bool = False
) -> None:
    """Check that slots and pages divide over `mesh`'s data shards and that a shard's pool can
    hold one sequence (one line naming the setting otherwise)."""
    d = data_shards(mesh, fsdp)
    axes = "data x fsdp axes" if fsdp else "data axis"
    if num_slots % d or pool_pages % d:
        raise ValueError(
            f"rollout.num_slots={num_slots} and the pool's {pool_pages} pages must divide over "
            f"the mesh's {axes} ({d} shards: each shard holds its own slots and pages)"
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
    fsdp = config.fsdp_shards
    d = data_shards(mesh, fsdp)
    programs = [impls["prefill"], impls["chunk"], impls["refill"], empty]
    if d > 1:
        check_split(mesh, config.num_slots, config.pool_pages, config.pages_per_slot, fsdp)
        programs = [
            per_shard(f, mesh, n, specs, fsdp) for f, n in zip(programs[:3], (2, 3, 2), strict=True)
        ]
        programs.append(init_per_shard(empty, mesh, fsdp))
    out = chunk = None
    if mesh is not None:
        cache, slots = jax.eval_shape(empty)
        # The stacked caches split over the shards (each shard's own), the slot axis likewise.
        by_slot = NamedSharding(mesh, slot_spec(mesh, fsdp))
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


def per_shard(
    fn: Callable, mesh: Mesh, num_out: int, specs: Any = None, fsdp: bool = False
) -> Callable:
    """`fn(params, cache, *rest)` run per data shard: params as `specs` (`weight_specs`; None:
    replicated over the shards), the stacked cache split on its leading axis (each shard sees
    its own cache, unstacked), every other argument and output split on its leading (slot)
    axis; the first output is the cache."""

    def body(params, cache, *rest):
        out = fn(params, jax.tree.map(lambda x: x[0], cache), *rest)
        return (jax.tree.map(lambda x: x[None], out[0]), *out[1:])

    spec = slot_spec(mesh, fsdp)

    @functools.wraps(fn)
    def run(params, cache, *rest):
        held = PartitionSpec() if specs is None else _held(specs)
        in_specs = (held, spec) + (spec,) * len(rest)
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(spec,) * num_out,
            axis_names=frozenset(shard_axes(mesh, fsdp)),
            check_vma=False,
        )(params, cache, *rest)

    return run


def _held(specs: Any) -> Any:
    """What a shard holds of each weight: its split over the shard axes only."""
    return jax.tree.map(lambda s: _part(s, SHARDS), specs, is_leaf=_is_spec)


def init_per_shard(empty: Callable, mesh: Mesh, fsdp: bool = False) -> Callable:
    """`empty()` -> (cache, slots) run per data shard: the caches stacked, the slots joined."""

    def body():
        cache, slots = empty()
        return jax.tree.map(lambda x: x[None], cache), slots

    return jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=slot_spec(mesh, fsdp))


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
