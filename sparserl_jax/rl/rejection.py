"""Rejection of rollout tokens or sequences by a divergence between pi_old and the sampler mu.

With `log rho_t = log pi_old(y_t) - log mu(y_t)` on the response tokens, three per-token
estimators of KL(mu || pi_old) (Schulman 2020, "Approximating KL divergence"), exactly as verl's
rollout correction defines them (`algorithm.rollout_correction.rollout_rs`; verl
`verl/trainer/ppo/rollout_corr_helper.py`, `compute_rollout_rejection_mask`):

- K1: `-log rho_t` (= `log(mu / pi_old)`), kept inside `[log lower, log upper]`;
- K2: `(log rho_t)^2 / 2`, bounded above;
- K3: `rho_t - 1 - log rho_t` (>= 0), bounded above.

The level is `token` (each token on its own: only that token is masked), `seq_sum` (sum over
the sequence's tokens), `seq_mean` (their mean) or `seq_max` (the largest token value; K2 / K3
only). A sequence-level criterion masks the whole sequence. A criterion is written
`name=threshold`, K1 with `lower_upper` (or one number `upper`, the lower bound then being
`1 / upper`, as in verl):

    token_k1=0.5_2.0    seq_mean_k3=0.01    seq_max_k2=2.0

K1's `lower_upper` bounds `exp(K1) = 1 / rho` (verl's rule, kept here so that a verl config
means the same thing): `token_k1=L_U` KEEPS `rho_t` in `[1/U, 1/L]`, `seq_sum_k1` the product
`prod_t rho_t` and `seq_mean_k1` the geometric mean `exp(mean_t log rho_t)` in that range. It is
the ratio range `[L, U]` only for reciprocal bounds (`0.5_2.0`); `0.5_1.5` keeps `rho` in
`[0.667, 2.0]`. To bound the ratio itself by `[L, U]`, use the Sparse-RL ratio rejection
(`reject`, `reject_level` `token` / `sequence` / `geometric`, `reject_lower`, `reject_upper`).

Several criteria are chained: a token stays only if every criterion keeps it.
"""

import dataclasses
import math

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

REJECTION_CRITERIA: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RejectionCriterion:
    """One parsed criterion: keep where `lower <= exp(stat) <= upper` (K1, whose statistic is
    `-log rho`: the ratio is kept in `[1 / upper, 1 / lower]`) or `stat <= upper` (K2, K3)."""

    name: str
    upper: float
    lower: float | None = None

    @property
    def level(self) -> str:
        return self.name.rsplit("_", 1)[0]

    @property
    def estimator(self) -> str:
        return self.name.rsplit("_", 1)[1]


def parse_rejection(spec: str) -> RejectionCriterion:
    """`"seq_mean_k3=0.01"` or `"token_k1=0.5_2.0"` -> a `RejectionCriterion` (clear errors)."""
    name, sep, value = spec.partition("=")
    name = name.strip()
    if not sep or name not in REJECTION_CRITERIA:
        raise ValueError(
            f"rejection criterion {spec!r}: expected NAME=THRESHOLD with NAME one of "
            f"{REJECTION_CRITERIA} (K1 as NAME=LOWER_UPPER, e.g. token_k1=0.5_2.0)"
        )
    try:
        parts = [float(x) for x in value.split("_")]
    except ValueError:
        raise ValueError(
            f"rejection criterion {spec!r}: threshold {value!r} is not a number"
        ) from None
    if name.endswith("k1"):
        if len(parts) == 1 and parts[0] > 0:
            # verl: a single K1 number is the upper bound, the lower one its reciprocal.
            parts = [1.0 / parts[0], parts[0]]
        if len(parts) != 2 or not 0 < parts[0] < parts[1]:
            raise ValueError(
                f"rejection criterion {spec!r}: K1 needs LOWER_UPPER with 0 < LOWER < UPPER (or "
                "one UPPER > 0, LOWER = 1/UPPER), e.g. token_k1=0.5_2.0; as in verl it bounds "
                "exp(-log rho) = mu / pi_old, so it keeps rho in [1/UPPER, 1/LOWER]"
            )
        return RejectionCriterion(name=name, lower=parts[0], upper=parts[1])
    if len(parts) != 1 or not parts[0] > 0:
        raise ValueError(
            f"rejection criterion {spec!r}: K2 / K3 take one positive upper bound, e.g. {name}=0.01"
        )
    return RejectionCriterion(name=name, upper=parts[0])


def divergence_statistic(
    log_rho_bt: Float[Array, "B T"], mask_bt: Float[Array, "B T"], criterion: RejectionCriterion
) -> Float[Array, "B T"]:
    """The criterion's statistic at its level, broadcast to every token of the row
    (`log_rho_bt` must already be 0 at padding and clamped)."""
    k = criterion.estimator
    if k == "k1":
        d_bt = -log_rho_bt  # verl's k1 = -log(pi_old / mu)
    elif k == "k2":
        d_bt = 0.5 * log_rho_bt * log_rho_bt
    else:
        d_bt = jnp.exp(log_rho_bt) - 1.0 - log_rho_bt
    level = criterion.level
    if level == "token":
        return d_bt
    if level == "seq_max":
        stat_b1 = jnp.max(jnp.where(mask_bt > 0, d_bt, 0.0), axis=1, keepdims=True)
    else:
        stat_b1 = jnp.sum(d_bt * mask_bt, axis=1, keepdims=True)
        if level == "seq_mean":
            stat_b1 = stat_b1 / jnp.maximum(jnp.sum(mask_bt, axis=1, keepdims=True), 1.0)
    return jnp.broadcast_to(stat_b1, d_bt.shape)


def divergence_rejection_mask(
    old_logp_bt: Float[Array, "B T"],
    sampler_logp_bt: Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    criteria: tuple[str, ...] | list[str],
    *,
    log_ratio_bound: float = 20.0,
) -> Float[Array, "B T"]:
    """1.0 where every criterion of `criteria` (strings, see the module docstring) keeps the
    token, else 0.0; 0 at padding. An empty sequence is never rejected (it has no token)."""
    m_bt = mask_bt.astype(jnp.float32)
    raw_bt = old_logp_bt.astype(jnp.float32) - sampler_logp_bt.astype(jnp.float32)
    log_rho_bt = jnp.where(m_bt > 0, jnp.clip(raw_bt, -log_ratio_bound, log_ratio_bound), 0.0)
    keep_bt = m_bt
    for spec in criteria:
        c = parse_rejection(spec)
        stat_bt = divergence_statistic(log_rho_bt, m_bt, c)
        if c.estimator == "k1":
            # verl compares K1 with the logs of the bounds (no exp of a sequence sum).
            ok_bt = (stat_bt >= math.log(c.lower)) & (stat_bt <= math.log(c.upper))
        else:
            ok_bt = stat_bt <= c.upper
        keep_bt = keep_bt * ok_bt.astype(jnp.float32)
    return keep_bt
