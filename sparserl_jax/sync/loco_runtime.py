"""DiLoCo / PULSELoCo replicas on a `(replica, data)` mesh: device groups or separate processes.

Row r of the mesh is replica r's device group; inside a group the inner steps are data parallel
over the `data` axis (gradients `pmean`-ed). One SPMD program serves both topologies:

  (a) one program: `replica_mesh(R)` over the local (e.g. fake CPU) devices;
  (b) several processes joined by `jax.distributed` (`init_cpu_distributed` on localhost with the
      gloo CPU collectives): the mesh spans every process's devices, each process feeds the
      batches of the replicas it owns and the collectives run across processes.

A round is three jitted programs:

  1. `shard_map` over the replica groups: start from the replicated global θ (this *is* the reset
     to the new global weights), run H inner optimizer steps (`lax.scan`), form Δ = θ − θ_r and,
     for PULSELoCo, the error feedback and gate (`loco.prepare_payload`); all-gather the entry
     counts across the replica axis (counts first: they fix the padded payload shape);
  2. the payload exchange, with the max count as a static size. Coded payloads (the default,
     `loco_wire.CodedExchange`): every process encodes its replicas' sent entries on the host
     (`loco_codec`), all-gathers the bytes over the replica axis and decodes every replica's
     (index, value) rows, reduced by `loco.mean_of_payloads` (replicas in a fixed order).
     Uncoded payloads: `shard_map` again, compacting each replica's payload to value rows (fp32
     or bf16) padded to that size plus their positions (int32 index rows, or the packed gate
     when that is smaller: `LoCoConfig.payload_format`), `lax.all_gather` over the replica axis
     and the same mean. DiLoCo all-gathers the dense Δ rows instead (`loco.mean_of_dense`);
  3. the outer Nesterov step on the replicated θ, an identical program for both methods.

Every device computes the same replicated θ from the same gathered rows in the same order, so all
replicas (and all processes) hold the same bits. The inner AdamW state and the residual e persist
per replica across rounds (DiLoCo keeps the inner optimizer state).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.sync import loco, loco_codec
from sparserl_jax.sync.loco_wire import REPLICA_AXIS, CodedExchange

DATA_AXIS = "data"

LossFn = Callable[[Any, Any], jax.Array]


def init_cpu_distributed(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    timeout_s: int = 60,
) -> None:
    """`jax.distributed.initialize`, with gloo CPU collectives (None: what JAX detects, e.g. on
    TPU pods and SLURM; the gloo setting only concerns the CPU backend).

    Must run before anything touches a JAX backend. JAX 0.10/0.11 select the CPU collectives by
    `jax_cpu_collectives_implementation` (gloo is the default there; set anyway, so an older
    default of "none" cannot turn the all-gathers into an error).
    """
    if "jax_cpu_collectives_implementation" in jax.config.values:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
    )


def replica_mesh(replicas: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh `(replica, data)`: R equal device groups, devices ordered by (process, id)."""
    devices = sorted(devices or jax.devices(), key=lambda d: (d.process_index, d.id))
    if replicas < 1 or len(devices) % replicas:
        raise ValueError(
            f"cannot split {len(devices)} devices into {replicas} equal replica groups; "
            f"replicas must be >= 1 and divide the device count"
        )
    grid = np.asarray(devices, dtype=object).reshape(replicas, -1)
    return Mesh(grid, (REPLICA_AXIS, DATA_AXIS))


@dataclasses.dataclass(frozen=True)
class RoundStats:
    """What one round did. Bytes are summed over all R replicas (sizes in `loco`)."""

    round: int
    counts: tuple[int, ...]  # entries each replica sent (P each for DiLoCo)
    payload_format: str  # "coded", "index" or "bitmask" (PULSELoCo), "dense" (DiLoCo)
    sent_bytes: int  # payload bytes actually needed (coded: the encoded blobs' lengths)
    padded_bytes: int  # bytes of the padded all-gather inputs
    diloco_bytes: int  # dense fp32 pseudo-gradients of the same round, for comparison
    inner_loss: float  # mean training loss over all replicas and the H inner steps
    position_bytes: int = 0  # of sent_bytes: positions (coded gaps, int32 indices or bitmasks)
    value_bytes: int = 0  # of sent_bytes: values
    gate_entropy_bits: float = 0.0  # sum over replicas of P * H2(count / P)
    context_entropy_bits: float | None = None  # the same given θ's exponents (coded only)


class LoCoTrainer:
    """DiLoCo / PULSELoCo over the replica groups of `mesh` (see the module docstring).

    `loss_fn(params, batch) -> scalar` is a pure function of a float32 parameter tree (the batch
    is this device's slice of the group's batch); `inner_tx` is the inner optimizer (AdamW for
    DiLoCo). Every process builds the trainer with the same `params` and calls `round` in step.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        params: Any,
        inner_tx: optax.GradientTransformation,
        config: loco.LoCoConfig,
        *,
        mesh: Mesh,
    ):
        if tuple(mesh.axis_names) != (REPLICA_AXIS, DATA_AXIS):
            raise ValueError(
                f"mesh axes must be {(REPLICA_AXIS, DATA_AXIS)}, got {mesh.axis_names}"
            )
        dtypes = {jnp.dtype(x.dtype).name for x in jax.tree.leaves(params)}
        if dtypes != {"float32"}:
            raise ValueError(f"LoCo needs float32 master weights; got leaf dtypes {sorted(dtypes)}")
        self.config, self.mesh = config, mesh
        self.replicas = mesh.shape[REPLICA_AXIS]
        flat, self._unravel = ravel_pytree(jax.tree.map(np.asarray, params))
        self.num_params = int(flat.size)
        if self.num_params > loco.MAX_PARAMS:
            raise ValueError(
                f"{self.num_params} parameters exceed int32 indices ({loco.MAX_PARAMS})"
            )
        self._loss_fn, self._inner_tx = loss_fn, inner_tx
        self._outer_tx = config.outer_optimizer()
        rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(REPLICA_AXIS))
        self._batch_sharding = NamedSharding(mesh, P(REPLICA_AXIS, None, DATA_AXIS))
        me = jax.process_index()
        self.local = [
            r for r in range(self.replicas) if all(d.process_index == me for d in mesh.devices[r])
        ]

        host = np.asarray(flat, np.float32)
        self.theta = jax.make_array_from_callback(host.shape, rep, lambda idx: host[idx])
        self.outer_state = jax.jit(self._outer_tx.init, out_shardings=rep)(self.theta)
        self.opt_state = jax.jit(self._init_inner, out_shardings=rows)(self.theta)
        self.residual = None
        if config.method == "pulseloco":
            zeros = functools.partial(jnp.zeros, (self.replicas, self.num_params), jnp.float32)
            self.residual = jax.jit(zeros, out_shardings=rows)()
        self.rounds_done = 0
        self.last_local: jax.Array | None = None  # [R, P] replica weights before the last reset

        # check_vma=False below: `lax.all_gather` results are replicated over the replica axis,
        # which the varying-axes checker cannot infer (no invariant all-gather on JAX 0.10).
        spec_r, batch_spec = P(REPLICA_AXIS), self._batch_sharding.spec
        self._inner = jax.jit(
            jax.shard_map(
                self._inner_body, mesh=mesh, in_specs=(P(), spec_r, batch_spec),
                out_specs=(spec_r, spec_r, P()), check_vma=False,
            )
        )  # fmt: skip
        self._prepare = jax.jit(
            jax.shard_map(
                self._prepare_body, mesh=mesh, in_specs=(P(), spec_r, spec_r),
                out_specs=(spec_r, spec_r, spec_r, P()), check_vma=False,
            )
        )  # fmt: skip
        self._coded = CodedExchange(mesh, config, self.num_params)
        self._mean = jax.jit(
            lambda index_rn, value_rn: loco.mean_of_payloads(index_rn, value_rn, self.num_params),
            out_shardings=rep,
        )
        reduce_in = (spec_r, spec_r) if config.method == "pulseloco" else (P(), spec_r)
        self._reduce = jax.jit(
            lambda *rows_in, size, fmt: jax.shard_map(
                functools.partial(self._reduce_body, size=size, fmt=fmt),
                mesh=mesh, in_specs=reduce_in, out_specs=P(), check_vma=False,
            )(*rows_in),
            static_argnames=("size", "fmt"),
        )  # fmt: skip
        # Inner steps, payload, mean and outer step are separate programs on purpose: XLA:CPU
        # contracts mul+add into FMA depending on what surrounds an op (and drops optimization
        # barriers), so only program boundaries keep each stage's bits independent of the others;
        # e.g. gate-off PULSELoCo then equals DiLoCo bit for bit.
        self._outer = jax.jit(
            functools.partial(loco.outer_update, self._outer_tx), out_shardings=(rep, rep)
        )

    # --- the SPMD bodies -----------------------------------------------------------------------

    def _init_inner(self, theta):
        state = self._inner_tx.init(self._unravel(theta))
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.replicas, *x.shape)), state)

    def _inner_steps(self, theta, opt_state, batches):
        """H inner steps from θ (the reset) on this group's batches; grads averaged over `data`."""

        def step(carry, batch):
            p, o = carry
            loss, grads = jax.value_and_grad(self._loss_fn)(p, batch)
            grads, loss = lax.pmean((grads, loss), DATA_AXIS)
            updates, o = self._inner_tx.update(grads, o, p)
            return (optax.apply_updates(p, updates), o), loss

        (params, opt_state), loss_h = lax.scan(step, (self._unravel(theta), opt_state), batches)
        return ravel_pytree(params)[0], opt_state, loss_h

    def _inner_body(self, theta, opt_state, batches):
        # Inside shard_map every per-replica array has a leading axis of size 1.
        first = functools.partial(jax.tree.map, lambda x: x[0])
        local, opt_state, loss_h = self._inner_steps(theta, first(opt_state), first(batches))
        stacked = jax.tree.map(lambda x: x[None], opt_state)
        return local[None], stacked, lax.all_gather(loss_h, REPLICA_AXIS)

    def _prepare_body(self, theta, local, residual):
        cfg = self.config
        sent, residual, mask, count = loco.prepare_payload(
            theta, local[0], residual[0], gate=cfg.gate, gate_dtype=cfg.jnp_gate_dtype,
            value_dtype=cfg.value_dtype,
        )  # fmt: skip
        # Counts first: the max over replicas is the static size of the payload all-gather.
        return residual[None], sent[None], mask[None], lax.all_gather(count, REPLICA_AXIS)

    def _reduce_body(self, a, b, *, size: int, fmt: str):
        if self.config.method == "diloco":
            theta, local = a, b[0]
            return loco.mean_of_dense(
                lax.all_gather(loco.pseudo_gradient(theta, local), REPLICA_AXIS)
            )
        sent, mask = a[0], b[0]
        index_n, value_n = loco.compact(mask, sent, size=size)
        # bf16 values travel as bf16 (exact: `loco.split_bf16` made them bf16 values).
        wire = jnp.dtype(self.config.value_dtype)
        value_rn = lax.all_gather(value_n.astype(wire), REPLICA_AXIS).astype(jnp.float32)
        if fmt == "bitmask":
            # The packed gate travels instead of the indices; every receiver re-derives the
            # same sorted indices from it.
            packed_rm = lax.all_gather(loco.pack_mask(mask), REPLICA_AXIS)
            index_rn = jnp.stack([
                loco.mask_indices(loco.unpack_mask(packed_rm[r], self.num_params), size)
                for r in range(self.replicas)
            ])  # fmt: skip
        else:
            index_rn = lax.all_gather(index_n, REPLICA_AXIS)
        return loco.mean_of_payloads(index_rn, value_rn, self.num_params)

    # --- the round -----------------------------------------------------------------------------

    def _put_batches(self, batches: Mapping[int, Any]) -> Any:
        """Local replicas' `[H, B, ...]` batches -> one global `[R, H, B, ...]` array per leaf."""
        missing = [r for r in self.local if r not in batches]
        if missing:
            raise ValueError(f"batches missing for local replicas {missing}")
        per_r = {r: jax.tree.leaves(batches[r]) for r in self.local}
        treedef = jax.tree.structure(batches[self.local[0]])
        out = []
        for k, leaf in enumerate(per_r[self.local[0]]):
            if leaf.shape[0] != self.config.inner_steps:
                raise ValueError(
                    f"batches need leading axis H={self.config.inner_steps}, got shape {leaf.shape}"
                )
            host = {r: np.asarray(per_r[r][k]) for r in self.local}

            def piece(index, host=host):
                r = index[0].start or 0
                return host[r][None][(slice(None), *index[1:])]

            shape = (self.replicas, *leaf.shape)
            out.append(jax.make_array_from_callback(shape, self._batch_sharding, piece))
        return jax.tree.unflatten(treedef, out)

    def round(self, batches: Mapping[int, Any]) -> RoundStats:
        """One outer round. `batches[r]` for each local replica r: a pytree, leading axis H."""
        cfg, R, num = self.config, self.replicas, self.num_params
        batches = self._put_batches(batches)
        local, self.opt_state, losses = self._inner(self.theta, self.opt_state, batches)
        extra = {}
        if cfg.method == "pulseloco":
            self.residual, sent, mask, counts_r = self._prepare(self.theta, local, self.residual)
            counts = [int(c) for c in np.asarray(counts_r.addressable_data(0))]
            padded = cfg.padded_count(max(counts))
            fmt = cfg.payload_format(num, padded)
            entropy = sum(loco_codec.gate_entropy_bits(n, num) for n in counts)
            if fmt == "coded":
                coded = self._coded(self.theta, sent, mask, padded)
                grad = self._mean(*(self._replicated(x) for x in (coded.index_rn, coded.value_rn)))
                sent_bytes = loco.coded_payload_bytes(coded.blob_bytes)
                padded_bytes = R * (loco.COUNT_BYTES + coded.padded_length)
                extra = dict(
                    position_bytes=coded.position_bytes, value_bytes=coded.value_bytes,
                    context_entropy_bits=coded.context_entropy_bits,
                )  # fmt: skip
            else:
                grad = self._reduce(sent, mask, size=padded, fmt=fmt)
                sent_bytes = loco.payload_bytes(counts, num, fmt, cfg.value_bytes)
                padded_bytes = loco.padded_payload_bytes(R, padded, num, fmt, cfg.value_bytes)
                values = sum(counts) * cfg.value_bytes
                extra = dict(position_bytes=sent_bytes - values - R * loco.COUNT_BYTES)
                extra["value_bytes"] = values
            extra["gate_entropy_bits"] = entropy
        else:
            fmt = "dense"
            grad = self._reduce(self.theta, local, size=num, fmt=fmt)
            counts = [num] * R
            sent_bytes = padded_bytes = loco.diloco_bytes(num, R)
        self.last_local = local
        self.theta, self.outer_state = self._outer(self.theta, self.outer_state, grad)
        self.rounds_done += 1
        return RoundStats(
            round=self.rounds_done,
            counts=tuple(counts),
            payload_format=fmt,
            sent_bytes=sent_bytes,
            padded_bytes=padded_bytes,
            diloco_bytes=loco.diloco_bytes(num, R),
            inner_loss=float(np.asarray(losses.addressable_data(0)).mean()),
            **extra,
        )

    def _replicated(self, host: np.ndarray) -> jax.Array:
        """A host array every process holds identically, as a replicated global array."""
        rep = NamedSharding(self.mesh, P())
        return jax.make_array_from_callback(host.shape, rep, lambda idx: host[idx])

    # --- checkpoints ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything the next round depends on, as a pytree of arrays (with their shardings):
        θ, the outer optimizer state, every replica's inner optimizer state and, for PULSELoCo,
        every replica's residual. Save it with `checkpoint.CheckpointManager` beside `meta()`."""
        out = {"theta": self.theta, "outer": self.outer_state, "inner": self.opt_state}
        if self.residual is not None:
            out["residual"] = self.residual
        return out

    def meta(self) -> dict[str, Any]:
        """The JSON half of a checkpoint: the round count and what the state must match."""
        return {
            "rounds_done": self.rounds_done,
            "method": self.config.method,
            "replicas": self.replicas,
            "num_params": self.num_params,
        }

    def load_state(self, state: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Resume from `state()` / `meta()` of a trainer built the same way (restore with
        `CheckpointManager.restore_latest(trainer.state())`). The next round is then bit-identical
        to the one an uninterrupted run would do. A checkpoint of another method, replica count or
        model is refused before anything changes."""
        expect = self.meta()
        for key in ("method", "replicas", "num_params"):
            if meta.get(key) != expect[key]:
                raise ValueError(
                    f"checkpoint has {key}={meta.get(key)!r} but this trainer has "
                    f"{key}={expect[key]!r}; it belongs to a different run"
                )
        mine = self.state()
        if jax.tree.structure(state) != jax.tree.structure(mine):
            raise ValueError(
                f"checkpoint state has structure {jax.tree.structure(state)}, expected "
                f"{jax.tree.structure(mine)}"
            )
        for (path, got), want in zip(
            jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(mine), strict=True
        ):
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ValueError(
                    f"checkpoint leaf {jax.tree_util.keystr(path)} is {got.dtype}{got.shape}, "
                    f"expected {want.dtype}{want.shape}"
                )
        put = functools.partial(jax.tree.map, lambda x, ref: jax.device_put(x, ref.sharding))
        self.theta = put(state["theta"], self.theta)
        self.outer_state = put(state["outer"], self.outer_state)
        self.opt_state = put(state["inner"], self.opt_state)
        if self.residual is not None:
            self.residual = put(state["residual"], self.residual)
        self.rounds_done = int(meta["rounds_done"])

    # --- inspection ----------------------------------------------------------------------------

    def global_params(self) -> Any:
        """The global θ as a host parameter tree (this process's replicated copy)."""
        return self._unravel(np.asarray(self.theta.addressable_data(0)))

    def global_params_flat(self) -> np.ndarray:
        """The global θ as this process's flat fp32 host vector (`ravel_pytree` order)."""
        return np.asarray(self.theta.addressable_data(0))

    def global_digest(self) -> str:
        """SHA-256 of the global θ's fp32 bytes: equal digests mean bit-identical weights."""
        return hashlib.sha256(np.asarray(self.theta.addressable_data(0)).tobytes()).hexdigest()

    def replica_digests(self) -> dict[int, str]:
        """SHA-256 of the θ copy every local replica starts its next round from (per device).

        Each device of each local group computes the outer step itself; the digests of all its
        devices must agree, or the replica's entry is "mismatch".
        """
        by_device = {
            s.device: hashlib.sha256(np.asarray(s.data).tobytes()).hexdigest()
            for s in self.theta.addressable_shards
        }
        out = {}
        for r in self.local:
            digests = {by_device[d] for d in self.mesh.devices[r]}
            out[r] = digests.pop() if len(digests) == 1 else "mismatch"
        return out
