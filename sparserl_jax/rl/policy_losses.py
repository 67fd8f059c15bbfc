"""Policy losses beyond PPO-clip: GSPO, GSPO-token, CISPO and REINFORCE with truncated IS
(sequence-level as verl's `bypass_pg_is`, or token-level).

Same contract as `losses.ppo_clip_loss`: per-token `[B, T]` losses aligned with the sampled
tokens, fp32, to be reduced with `aggregate_loss` / `aggregation_weights` (or the learner's
exact micro-batched equivalent). Sequence-level quantities (GSPO's ratio) are per-row sums
over `mask_bt`, so a micro-batch of whole rows computes them exactly.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.losses import LOG_RATIO_BOUND, ppo_clip_fraction, ppo_clip_loss

PolicyLoss = Literal["ppo", "gspo", "gspo_token", "cispo", "reinforce", "reinforce_token"]
POLICY_LOSSES: tuple[str, ...] = (
    "ppo",
    "gspo",
    "gspo_token",
    "cispo",
    "reinforce",
    "reinforce_token",
)


def _advantages_bt(advantages, shape) -> Float[Array, "B T"]:
    adv = advantages.astype(jnp.float32)
    return jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, shape)


def _token_log_ratio(logp_bt, old_logp_bt, m_bt) -> Float[Array, "B T"]:
    # Padding may hold anything (even -inf): zero it before it reaches a sum or an exp.
    raw_bt = logp_bt.astype(jnp.float32) - old_logp_bt.astype(jnp.float32)
    return jnp.where(m_bt > 0, jnp.clip(raw_bt, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), 0.0)


def sequence_log_ratio(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
) -> Float[Array, " B"]:
    """GSPO's `log s_i = (1 / |y_i|) sum_t log(pi_theta(y_it) / pi_old(y_it))` over the tokens
    of `mask_bt` (token log-ratios clamped to +-20 first); 0 for a row with no token."""
    m_bt = mask_bt.astype(jnp.float32)
    total_b = jnp.sum(_token_log_ratio(logp_bt, old_logp_bt, m_bt) * m_bt, axis=1)
    return total_b / jnp.maximum(jnp.sum(m_bt, axis=1), 1.0)


def gspo_loss(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    advantages_b: Float[Array, " B"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> Float[Array, "B T"]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071).

    `l_i = max(-s_i A_i, -clip(s_i, 1 - eps_low, 1 + eps_high) A_i)` with the sequence ratio
    `s_i = exp(mean_t log(pi_theta / pi_old))`, the geometric mean of the token ratios; the clip
    acts on whole sequences. Returned broadcast to every token of the row, so that the GSPO
    objective `mean_i l_i` is `aggregate_loss(loss, mask, mode="seq_mean_token_mean")`. The
    defaults 3e-4 / 4e-4 are the paper's (and verl's GSPO recipe, TRL's docs).
    """
    s_b = jnp.exp(sequence_log_ratio(logp_bt, old_logp_bt, mask_bt))
    adv_b = advantages_b.astype(jnp.float32)
    if adv_b.ndim != 1:
        raise ValueError(
            f"gspo_loss takes one advantage per sequence [B], got shape {adv_b.shape}; "
            "use gspo_token_loss for per-token advantages"
        )
    loss_b = jnp.maximum(-adv_b * s_b, -adv_b * jnp.clip(s_b, 1.0 - eps_low, 1.0 + eps_high))
    return jnp.broadcast_to(loss_b[:, None], logp_bt.shape)


def gspo_token_loss(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> Float[Array, "B T"]:
    """GSPO-token (Zheng et al. 2025, eq. 13; tunix `loss_algo="gspo-token"`, verl `gspo`).

    `s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]`: numerically the sequence ratio
    `s_i`, but each token's gradient flows through its own logprob, which allows per-token
    advantages. `loss_t = max(-s_it A_t, -clip(s_it, 1 - eps_low, 1 + eps_high) A_t)`. With a
    sequence-level advantage and `seq_mean_token_mean` aggregation its value and gradient equal
    `gspo_loss`'s.
    """
    m_bt = mask_bt.astype(jnp.float32)
    s_log_b = jax.lax.stop_gradient(sequence_log_ratio(logp_bt, old_logp_bt, m_bt))
    logp_bt = logp_bt.astype(jnp.float32)
    # Padding logprobs may be -inf: keep them out of `x - sg(x)` (which would be NaN).
    safe_bt = jnp.where(m_bt > 0, logp_bt, 0.0)
    log_ratio_bt = s_log_b[:, None] + safe_bt - jax.lax.stop_gradient(safe_bt)
    return ppo_clip_loss(
        log_ratio_bt,
        jnp.zeros_like(log_ratio_bt),
        advantages,
        eps_low=eps_low,
        eps_high=eps_high,
    )


def cispo_loss(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> Float[Array, "B T"]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585; verl / TRL `cispo`).

    `loss_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A_t log pi_theta(y_t)`, `r_t = pi_theta /
    pi_old`: the REINFORCE term weighted by a clipped, stop-gradient importance weight, so that
    unlike PPO no token's gradient is ever dropped, only down-weighted. The paper puts no lower
    bound on the weight (`eps_low = 1`: floor 0) and tunes the upper one (0.28 here; verl's
    CISPO example uses 0.2).
    The value is `-w A log pi` (not a surrogate of the return), its gradient `-w A grad log pi`.
    """
    log_ratio_bt = jnp.clip(
        logp_bt.astype(jnp.float32) - old_logp_bt.astype(jnp.float32),
        -LOG_RATIO_BOUND,
        LOG_RATIO_BOUND,
    )
    w_bt = jax.lax.stop_gradient(jnp.clip(jnp.exp(log_ratio_bt), 1.0 - eps_low, 1.0 + eps_high))
    return -_advantages_bt(advantages, w_bt.shape) * w_bt * logp_bt.astype(jnp.float32)


def sequence_is_log_weight(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
) -> Float[Array, " B"]:
    """`log prod_t r_t = sum_t log(pi_theta(y_t) / pi_old(y_t))` over the tokens of `mask_bt`,
    clamped to +-20 after the sum (verl `compute_rollout_correction_weights`,
    `rollout_is="sequence"`: the token log-ratios are summed unclamped, the sum is clamped)."""
    m_bt = mask_bt.astype(jnp.float32)
    raw_bt = logp_bt.astype(jnp.float32) - old_logp_bt.astype(jnp.float32)
    # Padding may hold anything (even -inf): zero it before the sum.
    total_b = jnp.sum(jnp.where(m_bt > 0, raw_bt, 0.0) * m_bt, axis=1)
    return jnp.clip(total_b, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def reinforce_is_loss(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    *,
    upper: float = 2.0,
    lower: float = 0.0,
) -> Float[Array, "B T"]:
    """REINFORCE with a sequence-level truncated importance weight: verl's `bypass_pg_is`
    (`RolloutCorrectionConfig.bypass_pg_is`: `rollout_is="sequence"`, `rollout_is_threshold=2.0`,
    `loss_type="reinforce"`; `compute_policy_loss_bypass_mode` -> `compute_policy_loss_reinforce`).

    `loss_t = -sg[w_i] A_t log pi_theta(y_t)` with one weight per sequence,
    `w_i = clip(prod_t r_t, lower, upper)`, `r_t = pi_theta / pi_old` and the product over the
    tokens of `mask_bt` (its log clamped to +-20 after the sum, see `sequence_is_log_weight`).
    verl has no lower bound (`lower = 0`). In bypass mode pi_old is the sampler mu, so `w_i` is
    the truncated sequence importance ratio of the current policy to the one that sampled
    (Yao et al. 2025, TIS). `reinforce_token_is_loss` is the per-token variant.
    """
    w_b = jnp.clip(jnp.exp(sequence_is_log_weight(logp_bt, old_logp_bt, mask_bt)), lower, upper)
    w_bt = jax.lax.stop_gradient(jnp.broadcast_to(w_b[:, None], logp_bt.shape))
    return -_advantages_bt(advantages, w_bt.shape) * w_bt * logp_bt.astype(jnp.float32)


def reinforce_token_is_loss(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    *,
    upper: float = 2.0,
) -> Float[Array, "B T"]:
    """REINFORCE with a token-level truncated importance weight (verl `loss_type="reinforce"`
    with `rollout_is="token"`, as in `bypass_pg_geo_rs_token_tis` without its rejection):
    `loss_t = -sg[min(r_t, upper)] A_t log pi_theta(y_t)`, `r_t = pi_theta / pi_old`. This is
    CISPO with no lower bound and `1 + eps_high = upper`.
    """
    return cispo_loss(logp_bt, old_logp_bt, advantages, eps_low=1.0, eps_high=upper - 1.0)


def compute_policy_loss(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    advantages_bt: Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"] | None,
    *,
    loss: PolicyLoss,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Dispatch on the policy loss name: `(loss_bt, clipped_bt)`, where `clipped_bt` is 1.0
    where the clip is active (PPO / GSPO: the zero-gradient branch; CISPO / REINFORCE: the
    weight was clipped, for `reinforce` the whole sequence's), for the clip-fraction metric.

    `advantages_bt` is per token (broadcast a per-sequence advantage first); `mask_bt` is needed
    by `gspo`, `gspo_token` (the loss mask) and `reinforce` (the tokens whose ratios make the
    sequence weight; the learner passes the response mask before rejection, as verl does).
    `gspo` takes column 0 of `advantages_bt` as the sequence's advantage.
    """
    lo, hi = eps_low, eps_high
    if loss == "ppo":
        loss_bt = ppo_clip_loss(
            logp_bt, old_logp_bt, advantages_bt, eps_low=lo, eps_high=hi, dual_clip=dual_clip
        )
        return loss_bt, ppo_clip_fraction(
            logp_bt, old_logp_bt, advantages_bt, eps_low=lo, eps_high=hi
        )
    if loss in ("gspo", "gspo_token"):
        if mask_bt is None:
            raise ValueError(f"policy loss {loss!r} needs the loss mask (mask_bt)")
        if loss == "gspo":
            adv_b = advantages_bt[:, 0]
            loss_bt = gspo_loss(logp_bt, old_logp_bt, adv_b, mask_bt, eps_low=lo, eps_high=hi)
        else:
            loss_bt = gspo_token_loss(
                logp_bt, old_logp_bt, advantages_bt, mask_bt, eps_low=lo, eps_high=hi
            )
        s_log_bt = jnp.broadcast_to(
            sequence_log_ratio(logp_bt, old_logp_bt, mask_bt)[:, None], logp_bt.shape
        )
        clipped_bt = ppo_clip_fraction(
            s_log_bt, jnp.zeros_like(s_log_bt), advantages_bt, eps_low=lo, eps_high=hi
        )
        return loss_bt, clipped_bt
    if loss == "reinforce":
        if mask_bt is None:
            raise ValueError("policy loss 'reinforce' needs the response mask (mask_bt)")
        loss_bt = reinforce_is_loss(
            logp_bt, old_logp_bt, advantages_bt, mask_bt, upper=1.0 + hi, lower=1.0 - lo
        )
        seq_w_b = jnp.exp(sequence_is_log_weight(logp_bt, old_logp_bt, mask_bt))
        clipped_b = (seq_w_b < 1.0 - lo) | (seq_w_b > 1.0 + hi)
        clipped_bt = jnp.broadcast_to(clipped_b[:, None], logp_bt.shape)
        return loss_bt, clipped_bt.astype(jnp.float32)
    if loss in ("cispo", "reinforce_token"):
        # `reinforce_token` is CISPO's estimator with its own defaults (no lower bound, upper 2).
        loss_bt = cispo_loss(logp_bt, old_logp_bt, advantages_bt, eps_low=lo, eps_high=hi)
        ratio_bt = jnp.exp(jnp.clip(logp_bt - old_logp_bt, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        clipped_bt = (ratio_bt < 1.0 - lo) | (ratio_bt > 1.0 + hi)
        return loss_bt, clipped_bt.astype(jnp.float32)
    raise ValueError(f"unknown policy loss {loss!r}; expected one of {POLICY_LOSSES}")
