"""Per-token policy losses, loss aggregation, KL estimators and entropy.

Every per-token array is aligned with the sampled tokens: entry `[b, t]` concerns token
`tokens[b, t]`, predicted from `tokens[b, :t]` (so column 0 is never a response token).
All maths is done in fp32.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

# The logprob contract (`log softmax(logits / T)` at each token) and the entropy have one home,
# next to the sampler that records it (the chunked LM head of `rollout.logprobs` uses both).
from sparserl_jax.rollout.sampling import entropy_from_logits as entropy_from_logits
from sparserl_jax.rollout.sampling import shifted_token_logprobs as shifted_token_logprobs
from sparserl_jax.rollout.sampling import token_logprobs as token_logprobs

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

# exp() of a log-ratio beyond this overflows fp32 products; verl and slime use the same bound.
LOG_RATIO_BOUND = 20.0


def _per_token(advantages: Float[Array, " B"] | Float[Array, "B T"], shape) -> Float[Array, "B T"]:
    adv = advantages.astype(jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    return jnp.broadcast_to(adv, shape)


def ppo_clip_loss(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> Float[Array, "B T"]:
    """Per-token PPO-clip loss with asymmetric ("clip-higher") bounds.

    `loss_t = max(-r_t A, -clip(r_t, 1 - eps_low, 1 + eps_high) A)`, `r_t = pi_theta / pi_old`
    (Schulman et al. 2017; asymmetric bounds from DAPO, Yu et al. 2025: 0.2 / 0.28).
    `dual_clip = c` (> 1) additionally caps the loss of negative-advantage tokens at `-c A`
    (Ye et al. 2020, verl `clip_ratio_c`), bounding the gradient of runaway ratios.
    The log-ratio is clamped to +-20 before `exp` so a stale token cannot overflow.
    `advantages` may be per sequence `[B]` (broadcast over tokens) or per token `[B, T]`.
    """
    log_ratio_bt = jnp.clip(
        logp_bt.astype(jnp.float32) - old_logp_bt.astype(jnp.float32),
        -LOG_RATIO_BOUND,
        LOG_RATIO_BOUND,
    )
    ratio_bt = jnp.exp(log_ratio_bt)
    adv_bt = _per_token(advantages, ratio_bt.shape)
    unclipped_bt = -adv_bt * ratio_bt
    clipped_bt = -adv_bt * jnp.clip(ratio_bt, 1.0 - eps_low, 1.0 + eps_high)
    loss_bt = jnp.maximum(unclipped_bt, clipped_bt)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss_bt = jnp.where(adv_bt < 0, jnp.minimum(loss_bt, -adv_bt * dual_clip), loss_bt)
    return loss_bt


def ppo_clip_fraction(
    logp_bt: Float[Array, "B T"],
    old_logp_bt: Float[Array, "B T"],
    advantages: Float[Array, " B"] | Float[Array, "B T"],
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> Float[Array, "B T"]:
    """1.0 where the clipped branch is the active (zero-gradient) one, else 0.0."""
    ratio_bt = jnp.exp(jnp.clip(logp_bt - old_logp_bt, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    adv_bt = _per_token(advantages, ratio_bt.shape)
    clipped_bt = ((adv_bt > 0) & (ratio_bt > 1.0 + eps_high)) | (
        (adv_bt < 0) & (ratio_bt < 1.0 - eps_low)
    )
    return clipped_bt.astype(jnp.float32)


def aggregation_weights(
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    *,
    mode: Aggregation,
    max_len: int | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, ""]]:
    """Per-token numerator weights `c_bt` and a global denominator `Z` such that
    `aggregate_loss = sum(c_bt * loss_bt) / Z`.

    - `token_mean` (DAPO): `c = m`, `Z = max(1, sum m)`: every token of the batch counts equally.
    - `seq_mean_token_mean` (GRPO): `c = m / max(1, sum_t m)`, `Z = B`: mean over each sequence's
      tokens, then over sequences (a sequence with no tokens still counts in `B`, as slime does).
    - `seq_mean_token_sum_norm` (Dr.GRPO): `c = m / max_len`, `Z = B`: a constant normaliser
      (the generation budget; the array width T when `max_len` is None) removes length bias.

    Splitting weights from the denominator lets gradient accumulation over micro-batches sum
    exact per-micro-batch terms `sum(c * loss) / Z` computed with the full batch's `Z`.
    """
    m_bt = mask_bt.astype(jnp.float32)
    b, t = m_bt.shape
    if mode == "token_mean":
        return m_bt, jnp.maximum(jnp.sum(m_bt), 1.0)
    if mode == "seq_mean_token_mean":
        len_b1 = jnp.maximum(jnp.sum(m_bt, axis=1, keepdims=True), 1.0)
        return m_bt / len_b1, jnp.asarray(float(b), jnp.float32)
    if mode == "seq_mean_token_sum_norm":
        norm = float(max_len if max_len is not None else t)
        if norm <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        return m_bt / norm, jnp.asarray(float(b), jnp.float32)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


def aggregate_loss(
    loss_bt: Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    *,
    mode: Aggregation = "seq_mean_token_mean",
    max_len: int | None = None,
) -> Float[Array, ""]:
    """Reduce a per-token loss to a scalar over the tokens where `mask_bt` is set
    (see `aggregation_weights` for the three modes)."""
    weights_bt, denom = aggregation_weights(mask_bt, mode=mode, max_len=max_len)
    return jnp.sum(weights_bt * loss_bt.astype(jnp.float32)) / denom


def kl_penalty(
    logp_bt: Float[Array, "B T"],
    ref_logp_bt: Float[Array, "B T"],
    *,
    estimator: KLEstimator = "k3",
    k3_clamp: float | None = 10.0,
) -> Float[Array, "B T"]:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman 2020,
    "Approximating KL divergence", http://joschu.net/blog/kl-approx.html).

    With `x = log pi_theta - log pi_ref` (clamped to +-20):
    - k1 = x (unbiased, high variance, can be negative);
    - k2 = x^2 / 2 (biased, low variance; verl `mse`);
    - k3 = exp(-x) - 1 + x (unbiased, non-negative, low variance; verl / slime `low_var_kl`,
      which also clamp it to [-10, 10], the default here).
    """
    x_bt = jnp.clip(
        logp_bt.astype(jnp.float32) - ref_logp_bt.astype(jnp.float32),
        -LOG_RATIO_BOUND,
        LOG_RATIO_BOUND,
    )
    if estimator == "k1":
        return x_bt
    if estimator == "k2":
        return 0.5 * x_bt * x_bt
    if estimator == "k3":
        k3_bt = jnp.exp(-x_bt) - 1.0 + x_bt
        return k3_bt if k3_clamp is None else jnp.clip(k3_bt, -k3_clamp, k3_clamp)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def masked_mean(
    x_bt: Float[Array, "B T"], mask_bt: Bool[Array, "B T"] | Float[Array, "B T"]
) -> Float[Array, ""]:
    """Mean of `x` over the set entries of `mask` (0 when the mask is empty)."""
    m_bt = mask_bt.astype(jnp.float32)
    return jnp.sum(jnp.where(m_bt > 0, x_bt, 0.0) * m_bt) / jnp.maximum(jnp.sum(m_bt), 1.0)
