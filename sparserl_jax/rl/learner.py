"""The learner step: PPO-clip on GRPO-family advantages, Sparse-RL correction, DGG, AdamW.

One `jax.jit` per step, with explicit `NamedSharding`s on a (data, fsdp, tensor) mesh and the
learner state donated. Inside it:

1. the Sparse-RL correction and the loss denominators are computed on the *whole* batch
   (they depend only on pi_old, mu and the masks), so gradient accumulation is exact (on a
   batch's first pass pi_old may come from the step's own forward instead: `rl.objective`
   says how the batch statistics are then applied after the micro-batches);
2. the batch is split into micro-batches and gradients are accumulated with `lax.scan`;
3. the lm_head gradient energy is read before clipping (tied embeddings: only the output
   projection's part, by differentiating the head's use of the shared matrix separately);
4. non-finite gradients skip the step (counted); DGG may discard the update (counted);
   otherwise gradients are clipped by global norm and AdamW is applied.

Parameters are a pure dict of fp32 master weights from `nnx.split(model)`; the model's config
decides the compute dtype (bf16 for speed, fp32 for tests). Per-token arrays are aligned with
`tokens_bt` (entry t is about token t; column 0 is never a response token), as the engine records.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from sparserl_jax.models.attention import with_attention_mesh
from sparserl_jax.models.transformer import check_token_ids
from sparserl_jax.parallel import batch_sharding, batch_shards, state_shardings
from sparserl_jax.rl.config import LearnerConfig
from sparserl_jax.rl.correction import correction_step_metrics, sparse_rl_weights
from sparserl_jax.rl.gating import (
    DGGState,
    GradientGate,
    dynamic_gradient_gating,
    lm_head_grad_energy,
)
from sparserl_jax.rl.objective import (
    METRICS,
    first_pass_fallback,
    first_pass_scales,
    micro_inputs,
    mini_batches,
    replayed_evictions,
    scale_sums,
    with_embedding,
)
from sparserl_jax.rl.objective import micro_loss as _micro_loss
from sparserl_jax.rollout.logprobs import (
    join_micro_batches,
    split_micro_batches,
    teacher_forced_logprobs,
)


class RLBatch(NamedTuple):
    """One rollout batch. `old_logp_bt` (pi_old) must be filled before `Learner.step` (see
    `Learner.logprobs`); `Learner.first_pass` and `train_on_batch` can take it from the first
    pass's forward. `ref_logp_bt` is needed only when the KL coefficient is > 0."""

    tokens_bt: Int[Array, "B T"]
    mask_bt: Bool[Array, "B T"]
    advantages_b: Float[Array, " B"]
    sampler_logp_bt: Float[Array, "B T"]
    old_logp_bt: Float[Array, "B T"] | None = None
    ref_logp_bt: Float[Array, "B T"] | None = None
    evict_pos_bykt: Int[Array, "B Y K T"] | None = None  # replayed: learner.attention_mask
    after_eviction_bt: Bool[Array, "B T"] | None = None  # the rho percentiles' tokens (sparse)


class LearnerState(NamedTuple):
    """Everything a step reads and writes (and a checkpoint must hold)."""

    params: Any
    opt_state: Any
    gate: DGGState
    step: Int[Array, ""]
    nonfinite_steps: Int[Array, ""]
    gate_fires: Int[Array, ""]


def train_step(
    state: LearnerState,
    batch: RLBatch,
    pass_index: Int[Array, ""],
    rows_energy: Float[Array, ""],
    *,
    graphdef: nnx.GraphDef,
    config: LearnerConfig,
    tx: optax.GradientTransformation,
    gate: GradientGate,
    tied: bool,
    micro_sharding: NamedSharding | None = None,
    param_shardings: Any = None,
    first_pass: bool = False,
) -> tuple[LearnerState, dict[str, jax.Array]] | tuple[LearnerState, dict, jax.Array]:
    """One pure learner update on `batch` (`pass_index`: 1-based reuse pass of this batch;
    `rows_energy`: the lm_head energy these rows gave at their previous pass, for the gate).

    `micro_sharding` (the `[B]` batch sharding) and `param_shardings` pin the layouts of the
    micro-batches and of the gradient accumulator when running on a mesh.

    `first_pass=True`: `batch.old_logp_bt` is ignored; pi_old is taken from this update's own
    forward at `state.params` (`rl.objective`) and returned as a third output. Callers must
    check `objective.first_pass_fallback(config)` is None first.
    """
    m = config.num_micro_batches
    per_token, corr = micro_inputs(batch, config, first_pass=first_pass)
    micro = jax.tree.map(lambda x: split_micro_batches(x, m), per_token)
    if micro_sharding is not None:
        micro = jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(
                x, NamedSharding(micro_sharding.mesh, PartitionSpec(None, *micro_sharding.spec))
            ),
            micro,
        )

    params = state.params
    head_w = params["embed"]["embedding"] if tied else None
    grad_fn = jax.value_and_grad(
        functools.partial(_micro_loss, graphdef=graphdef, config=config, tied=tied),
        argnums=(0, 1),
        has_aux=True,
    )

    def accumulate(carry, mb):
        grads, head_grad, sums = carry
        (_, aux), (g, hg) = grad_fn(params, head_w, mb)
        grads = jax.tree.map(jnp.add, grads, g)
        head_grad = head_grad + hg if tied else head_grad
        ratio_max = jnp.maximum(sums["ratio_max"], aux["ratio_max"])
        sums = {k: sums[k] + aux[k] for k in sums} | {"ratio_max": ratio_max}
        return (grads, head_grad, sums), aux.get("old_logp")

    zeros = jax.tree.map(jnp.zeros_like, params)
    if param_shardings is not None:
        # The accumulator is laid out like the parameters (never replicated).
        zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)
    sums0 = {k: jnp.zeros((), jnp.float32) for k in METRICS}
    head0 = jnp.zeros_like(head_w) if tied else jnp.zeros((), jnp.float32)
    if tied and param_shardings is not None:
        head0 = jax.lax.with_sharding_constraint(head0, param_shardings["embed"]["embedding"])
    if m == 1:
        # No loop for a single micro-batch: a length-1 scan costs seconds of XLA compile time.
        (grads, head_grad, sums), old_bt = accumulate(
            (zeros, head0, sums0), jax.tree.map(lambda x: x[0], micro)
        )
    else:
        (grads, head_grad, sums), old_mbt = jax.lax.scan(accumulate, (zeros, head0, sums0), micro)
        old_bt = None if old_mbt is None else join_micro_batches(old_mbt)
    if first_pass:
        corr = sparse_rl_weights(
            old_bt, batch.sampler_logp_bt, batch.mask_bt, config.correction, batch.after_eviction_bt
        )
        if m > 1:  # the batch statistics, applied once to the unnormalised sums
            scale, tok_scale = first_pass_scales(corr, config)
            grads = jax.tree.map(lambda g: g * scale, grads)
            head_grad = head_grad * scale
            sums = scale_sums(sums, scale, tok_scale)

    # Under jit the sums below run over the sharded gradients as a whole: every device sees the
    # same, globally reduced energy and norm, so all take the same gate / skip decision.
    if tied:
        energy = lm_head_grad_energy(head_grad)
        grads = with_embedding(grads, grads["embed"]["embedding"] + head_grad)
    else:
        energy = lm_head_grad_energy(grads["lm_head"]["kernel"])
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(energy)

    decision, gate_state = gate.update(energy, state.gate, pass_index, rows_energy)
    fire = decision.fire & finite
    apply = finite & ~fire

    max_norm = config.optimizer.max_grad_norm
    if max_norm is not None:
        scale = jnp.minimum(1.0, max_norm / (grad_norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    new_params = optax.apply_updates(params, updates)

    # Selects keep the old bits exactly when the update is discarded or not finite.
    def keep_old(new, old):
        return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)

    new_state = LearnerState(
        params=keep_old(new_params, params),
        opt_state=keep_old(opt_state, state.opt_state),
        gate=jax.tree.map(lambda n, o: jnp.where(finite, n, o), gate_state, state.gate),
        step=state.step + apply.astype(jnp.int32),
        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
        gate_fires=state.gate_fires + fire.astype(jnp.int32),
    )
    metrics = {
        **sums,
        "grad_norm": grad_norm,
        "lr": jnp.asarray(config.optimizer.lr_schedule()(state.step), jnp.float32),
        "applied": apply,
        "nonfinite": ~finite,
        "pass_index": pass_index,
        "dgg/g": decision.energy,
        "dgg/dg": decision.increment,
        "dgg/z": decision.z,
        "dgg/armed": decision.armed,
        "dgg/fire": fire,
        "dgg/stop_reuse": decision.stop_reuse | ~finite,
        **correction_step_metrics(corr, batch.mask_bt, batch.advantages_b),
    }
    if first_pass:
        return new_state, metrics, old_bt
    return new_state, metrics


class Learner:
    """What is static about the learner (graph, config, optimizer, shardings, jitted step).

        learner = Learner(model, LearnerConfig(), mesh=mesh)
        state = learner.init(model)
        state, history = learner.train_on_batch(state, batch)  # pi_old from pass 1's forward
        # or pass by pass:  state, metrics, old = learner.first_pass(state, batch)
        #                   state, metrics = learner.step(state, batch._replace(old_logp_bt=old), 2)

    With `mesh` (axes data / fsdp / tensor) parameters and optimizer moments are laid out by
    `sparserl_jax.parallel`'s logical-axis rules and the batch is split over data x fsdp; with
    no mesh everything runs on the default device.
    """

    def __init__(self, model: nnx.Module, config: LearnerConfig, *, mesh: Mesh | None = None):
        self.config = config
        self.mesh = mesh
        self.graphdef, param_state = nnx.split(model)
        params = nnx.to_pure_dict(param_state)
        not_fp32 = [
            jax.tree_util.keystr(p)
            for p, x in jax.tree_util.tree_leaves_with_path(params)
            if x.dtype != jnp.float32
        ]
        if not_fp32:
            raise ValueError(
                f"the learner keeps fp32 master weights, but {not_fp32[:3]} are not float32; "
                "build the model with param_dtype='float32' (compute dtype may be bfloat16)"
            )
        self.tied = "lm_head" not in params
        self.compute_dtype = jnp.dtype(model.cfg.compute_dtype)  # of the forward passes
        self.vocab_size = params["embed"]["embedding"].shape[0]
        self.tx = config.optimizer.build()
        self.gate = dynamic_gradient_gating(config.gating)
        self._steps: dict[tuple[bool, bool], Any] = {}
        if mesh is None:
            self.param_shardings = self.state_shardings = None
            self._rep = None
        else:
            self._rep = NamedSharding(mesh, PartitionSpec())
            self.param_shardings = nnx.to_pure_dict(state_shardings(param_state, mesh))
            abstract_opt = jax.eval_shape(self.tx.init, params)
            opt_shardings = optax.tree_map_params(
                self.tx,
                lambda _, s: s,
                abstract_opt,
                self.param_shardings,
                transform_non_params=lambda _: self._rep,
                is_leaf=lambda x: isinstance(x, NamedSharding),
            )
            gate_shardings = jax.tree.map(lambda _: self._rep, self.gate.init())
            rep = self._rep
            self.state_shardings = LearnerState(
                self.param_shardings, opt_shardings, gate_shardings, rep, rep, rep
            )
        logprobs = functools.partial(
            teacher_forced_logprobs,
            self.graphdef,
            temperature=config.loss.temperature,
            num_micro_batches=config.num_micro_batches,
            chunk_size=config.logits_chunk_size,
        )
        self._logprobs = jax.jit(with_attention_mesh(mesh, logprobs))  # splash: per device

    # -- state -----------------------------------------------------------------------------

    def init(self, model: nnx.Module) -> LearnerState:
        """Fresh learner state from the model's current weights (copied: donation of the state
        never invalidates the model's own arrays)."""
        params = nnx.to_pure_dict(nnx.state(model))
        gate = self.gate.init()
        zero = jnp.zeros((), jnp.int32)

        def build(p, g):
            p = jax.tree.map(jnp.copy, p)
            return LearnerState(p, self.tx.init(p), g, zero, zero, zero)

        return jax.jit(build, out_shardings=self.state_shardings)(params, gate)

    def model(self, params) -> nnx.Module:
        """The NNX model holding `params` (for generation, export or evaluation)."""
        return nnx.merge(self.graphdef, params)

    # -- computations ----------------------------------------------------------------------

    def _shard_batch(self, x):
        if x is None or self.mesh is None:
            return x
        return jax.device_put(x, batch_sharding(self.mesh, x.ndim))

    def logprobs(
        self, params, tokens_bt: Int[Array, "B T"], evict_pos_bykt=None
    ) -> Float[Array, "B T"]:
        """Teacher-forced logprobs under `params` (pi_old before the first update on a batch;
        the same function on reference weights gives pi_ref): `teacher_forced_logprobs` (the
        one recompute, shared with `rollout.dense_logprobs`) at the loss temperature, over the
        learner's micro-batches, on the batch sharding when there is a mesh; the sampler's
        evictions replayed when given and `attention_mask` is "replay"."""
        self._check_batch(tokens_bt)
        tokens_bt = self._shard_batch(jnp.asarray(tokens_bt, jnp.int32))
        ev = replayed_evictions(self.config, tokens_bt, evict_pos_bykt)
        return self._logprobs(params, tokens_bt, evict_pos_bykt=self._shard_batch(ev))

    def _check_batch(self, tokens_bt) -> None:
        check_token_ids(tokens_bt, self.vocab_size, "learner batch tokens_bt")
        b, m = tokens_bt.shape[0], self.config.num_micro_batches
        shards = batch_shards(self.mesh)
        if b % (m * shards):
            raise ValueError(
                f"batch size {b} must be a multiple of num_micro_batches ({m}) x data*fsdp "
                f"shards ({shards})"
            )

    def _compiled_step(self, batch: RLBatch, first_pass: bool = False):
        key = (tuple(x is None for x in batch), first_pass)
        if key not in self._steps:
            micro = None if self.mesh is None else batch_sharding(self.mesh, 1)
            fn = functools.partial(
                train_step,
                graphdef=self.graphdef,
                config=self.config,
                tx=self.tx,
                gate=self.gate,
                tied=self.tied,
                micro_sharding=micro,
                param_shardings=self.param_shardings,
                first_pass=first_pass,
            )
            fn = with_attention_mesh(self.mesh, fn)  # splash attention: per device on the mesh
            if self.mesh is None:
                self._steps[key] = jax.jit(fn, donate_argnums=0)
            else:
                outs = (self.state_shardings, self._rep)
                outs += (batch_sharding(self.mesh, 2),) if first_pass else ()
                self._steps[key] = jax.jit(
                    fn,
                    in_shardings=(self.state_shardings, self._layout(batch), self._rep, self._rep),
                    out_shardings=outs,
                    donate_argnums=0,
                )
        return self._steps[key]

    def _layout(self, batch: RLBatch) -> RLBatch | None:
        """The batch sharding of each of `batch`'s arrays (None without a mesh)."""
        if self.mesh is None:
            return None
        return RLBatch(*(x if x is None else batch_sharding(self.mesh, x.ndim) for x in batch))

    def _prepare(self, batch: RLBatch) -> RLBatch:
        if self.config.loss.kl_coef > 0 and batch.ref_logp_bt is None:
            raise ValueError(
                f"kl_coef={self.config.loss.kl_coef} > 0 needs batch.ref_logp_bt (reference "
                "logprobs); compute them with learner.logprobs(ref_params, tokens)"
            )
        if self.config.loss.kl_coef == 0:
            batch = batch._replace(ref_logp_bt=None)
        self._check_batch(batch.tokens_bt)
        batch = batch._replace(
            evict_pos_bykt=replayed_evictions(self.config, batch.tokens_bt, batch.evict_pos_bykt)
        )
        return RLBatch(*(self._shard_batch(x) for x in batch))

    def step(
        self, state: LearnerState, batch: RLBatch, pass_index: int = 1, rows_energy=np.inf
    ) -> tuple[LearnerState, dict[str, jax.Array]]:
        """One update (the input state is donated: use the returned one). In bypass mode
        (`config.correction.bypass`) a missing pi_old is the sampler's logprobs."""
        if batch.old_logp_bt is None and self.config.correction.bypass:
            batch = batch._replace(old_logp_bt=batch.sampler_logp_bt)
        if batch.old_logp_bt is None:
            raise ValueError(
                "batch.old_logp_bt is None: fill it with learner.logprobs first, or run the "
                "batch's first pass with learner.first_pass (pi_old from its forward)"
            )
        batch = self._prepare(batch)
        k, e = jnp.int32(pass_index), jnp.float32(rows_energy)
        return self._compiled_step(batch)(state, batch, k, e)

    @property
    def first_pass_fallback(self) -> str | None:
        """Why pi_old is recomputed, not taken from pass 1 (`objective.first_pass_fallback`)."""
        return first_pass_fallback(self.config)

    def first_pass(
        self, state: LearnerState, batch: RLBatch
    ) -> tuple[LearnerState, dict[str, jax.Array], Float[Array, "B T"]]:
        """Pass 1 on a fresh batch, with pi_old from its own forward at `state.params`:
        `(state, metrics, old_logp_bt)`. `batch.old_logp_bt` is ignored; the returned pi_old
        (put it in the batch for passes 2..K) equals `learner.logprobs(state.params, tokens)`
        to float rounding (fp32: ~1e-6; see `rl.objective`), and the update equals
        `step(state, batch with that pi_old, 1)` to float rounding. Only valid when pi_old is
        defined by the weights the state holds; refused when `first_pass_fallback` says so."""
        if self.first_pass_fallback is not None:
            raise ValueError(f"pi_old cannot come from the first pass: {self.first_pass_fallback}")
        batch = self._prepare(batch._replace(old_logp_bt=None))
        one, inf = jnp.int32(1), jnp.float32(np.inf)
        return self._compiled_step(batch, first_pass=True)(state, batch, one, inf)

    def train_on_batch(
        self, state: LearnerState, batch: RLBatch
    ) -> tuple[LearnerState, list[dict[str, np.ndarray]]]:
        """Up to K passes of `num_mini_batches` updates (strided row slices) on one batch, until
        DGG fires (that update discarded) or a step is not finite. A missing pi_old comes from
        pass 1's forward (`first_pass`) or, where `first_pass_fallback` says why not, a recompute
        first; in bypass mode it is mu. Returns the per-update metrics (`pass_index`, ...)."""
        first = batch.old_logp_bt is None and self.first_pass_fallback is None
        if batch.old_logp_bt is None and not first and not self.config.correction.bypass:
            old = self.logprobs(state.params, batch.tokens_bt, batch.evict_pos_bykt)
            batch = batch._replace(old_logp_bt=old)
        n = self.config.num_mini_batches
        minis, history, energy = mini_batches(batch, n, self._layout(batch)), [], [np.inf] * n
        for k, j in itertools.product(range(1, self.config.gating.max_passes + 1), range(n)):
            if k == 1 and first:  # one mini-batch: `first_pass_fallback` refuses several
                state, metrics, old = self.first_pass(state, minis[j])
                minis[j] = minis[j]._replace(old_logp_bt=old)
            else:
                state, metrics = self.step(state, minis[j], k, energy[j])
            metrics = jax.tree.map(np.asarray, jax.device_get(metrics)) | {"mini_batch": j}
            history.append(metrics)
            energy[j] = metrics["dgg/g"] if metrics["applied"] else energy[j]
            if bool(metrics["dgg/fire"]) or bool(metrics["nonfinite"]):  # else K passes run
                break
        applied = sum(bool(m["applied"]) for m in history) / n  # in passes
        for m in history:
            m["passes_run"] = np.int32(history[-1]["pass_index"])
            m["passes_applied"] = np.int32(applied) if n == 1 else np.float32(applied)
        return state, history
