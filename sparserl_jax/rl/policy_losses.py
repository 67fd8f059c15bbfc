"""Policy losses beyond PPO-clip: GSPO, GSPO-token, CISPO and REINFORCE with truncated IS.

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

PolicyLoss = Literal["ppo", "gspo", "gspo_token", "cispo", "reinforce"]
POLICY_LOSSES: tuple[str, ...] = ("ppo", "gspo", "gspo_token", "cispo", "reinforce")


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
    bound on the weight (`eps_low = 1`: floor 0) and tunes the upper one (0.28 here, verl's).
    The value is `-w A log pi` (not a surrogate of the return), its gradient `-w A grad log pi`.
    """
    log_ratio_bt = jnp.clip(
        logp_bt.astype(jnp.float32) - old_logp_bt.astype(jnp.float32),
        -LOG_RATIO_BOUND,
        LOG_RATIO_BOUND,
    )
    w_bt = jax.lax.stop_gradient(jnp.clip(jnp.exp(log_ratio_bt), 1.0 - eps_low, 1.0 + eps_high))
    return -_advantages_bt(advantages, w_bt.shape) * w_bt * logp_bt.astype(jnp.float32)


def reinforce_is_loss(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    *,
    upper: float = 2.0,
) -> Float[Array, "B T"]:
    """REINFORCE with a truncated importance weight (verl bypass `loss_type="reinforce"`,
    `bypass_pg_is`; Yao et al. 2025, TIS): `loss_t = -sg[min(r_t, upper)] A_t log pi_theta(y_t)`,
    `r_t = pi_theta / pi_old`. In bypass mode pi_old is the sampler mu, so `r_t` is the
    importance ratio of the current policy to the one that sampled. This is CISPO with no lower
    bound and `1 + eps_high = upper`.
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
    weight was clipped), for the clip-fraction metric.

    `advantages_bt` is per token (broadcast a per-sequence advantage first); `mask_bt` (the
    loss mask) is needed by `gspo` and `gspo_token` only. `gspo` takes column 0 of
    `advantages_bt` as the sequence's advantage.
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
    if loss in ("cispo", "reinforce"):
        # `reinforce` is CISPO's estimator with its own defaults (no lower bound, upper 2).
        loss_bt = cispo_loss(logp_bt, old_logp_bt, advantages_bt, eps_low=lo, eps_high=hi)
        ratio_bt = jnp.exp(jnp.clip(logp_bt - old_logp_bt, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        clipped_bt = (ratio_bt < 1.0 - lo) | (ratio_bt > 1.0 + hi)
        return loss_bt, clipped_bt.astype(jnp.float32)
    raise ValueError(f"unknown policy loss {loss!r}; expected one of {POLICY_LOSSES}")
