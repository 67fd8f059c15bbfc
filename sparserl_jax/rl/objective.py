"""The learner's objective on one micro-batch, and pi_old from the first pass's forward.

`loss_coefficients` turns pi_old, mu and the response mask into the per-token coefficients of
the loss (the Sparse-RL correction times the aggregation's weights); `micro_loss` is the loss of
one micro-batch whose gradient the learner accumulates.

**pi_old from the first pass.** When the learner starts a batch from the weights pi_old is
defined by, the first pass's forward at those weights *is* the teacher-forced recompute of
pi_old: `micro_loss` then takes pi_old = stop_gradient(its own logprobs), computes the correction
from it in the same step, and returns it for the later passes. That saves one forward pass
over the batch per batch. The ratio pi_theta / pi_old of the first pass is exactly 1.

Equality with the separate recompute (`Learner.logprobs`, then `Learner.step`) is to float
tolerance, not bit for bit: the two forwards are different XLA programs. Asserted in
`tests/rl/test_rl_first_pass.py`: fp32 pi_old within 2e-6 (a few ulps of |log p| ~ 4), the
update's gradients and metrics within rtol 1e-5; bf16 compute pi_old within 1e-2 (seen
bit-identical on XLA:CPU, and with one micro-batch the whole step too), with M > 1 the
gradients within rtol 2e-2 (the backward runs on unnormalised cotangents, which round to
other bf16 values; seen 5e-4).

The correction is row-local except for two batch statistics: `batch_normalize`'s mean weight
(`SparseRLCorrection.weight_scale`) and, for `token_mean` aggregation, the number of tokens
left after rejection (the loss's denominator Z). With one micro-batch (the default) the
micro-batch is the batch: the correction and the coefficients are computed in place, by the
same functions and formulas as from a given pi_old. With M > 1 micro-batches,
micro-batch 1 cannot know them before micro-batch M has run. The policy-gradient term is
`(1 / (Z * weight_scale)) * sum_t c_t w_t pg_t` with row-local `c_t` (aggregation) and `w_t`
(unnormalised weights), and the KL / entropy terms are `(1 / Z) * sum_t c_t (...)`: linear in
those scalars. So each micro-batch's gradient is accumulated unnormalised and the scalars are
applied once, after the last micro-batch (`first_pass_scales`). That needs one scale for every
term: it fails only when a KL or entropy term (scale 1 / Z) sits next to batch-normalised
importance weights (scale 1 / (Z * weight_scale)); the two gradients would need two backward
passes, more than the forward saved, so that configuration keeps the recompute
(`first_pass_fallback` says why). DGG reads the lm_head gradient energy of the scaled, total
gradient, so it sees the same statistic either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from sparserl_jax.kvcache.evictions import checked_record
from sparserl_jax.rl.config import LearnerConfig
from sparserl_jax.rl.correction import SparseRLCorrection, correction_rows, sparse_rl_weights
from sparserl_jax.rl.losses import LOG_RATIO_BOUND, aggregation_weights, kl_penalty
from sparserl_jax.rl.policy_losses import compute_policy_loss
from sparserl_jax.rollout.logprobs import head_logprobs, split_micro_batches

# Per-step loss metrics, summed over micro-batches (`ratio_max`: a max).
METRICS = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "approx_kl", "ratio_max")
# Of those, the ones scaled like the loss and like a token mean by `first_pass_scales`.
_LOSS_SUMS, _TOKEN_SUMS = ("loss", "pg_loss"), ("kl", "entropy", "clip_fraction", "approx_kl")


def loss_coefficients(
    kept_bt: jax.Array,
    weights_bt: jax.Array,
    mask_bt: jax.Array,
    config: LearnerConfig,
    *,
    whole_batch: bool = True,
) -> dict[str, jax.Array]:
    """Per-token coefficients of the loss from the corrected mask `kept_bt`, the importance
    weights and the response mask: `pg_coef` (aggregation x weight / Z), `reg_coef`
    (aggregation / Z, for KL and entropy), `tok_w` (token-mean weights of the metrics) and, for
    `gspo`, `gspo_token` and `reinforce`, the policy loss's `mask`.

    `whole_batch=True`: the arrays are the whole batch (`sparse_rl_weights`' mask and weights)
    and the coefficients are final. `whole_batch=False`: the arrays are whole rows of a batch
    (`correction_rows`: weights before `batch_normalize`) and the batch statistics are left
    out (Z = 1, `tok_w` = the kept-token mask); the caller divides by them afterwards
    (`first_pass_scales`).
    """
    lcfg = config.loss
    # The aggregation's numerator weights are row-local in every mode; only Z is global.
    agg_bt, denom = aggregation_weights(
        kept_bt, mode=lcfg.aggregation, max_len=lcfg.max_response_len
    )
    if whole_batch:
        coef = {
            "pg_coef": agg_bt * weights_bt / denom,
            "reg_coef": agg_bt / denom,
            "tok_w": kept_bt / jnp.maximum(jnp.sum(kept_bt), 1.0),
        }
    else:
        coef = {"pg_coef": agg_bt * weights_bt, "reg_coef": agg_bt, "tok_w": kept_bt}
    masks = {"gspo": kept_bt, "gspo_token": kept_bt, "reinforce": mask_bt.astype(jnp.float32)}
    if lcfg.policy_loss in masks:  # reinforce (bypass_pg_is): its weight spans unrejected tokens
        coef["mask"] = masks[lcfg.policy_loss]
    return coef


def micro_inputs(
    batch, config: LearnerConfig, *, first_pass: bool
) -> tuple[dict[str, jax.Array], SparseRLCorrection | None]:
    """The per-token arrays of a step's micro-batches (`[B, ...]`, split by the learner) and
    the whole batch's correction. Given pi_old: tokens, pi_old, advantages, KL reference and
    the final `loss_coefficients`. On a first pass (`first_pass`: pi_old from the forward,
    correction None): the sampler's logprobs and the response mask instead."""
    adv_bt = jnp.broadcast_to(
        batch.advantages_b.astype(jnp.float32)[:, None], batch.tokens_bt.shape
    )
    per_token = {"tokens": batch.tokens_bt, "adv": adv_bt}
    corr = None
    if first_pass:
        per_token |= {"sampler_logp": batch.sampler_logp_bt, "response_mask": batch.mask_bt}
    else:
        corr = sparse_rl_weights(
            batch.old_logp_bt,
            batch.sampler_logp_bt,
            batch.mask_bt,
            config.correction,
            batch.after_eviction_bt,
        )
        per_token |= loss_coefficients(corr.loss_mask_bt, corr.weights_bt, batch.mask_bt, config)
        per_token["old_logp"] = batch.old_logp_bt.astype(jnp.float32)
    if batch.ref_logp_bt is not None:
        per_token["ref_logp"] = batch.ref_logp_bt.astype(jnp.float32)
    if batch.evict_pos_bykt is not None:  # replayed (`LearnerConfig.attention_mask`)
        per_token["evict_pos"] = batch.evict_pos_bykt
    return per_token, corr


def micro_loss(params, head_w, mb: dict, *, graphdef, config: LearnerConfig, tied: bool):
    """`(loss, aux)` of one micro-batch `mb` (a dict of `[b, ...]` arrays).

    With `mb["old_logp"]` (pi_old given) `mb` carries the coefficients of `loss_coefficients`.
    Without it (the first pass, pi_old from this forward) `mb` carries `sampler_logp` and
    `response_mask` instead, pi_old is `stop_gradient` of this forward's logprobs, the
    coefficients are computed here (final with one micro-batch, else unnormalised), and
    `aux["old_logp"]` returns pi_old.
    """
    loss_cfg = config.loss
    model = nnx.merge(graphdef, params)
    h_btd = model.hidden_states(mb["tokens"], evict_pos_bykt=mb.get("evict_pos"))
    # Tied: the head reads its own copy of the shared matrix so that its gradient (the output
    # projection's part, which DGG monitors) comes out separately; the learner adds it back.
    # The head runs chunk by chunk inside `head_logprobs`: no [B, T, V] logits, either pass.
    logp_bt, ent_bt = head_logprobs(
        model.cfg,
        head_w if tied else model.head_weight(),
        h_btd,
        mb["tokens"],
        temperature=loss_cfg.temperature,
        chunk_size=config.logits_chunk_size,
        entropy=True,
        entropy_grad=loss_cfg.entropy_coef > 0,
    )
    first = "old_logp" not in mb
    if first:
        old_bt = jax.lax.stop_gradient(logp_bt)
        whole = config.num_micro_batches == 1  # this micro-batch is the batch
        args = (old_bt, mb["sampler_logp"], mb["response_mask"], config.correction)
        if whole:
            corr = sparse_rl_weights(*args)
            kept_bt, w_bt = corr.loss_mask_bt, corr.weights_bt
        else:
            kept_bt, w_bt = correction_rows(*args)
        mb = mb | loss_coefficients(kept_bt, w_bt, mb["response_mask"], config, whole_batch=whole)
    else:
        old_bt = mb["old_logp"]
    pg_bt, clip_bt = compute_policy_loss(
        logp_bt,
        old_bt,
        mb["adv"],
        mb.get("mask"),
        loss=loss_cfg.policy_loss,
        eps_low=loss_cfg.eps_low,
        eps_high=loss_cfg.eps_high,
        dual_clip=loss_cfg.dual_clip,
    )
    pg_loss = jnp.sum(mb["pg_coef"] * pg_bt)
    loss = pg_loss
    tok_w = mb["tok_w"]
    kl = jnp.zeros((), jnp.float32)
    if "ref_logp" in mb:
        kl_bt = kl_penalty(logp_bt, mb["ref_logp"], estimator=loss_cfg.kl_estimator)
        loss = loss + loss_cfg.kl_coef * jnp.sum(mb["reg_coef"] * kl_bt)
        kl = jnp.sum(tok_w * kl_bt)
    if loss_cfg.entropy_coef > 0:
        loss = loss - loss_cfg.entropy_coef * jnp.sum(mb["reg_coef"] * ent_bt)
    ratio_bt = jnp.exp(jnp.clip(logp_bt - old_bt, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    aux = {
        "loss": loss,
        "pg_loss": pg_loss,
        "kl": kl,
        "entropy": jnp.sum(tok_w * jax.lax.stop_gradient(ent_bt)),
        "clip_fraction": jnp.sum(tok_w * clip_bt),
        # k3 estimate of KL(pi_old || pi_theta): how far this pass has moved from pi_old.
        "approx_kl": jnp.sum(tok_w * kl_penalty(old_bt, logp_bt, k3_clamp=None)),
        "ratio_max": jnp.max(jnp.where(tok_w > 0, ratio_bt, 0.0)),
    }
    if first:
        aux["old_logp"] = old_bt
    return loss, jax.lax.stop_gradient(aux)


def replayed_evictions(config: LearnerConfig, tokens_bt, evict_pos_bykt):
    """The eviction record the learner's forward replays (`LearnerConfig.attention_mask`):
    None when dense; checked against the tokens when "replay"."""
    if config.attention_mask == "dense":
        return None
    return checked_record(evict_pos_bykt, tokens_bt.shape)


def first_pass_fallback(config: LearnerConfig) -> str | None:
    """Why pi_old cannot come from the first pass's forward under `config`, or None when it
    can (see the module docstring). The learner then recomputes it with a separate forward."""
    corr, loss = config.correction, config.loss
    if not config.old_logp_from_first_pass:
        return "learner.old_logp_from_first_pass=false"
    if corr.bypass:
        return "learner.correction.bypass: pi_old is the sampler's logprobs (no recompute)"
    if config.num_mini_batches > 1:
        return (
            f"num_mini_batches={config.num_mini_batches}: pi_old is the weights before the "
            "batch's first step, and the first pass's later mini-batches run at updated weights"
        )
    regularised = loss.kl_coef > 0 or loss.entropy_coef > 0
    if config.num_micro_batches > 1 and regularised and corr.reweight and corr.batch_normalize:
        return (
            f"num_micro_batches={config.num_micro_batches} with a KL or entropy term "
            f"(kl_coef={loss.kl_coef}, entropy_coef={loss.entropy_coef}) and batch-normalised "
            "importance weights: the weights' batch mean scales the policy term alone, so "
            "the micro-batches' gradients cannot be normalised after the fact with one backward"
        )
    return None


def with_embedding(params: dict, embedding_vd) -> dict:
    """`params` with its (tied) embedding matrix replaced: the head's and the table's gradients
    summed, or a separately differentiated head put back."""
    return {**params, "embed": {**params["embed"], "embedding": embedding_vd}}


def mini_batches(batch, n: int, layout=None) -> list:
    """`batch` (a NamedTuple of `[B, ...]` arrays or None) as `n` row slices for
    `num_mini_batches`: mini-batch j = rows j, j + n, j + 2n, ... (`split_micro_batches`'
    assignment), so a shard holding a contiguous block of rows holds an equal share of every
    mini-batch and taking them moves no data; `layout` (the batch's shardings, a NamedTuple like
    `batch`) pins each mini-batch to it. Every mini-batch holds samples of every GRPO group."""
    b = batch.tokens_bt.shape[0]
    if b % n:
        raise ValueError(f"batch size {b} must be a multiple of num_mini_batches ({n})")
    return [batch] if n == 1 else _strided_rows(batch, n, layout)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _strided_rows(batch, n: int, layout) -> list:
    minis = [
        type(batch)(*(x if x is None else split_micro_batches(x, n)[j] for x in batch))
        for j in range(n)
    ]
    return minis if layout is None else [jax.lax.with_sharding_constraint(m, layout) for m in minis]


def first_pass_scales(
    corr: SparseRLCorrection, config: LearnerConfig
) -> tuple[jax.Array, jax.Array]:
    """`(loss_scale, token_scale)` to apply to what a first pass over M > 1 micro-batches
    accumulated unnormalised: `1 / (Z * weight_scale)` for the gradient and the loss sums,
    `1 / max(1, kept tokens)` for the token-mean metrics. `corr` is `sparse_rl_weights` of
    the whole batch (with pi_old gathered from the micro-batches). With a KL or entropy term
    `weight_scale` is exactly 1 (`first_pass_fallback` refuses the other case), so one scale
    serves every term."""
    lcfg = config.loss
    _, denom = aggregation_weights(
        corr.loss_mask_bt, mode=lcfg.aggregation, max_len=lcfg.max_response_len
    )
    kept = jnp.maximum(jnp.sum(corr.loss_mask_bt), 1.0)
    return 1.0 / (denom * corr.weight_scale), 1.0 / kept


def scale_sums(sums: dict, loss_scale: jax.Array, token_scale: jax.Array) -> dict:
    """The metric sums of an unnormalised first pass, normalised (`first_pass_scales`)."""
    out = dict(sums)
    for k in _LOSS_SUMS:
        out[k] = sums[k] * loss_scale
    for k in _TOKEN_SUMS:
        out[k] = sums[k] * token_scale
    return out
