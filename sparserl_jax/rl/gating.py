"""Dynamic Gradient Gating (DGG): when to stop reusing a rollout batch.

"When to Stop Reusing: Dynamic Gradient Gating for Sample-Efficient RLVR" (Miao et al.,
arXiv 2605.19425). Each rollout batch is reused for up to K = 4 passes. Every update measures
the lm_head gradient energy `g = ||dL/dW_head||_F^2` before clipping; a sliding window of its
increments `dg = g - g_prev` is kept *across* batches. Once the window is full and the pass
index k > 1, the gate fires when `z = (dg - mean(window)) / (std(window) + eps) > tau`; the
update is then discarded before the optimizer (its moments never see the spike) and reuse of the
batch ends. No public code exists: the rule is reconstructed from the paper's abstract and
summaries (energy of the lm_head gradient, its increment's z-score against a window, tau in
0.1-0.5, K = 4).

Implementation choices where the paper is silent: the window holds plain increments with their
population mean/std (no EMA); a fired step appends nothing and leaves `g_prev` alone, so a spike
cannot poison the statistics; by default `g_prev` carries over from the previous batch
(`reset_each_batch=True` only counts increments between passes of one batch).

Measured on the demo model (`docs/reproductions.md`, `tools/repro_dgg.py`): g falls over the
passes of a batch, so with the default window the pass-1 jumps set its std and the gate almost
never fires; with `reset_each_batch=True` a later pass's smaller drop reads as z > tau and the
gate fires on most batches at pass 2-3. Neither fire tracked harm there.

The gate follows optax's `init` / `update` shape with a NamedTuple state, so it lives inside the
jitted learner step; feed it the *globally reduced* energy (under `jit` with sharded gradients a
plain `jnp.sum` is already global) so every host takes the same decision.

`rule="rising"` (ours, not the paper's): fire at pass k > 1 when the energy on the same rows
(the same mini-batch) is higher than at their previous accepted pass. Within one batch the data
is fixed, so only the weights moved; ratio clipping normally makes that energy shrink over the
passes, so a rise is the drift the paper's spike stands for, with no window to fill and no
cross-slice noise. Measured with several mini-batches per pass (`docs/reproductions.md`): there
the z-score's increments jump from slice to slice, its window's statistics are those jumps, and
it fires on every batch.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DGGConfig:
    """Attributes:
    enabled: when False the gate never fires (it still tracks g and z for logging).
    tau: z-score threshold (paper: 0.1-0.5 recommended).
    window: number of increments in the sliding window (unknown in the paper; 8-32 suggested).
    max_passes: K, the most passes over one rollout batch.
    eps: added to the window std.
    reset_each_batch: measure increments only between passes of the same batch.
    rule: "zscore" (the paper's: the increment's z-score against the window, > tau) or
        "rising" (the energy of the same mini-batch above its previous pass's; see above).
    """

    enabled: bool = True
    tau: float = 0.3
    window: int = 16
    max_passes: int = 4
    eps: float = 1e-8
    reset_each_batch: bool = False
    rule: str = "zscore"

    def __post_init__(self):
        if self.rule not in ("zscore", "rising"):
            raise ValueError(f"rule must be 'zscore' or 'rising', got {self.rule!r}")
        if not self.tau > 0:
            raise ValueError(f"tau must be > 0 (paper range 0.1-0.5), got {self.tau}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2 to have a std, got {self.window}")
        if self.max_passes < 1:
            raise ValueError(f"max_passes must be >= 1, got {self.max_passes}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


class DGGState(NamedTuple):
    """Ring buffer of the last `window` increments and the last accepted energy."""

    increments_w: Float[Array, " W"]
    count: Int[Array, ""]
    next_index: Int[Array, ""]
    prev_energy: Float[Array, ""]
    has_prev: Bool[Array, ""]


class DGGDecision(NamedTuple):
    """What the gate saw and decided at one update."""

    energy: Float[Array, ""]
    increment: Float[Array, ""]
    z: Float[Array, ""]
    armed: Bool[Array, ""]
    fire: Bool[Array, ""]
    stop_reuse: Bool[Array, ""]


class GradientGate(NamedTuple):
    """optax-style pair: `state = init()`; `decision, state = update(energy, state, pass_index)`."""

    init: Callable[[], DGGState]
    update: Callable[..., tuple[DGGDecision, DGGState]]


def dynamic_gradient_gating(config: DGGConfig | None = None) -> GradientGate:
    """Build the DGG gate. `pass_index` is 1-based (1 = first use of a fresh batch);
    `rows_energy` (`rule="rising"`) is the energy the same rows gave at their previous accepted
    pass of this batch (the caller keeps it: it never spans batches, so it is no gate state)."""
    cfg = config or DGGConfig()

    def init() -> DGGState:
        return DGGState(
            increments_w=jnp.zeros((cfg.window,), jnp.float32),
            count=jnp.zeros((), jnp.int32),
            next_index=jnp.zeros((), jnp.int32),
            prev_energy=jnp.zeros((), jnp.float32),
            has_prev=jnp.zeros((), bool),
        )

    def update(
        energy: Float[Array, ""],
        state: DGGState,
        pass_index: Int[Array, ""] | int,
        rows_energy: Float[Array, ""] | float = float("inf"),
    ) -> tuple[DGGDecision, DGGState]:
        g = jnp.asarray(energy, jnp.float32)
        k = jnp.asarray(pass_index, jnp.int32)
        has_increment = state.has_prev & (k > 1) if cfg.reset_each_batch else state.has_prev
        dg = jnp.where(has_increment, g - state.prev_energy, 0.0)

        # Window statistics over the filled entries (all of them once the window is full).
        filled_w = jnp.arange(cfg.window) < state.count
        n = jnp.maximum(state.count, 1).astype(jnp.float32)
        mean = jnp.sum(jnp.where(filled_w, state.increments_w, 0.0)) / n
        var = jnp.sum(jnp.where(filled_w, (state.increments_w - mean) ** 2, 0.0)) / n
        z = jnp.where(state.count >= 2, (dg - mean) / (jnp.sqrt(var) + cfg.eps), 0.0)

        if cfg.rule == "rising":  # the same rows' energy at their previous pass
            armed = (k > 1) & cfg.enabled
            fire = armed & (g > rows_energy)
        else:
            armed = (state.count >= cfg.window) & (k > 1) & has_increment & cfg.enabled
            fire = armed & (z > cfg.tau)
        stop_reuse = fire | (k >= cfg.max_passes)

        # Accepted step: append the increment (if there is one) and remember g.
        push = has_increment & ~fire
        written_w = state.increments_w.at[state.next_index].set(dg)
        accepted = DGGState(
            increments_w=jnp.where(push, written_w, state.increments_w),
            count=jnp.where(push, jnp.minimum(state.count + 1, cfg.window), state.count),
            next_index=jnp.where(push, (state.next_index + 1) % cfg.window, state.next_index),
            prev_energy=g,
            has_prev=jnp.ones((), bool),
        )
        new_state = DGGState(*(jnp.where(fire, o, a) for o, a in zip(state, accepted, strict=True)))
        decision = DGGDecision(
            energy=g, increment=dg, z=z, armed=armed, fire=fire, stop_reuse=stop_reuse
        )
        return decision, new_state

    return GradientGate(init=init, update=update)


def lm_head_grad_energy(grad_head: Float[Array, "..."]) -> Float[Array, ""]:
    """`||G||_F^2` of an explicit lm_head gradient (any layout, `[D, V]` or `[V, D]`)."""
    g = grad_head.astype(jnp.float32)
    return jnp.sum(g * g)


def lm_head_grad_energy_gram(
    h_btd: Float[Array, "B T D"], dlogits_btv: Float[Array, "B T V"]
) -> Float[Array, ""]:
    """Energy of the output-projection gradient from activations, in Gram form.

    With logits `z_t = W h_t` and `delta_t = dL/dz_t`, the head gradient is
    `dL/dW = sum_t delta_t h_t^T` and `||dL/dW||_F^2 = sum_{t,s} (h_t . h_s)(delta_t . delta_s)`
    (dgg.md §1.4). It needs no weights, so with tied embeddings it isolates the output-projection
    part of the shared matrix's gradient. Cost O(N^2 (D + V)) for N = B*T tokens: use it for
    monitoring one micro-batch; the learner accumulates the exact head gradient instead.
    """
    h_nd = h_btd.reshape(-1, h_btd.shape[-1]).astype(jnp.float32)
    d_nv = dlogits_btv.reshape(-1, dlogits_btv.shape[-1]).astype(jnp.float32)
    gram_h_nn = jnp.einsum("nd,md->nm", h_nd, h_nd)
    gram_d_nn = jnp.einsum("nv,mv->nm", d_nv, d_nv)
    return jnp.sum(gram_h_nn * gram_d_nn)
