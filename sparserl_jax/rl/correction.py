"""Sparse-RL correction: rejection sampling and importance reweighting for sparse rollouts.

Sparse-RL (Luo, Zhang et al., arXiv 2601.10079, ACL 2026) samples with a compressed KV cache, so
the sampler mu (published weights + sparse attention) differs from the dense old policy pi_old
that the learner recomputes by teacher forcing. The defaults below are those of the authors'
release (`slime/examples/train_infer_mismatch_helper/mis.py` + `mis.yaml`):

- `log rho_t = log pi_old(o_t) - log mu(o_t)`, clamped to +-20 before `exp`;
- veto: a sequence is dropped when any of its response tokens has `rho_t < 1e-4`;
- rejection: tokens with `rho_t` outside `[0.5, 1.5]` are masked (they leave both the numerator
  and the denominator of the per-sequence mean, because the learner aggregates with `m'`);
- reweighting: `w_t = min(rho_t, 1.5)`, divided by its mean over the batch's valid tokens under
  the *original* mask, stop-gradient, multiplied into the per-token policy loss.

Every part is switchable, and rejection / reweighting can act per token, per sequence
(`rho = prod_t rho_t`) or on the geometric mean (`rho = exp(mean_t log rho_t)`), as in slime's
`mis_level`. `SparseRLCorrectionConfig.naive()` is "naive sparse" (no correction) and
`SparseRLCorrectionConfig.tis_only()` is truncated importance sampling alone.

Beyond Sparse-RL: IcePop weights (`reweight_mode="icepop"`, `icepop()`; not in verl), and from
verl's rollout correction: rejection by K1 / K2 / K3 divergence at token or sequence level,
several chained, with verl's meaning (`rejection`, see `rl/rejection.py`), and bypass mode
(`bypass`: pi_old := mu, no dense recompute). docs/algorithms.md compares each with verl.
"""

import dataclasses
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.rejection import divergence_rejection_mask, parse_rejection

CorrectionLevel = Literal["token", "sequence", "geometric"]
CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
ReweightMode = Literal["truncate", "icepop"]
REWEIGHT_MODES: tuple[str, ...] = ("truncate", "icepop")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseRLCorrectionConfig:
    """Switches and bounds of the Sparse-RL correction (defaults: the authors' `mis.yaml`).

    Attributes:
      log_ratio_bound: `log rho` is clamped to +-this before `exp` (safety bound).
      veto: reject a whole sequence if any response token has `rho_t < veto_threshold`.
      veto_threshold: the veto ratio (1e-4: the sampler picked a token that the dense policy
        finds 10^4 times less likely).
      reject: mask tokens (or whole sequences, by `reject_level`) whose ratio is outside
        `[reject_lower, reject_upper]` (a bound on the ratio itself, like verl's
        `rollout_rs: token | sequence | geometric` before 2026-01; today's verl K1 criteria
        `token_k1` / `seq_sum_k1` / `seq_mean_k1` keep `[1/upper, 1/lower]`, see
        `rl/rejection.py`).
      reject_level: `token`, `sequence` (product of ratios) or `geometric` (geometric mean).
      reweight: multiply the per-token loss by the truncated importance weight.
      reweight_level: level of the weight (`token`, `sequence` or `geometric`).
      reweight_upper: truncation `w = min(rho, reweight_upper)` (TIS, Yao et al. 2025).
      reweight_mode: `truncate` (TIS, above) or `icepop`: `w = rho` inside
        `[reweight_lower, reweight_upper]`, 0 outside, the token staying in the loss
        denominator (IcePop, Ling Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale
        Thinking Model"; OpenRLHF / NeMo-RL `icepop`; verl has no IcePop).
      reweight_lower: IcePop's lower bound (unused by `truncate`).
      batch_normalize: divide the weights by their mean over the batch's valid tokens.
      rejection: divergence criteria chained after the ratio rejection, e.g.
        `("seq_mean_k3=0.01", "token_k1=0.5_2.0")` (verl `rollout_rs` + `rollout_rs_threshold`;
        see `rl/rejection.py`). Empty: none.
      bypass: take the sampler's logprobs as pi_old and skip the dense recompute (verl
        `bypass_mode`): rho = 1, so veto, rejection and reweighting do nothing, and the policy
        loss's own ratio pi_theta / mu (PPO-clip: verl `bypass_ppo_clip`; REINFORCE x the
        truncated sequence IS weight with `learner.loss.policy_loss=reinforce`: verl
        `bypass_pg_is`; `reinforce_token` for a token weight) is the only off-policy
        correction. For dense samplers in sync only: `sparserl train` refuses it with a
        compressed KV cache.
    """

    log_ratio_bound: float = 20.0
    veto: bool = True
    veto_threshold: float = 1e-4
    reject: bool = True
    reject_level: CorrectionLevel = "token"
    reject_lower: float = 0.5
    reject_upper: float = 1.5
    reweight: bool = True
    reweight_level: CorrectionLevel = "token"
    reweight_upper: float = 1.5
    reweight_mode: ReweightMode = "truncate"
    reweight_lower: float = 0.5
    batch_normalize: bool = True
    rejection: tuple[str, ...] = ()
    bypass: bool = False

    def __post_init__(self):
        for name in ("reject_level", "reweight_level"):
            if getattr(self, name) not in CORRECTION_LEVELS:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported; "
                    f"expected one of {CORRECTION_LEVELS}"
                )
        if not self.log_ratio_bound > 0:
            raise ValueError(f"log_ratio_bound must be > 0, got {self.log_ratio_bound}")
        if not 0 < self.veto_threshold < 1:
            raise ValueError(f"veto_threshold must be in (0, 1), got {self.veto_threshold}")
        if not 0 <= self.reject_lower < self.reject_upper:
            raise ValueError(
                f"need 0 <= reject_lower < reject_upper, got [{self.reject_lower}, "
                f"{self.reject_upper}]"
            )
        if not self.reweight_upper > 0:
            raise ValueError(f"reweight_upper must be > 0, got {self.reweight_upper}")
        if self.reweight_mode not in REWEIGHT_MODES:
            raise ValueError(
                f"reweight_mode={self.reweight_mode!r} is not supported; expected one of "
                f"{REWEIGHT_MODES}"
            )
        if self.reweight_mode == "icepop" and not 0 <= self.reweight_lower < self.reweight_upper:
            raise ValueError(
                f"icepop needs 0 <= reweight_lower < reweight_upper, got [{self.reweight_lower}, "
                f"{self.reweight_upper}]"
            )
        for spec in self.rejection:
            parse_rejection(spec)
        if self.bypass and self.rejection:
            raise ValueError(
                f"bypass=True takes pi_old := mu, so rho = 1 and the rejection criteria "
                f"{self.rejection} could never fire; drop them or turn bypass off"
            )
        if self.bypass and self.reweight_mode == "icepop":
            raise ValueError(
                "bypass=True makes every IcePop weight rho = 1 (a no-op); use "
                "learner.loss.policy_loss=reinforce, reinforce_token or cispo for a weight on "
                "pi_theta / mu"
            )

    @classmethod
    def naive(cls) -> "SparseRLCorrectionConfig":
        """ "Naive sparse": no veto, no rejection, no reweighting (weights 1, mask unchanged)."""
        return cls(veto=False, reject=False, reweight=False, batch_normalize=False)

    @classmethod
    def icepop(cls, *, lower: float = 0.5, upper: float = 5.0) -> "SparseRLCorrectionConfig":
        """IcePop alone: token weights `rho` kept inside `[lower, upper]` (defaults: OpenRLHF's
        0.5 / 5.0), zeroed outside; no veto, no rejection, no batch normalisation."""
        return cls(
            veto=False,
            reject=False,
            reweight=True,
            reweight_mode="icepop",
            reweight_lower=lower,
            reweight_upper=upper,
            batch_normalize=False,
        )

    @classmethod
    def bypass_mode(cls) -> "SparseRLCorrectionConfig":
        """Bypass (pi_old := mu, no recompute) with the correction off (it would see rho = 1);
        pair with `policy_loss` `ppo` (verl `bypass_ppo_clip`) or `reinforce` (`bypass_pg_is`:
        sequence-level truncated IS at 2)."""
        return cls(veto=False, reject=False, reweight=False, batch_normalize=False, bypass=True)

    @classmethod
    def tis_only(cls, *, upper: float = 1.5, batch_normalize: bool = False):
        """Truncated importance sampling alone: `w = min(rho, upper)`, no veto, no rejection."""
        return cls(
            veto=False,
            reject=False,
            reweight=True,
            reweight_upper=upper,
            batch_normalize=batch_normalize,
        )


class CorrectionMetrics(NamedTuple):
    """Scalars reported every step (over the valid tokens / sequences of the original mask).

    `rejected_seq_fraction`: sequences left with no token (veto, sequence-level rejection, or every
    token masked); `vetoed_seq_fraction`: sequences dropped by the veto alone;
    `masked_token_fraction`: valid tokens removed from the loss for any reason; `rho_*`: the
    clamped token ratio pi_old / mu over the valid tokens (min, mean, max, and the 1st and 5th
    percentiles `rho_p1` / `rho_p5`, see `masked_percentile`, over the tokens drawn after
    the sampler's first eviction when the batch says which: the tail that the mean hides,
    after Sparrow, arXiv 2606.08446, which keeps p5 >= ~0.86); `mismatch_kl`: k3 estimate of
    KL(mu || pi_old), mean of `rho - 1 - log rho`; `ess`: normalised effective sample size of
    the token ratios, `(sum rho)^2 / (N sum rho^2)` in (0, 1].
    """

    rejected_seq_fraction: Float[Array, ""]
    vetoed_seq_fraction: Float[Array, ""]
    masked_token_fraction: Float[Array, ""]
    rho_min: Float[Array, ""]
    rho_mean: Float[Array, ""]
    rho_max: Float[Array, ""]
    rho_p1: Float[Array, ""]
    rho_p5: Float[Array, ""]
    mismatch_kl: Float[Array, ""]
    ess: Float[Array, ""]


class SparseRLCorrection(NamedTuple):
    """`loss_mask_bt` is the corrected mask `m'`; `weights_bt` the stop-gradient importance
    weights (0 at padding) to multiply into the per-token policy loss; `weight_scale` the
    batch statistic they were divided by (`batch_normalize`: the mean weight over the valid
    tokens, 1.0 when that is not positive; 1.0 without `batch_normalize`)."""

    loss_mask_bt: Float[Array, "B T"]
    weights_bt: Float[Array, "B T"]
    metrics: CorrectionMetrics
    weight_scale: Float[Array, ""]


class _Rows(NamedTuple):
    # What every row computes from its own tokens (see `correction_rows`).
    m_bt: Float[Array, "B T"]
    valid_bt: Bool[Array, "B T"]
    log_rho_bt: Float[Array, "B T"]
    rho_bt: Float[Array, "B T"]
    keep_bt: Float[Array, "B T"]
    vetoed_b: Bool[Array, " B"]
    w_bt: Float[Array, "B T"]  # before batch normalisation, not masked


def _level_log_ratio(
    raw_bt: Float[Array, "B T"], m_bt: Float[Array, "B T"], level: str, bound: float
) -> Float[Array, "B T"]:
    """`log rho` at a level, broadcast to every token, clamped to +-bound."""
    if level == "token":
        out_bt = raw_bt
    else:
        sum_b1 = jnp.sum(raw_bt * m_bt, axis=1, keepdims=True)
        if level == "geometric":
            sum_b1 = sum_b1 / jnp.maximum(jnp.sum(m_bt, axis=1, keepdims=True), 1.0)
        out_bt = jnp.broadcast_to(sum_b1, raw_bt.shape)
    return jnp.clip(out_bt, -bound, bound)


def masked_percentile(
    x_bt: Float[Array, "B T"], valid_bt: Bool[Array, "B T"], q: int
) -> Float[Array, ""]:
    """The `q`-th percentile (an int in [0, 100]) of `x` over the entries where `valid_bt`;
    1.0 when there are none (the ratio metrics' "no mismatch" value).

    Definition (numpy's default `method="linear"`): sort the N valid values ascending,
    `v_0 <= ... <= v_{N-1}`; with `h = q (N - 1) / 100`, the percentile is
    `v_floor(h) + (h - floor(h)) (v_floor(h)+1 - v_floor(h))`. `h` is split into its integer
    and fractional parts in integer arithmetic, so the index is exact for any N. One sort of
    the `B*T` entries (padding sorts last).
    """
    if not (isinstance(q, int) and 0 <= q <= 100):
        raise ValueError(f"q must be an int percentile in [0, 100], got {q!r}")
    n = jnp.sum(valid_bt.astype(jnp.int32))
    sorted_n = jnp.sort(jnp.where(valid_bt, x_bt.astype(jnp.float32), jnp.inf).reshape(-1))
    # Only entries below N are ever read; zero the padding so no inf - inf appears anywhere.
    sorted_n = jnp.where(jnp.arange(sorted_n.shape[0]) < n, sorted_n, 0.0)
    scaled = q * jnp.maximum(n - 1, 0)
    lo, frac = scaled // 100, (scaled % 100).astype(jnp.float32) / 100.0
    hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
    value = sorted_n[lo] + frac * (sorted_n[hi] - sorted_n[lo])
    return jnp.where(n > 0, value, 1.0)


def _rows(old_logp_bt, sampler_logp_bt, mask_bt, cfg: SparseRLCorrectionConfig) -> _Rows:
    m_bt = mask_bt.astype(jnp.float32)
    valid_bt = m_bt > 0
    # Padding may hold anything (even -inf); zero it so it never reaches exp or a sum.
    raw_bt = jnp.where(
        valid_bt, old_logp_bt.astype(jnp.float32) - sampler_logp_bt.astype(jnp.float32), 0.0
    )
    log_rho_bt = jnp.clip(raw_bt, -cfg.log_ratio_bound, cfg.log_ratio_bound)
    rho_bt = jnp.exp(log_rho_bt)

    keep_bt = m_bt
    vetoed_b = jnp.zeros(m_bt.shape[0], bool)
    if cfg.veto:
        vetoed_b = jnp.any(valid_bt & (log_rho_bt < math.log(cfg.veto_threshold)), axis=1)
        keep_bt = keep_bt * (~vetoed_b)[:, None].astype(jnp.float32)
    if cfg.reject:
        level_rho_bt = jnp.exp(
            _level_log_ratio(raw_bt, m_bt, cfg.reject_level, cfg.log_ratio_bound)
        )
        in_range_bt = (level_rho_bt >= cfg.reject_lower) & (level_rho_bt <= cfg.reject_upper)
        keep_bt = keep_bt * in_range_bt.astype(jnp.float32)
    if cfg.rejection:
        keep_bt = keep_bt * divergence_rejection_mask(
            old_logp_bt,
            sampler_logp_bt,
            m_bt,
            cfg.rejection,
            log_ratio_bound=cfg.log_ratio_bound,
        )

    if cfg.reweight and cfg.reweight_mode == "icepop":
        level_rho_bt = jnp.exp(
            _level_log_ratio(raw_bt, m_bt, cfg.reweight_level, cfg.log_ratio_bound)
        )
        inside_bt = (level_rho_bt >= cfg.reweight_lower) & (level_rho_bt <= cfg.reweight_upper)
        w_bt = jnp.where(inside_bt, level_rho_bt, 0.0)
    elif cfg.reweight:
        w_bt = jnp.minimum(
            jnp.exp(_level_log_ratio(raw_bt, m_bt, cfg.reweight_level, cfg.log_ratio_bound)),
            cfg.reweight_upper,
        )
    else:
        w_bt = jnp.ones_like(m_bt)
    return _Rows(m_bt, valid_bt, log_rho_bt, rho_bt, keep_bt, vetoed_b, w_bt)


def correction_rows(
    old_logp_bt: Float[Array, "B T"],
    sampler_logp_bt: Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    config: SparseRLCorrectionConfig | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """The row-local part of `sparse_rl_weights`: `(loss_mask_bt, weights_bt)` with the weights
    *before* batch normalisation (0 at padding), both stop-gradient.

    Every entry depends only on its own row (veto, rejection at every level and the weights
    are per token or per sequence), so micro-batches of whole rows compute it exactly, each on
    its own. `sparse_rl_weights(...)` on the whole batch has the same `loss_mask_bt` and
    `weights_bt = these weights / weight_scale`.
    """
    r = _rows(old_logp_bt, sampler_logp_bt, mask_bt, config or SparseRLCorrectionConfig())
    return jax.lax.stop_gradient(r.keep_bt), jax.lax.stop_gradient(r.w_bt * r.m_bt)


def sparse_rl_weights(
    old_logp_bt: Float[Array, "B T"],
    sampler_logp_bt: Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    config: SparseRLCorrectionConfig | None = None,
    after_eviction_bt: Bool[Array, "B T"] | None = None,
) -> SparseRLCorrection:
    """The Sparse-RL rejection mask and importance weights for one batch (see module docstring).

    Args:
      old_logp_bt: log pi_old of each sampled token (dense teacher forcing, old weights).
      sampler_logp_bt: log mu of each sampled token, recorded by the (sparse) sampler.
      mask_bt: response tokens that enter the loss (padding and prompt False).
      config: which parts are on; `None` means the Sparse-RL defaults.
      after_eviction_bt: the tokens the sparse sampler drew after its first eviction
        (`RolloutResult.after_eviction`). Given, the percentiles `rho_p1` / `rho_p5` run over
        the valid tokens among these only (1.0 when there are none): before any eviction the
        sampler is the dense policy, so counting those tokens would make the tail depend on
        how much of each sequence came before the budget filled. Nothing else changes.

    The batch mean used by `batch_normalize` runs over *this* whole batch: call it on the full
    rollout batch, before splitting into micro-batches (or split it yourself: `correction_rows`
    per micro-batch, then divide by this function's `weight_scale`). Sequences with no valid
    token (empty completions) are never vetoed and count in no fraction's denominator.
    """
    cfg = config or SparseRLCorrectionConfig()
    m_bt, valid_bt, log_rho_bt, rho_bt, keep_bt, vetoed_b, w_bt = _rows(
        old_logp_bt, sampler_logp_bt, mask_bt, cfg
    )
    n_valid = jnp.sum(m_bt)
    scale = jnp.ones((), jnp.float32)
    if cfg.batch_normalize:
        # Mean over the ORIGINAL mask, so rejected tokens still count (authors' code).
        mean_w = jnp.sum(w_bt * m_bt) / jnp.maximum(n_valid, 1.0)
        scale = jnp.where(mean_w > 0, mean_w, 1.0)
        w_bt = w_bt / scale
    w_bt = jax.lax.stop_gradient(w_bt * m_bt)
    keep_bt = jax.lax.stop_gradient(keep_bt)

    seq_valid_b = jnp.any(valid_bt, axis=1)
    n_seq = jnp.maximum(jnp.sum(seq_valid_b.astype(jnp.float32)), 1.0)
    emptied_b = rejected_sequences(keep_bt, valid_bt)
    safe_n = jnp.maximum(n_valid, 1.0)
    has_tokens = n_valid > 0
    rho_sum = jnp.sum(rho_bt * m_bt)
    tail_bt = valid_bt if after_eviction_bt is None else valid_bt & after_eviction_bt
    metrics = CorrectionMetrics(
        rejected_seq_fraction=jnp.sum(emptied_b.astype(jnp.float32)) / n_seq,
        vetoed_seq_fraction=jnp.sum((vetoed_b & seq_valid_b).astype(jnp.float32)) / n_seq,
        masked_token_fraction=jnp.sum(m_bt - keep_bt) / safe_n,
        rho_min=jnp.where(has_tokens, jnp.min(jnp.where(valid_bt, rho_bt, jnp.inf)), 1.0),
        rho_mean=jnp.where(has_tokens, rho_sum / safe_n, 1.0),
        rho_max=jnp.where(has_tokens, jnp.max(jnp.where(valid_bt, rho_bt, -jnp.inf)), 1.0),
        rho_p1=masked_percentile(rho_bt, tail_bt, 1),
        rho_p5=masked_percentile(rho_bt, tail_bt, 5),
        mismatch_kl=jnp.sum((rho_bt - 1.0 - log_rho_bt) * m_bt) / safe_n,
        ess=jnp.where(
            has_tokens, rho_sum**2 / (safe_n * jnp.maximum(jnp.sum(rho_bt**2 * m_bt), 1e-30)), 1.0
        ),
    )
    return SparseRLCorrection(
        loss_mask_bt=keep_bt, weights_bt=w_bt, metrics=metrics, weight_scale=scale
    )


def rejected_sequences(
    loss_mask_bt: Float[Array, "B T"], mask_bt: Bool[Array, "B T"] | Float[Array, "B T"]
) -> Bool[Array, " B"]:
    """The non-empty sequences that the correction left with no token in `loss_mask_bt` (an
    empty completion is never rejected: it had nothing to remove)."""
    return jnp.any(mask_bt.astype(bool), axis=1) & ~jnp.any(loss_mask_bt > 0, axis=1)


def rejection_by_advantage(
    loss_mask_bt: Float[Array, "B T"],
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    advantages_b: Float[Array, " B"],
) -> dict[str, Float[Array, ""]]:
    """Which sequences the correction removed, by the sign of their advantage (learner metrics).

    `rejected_pos_adv_fraction` / `rejected_neg_adv_fraction`: of the non-empty sequences with
    an advantage above / below zero, the fraction left with no token in `loss_mask_bt` (0 when
    there are none); `kept_advantage_mean`: the mean advantage over the sequences kept (0 when
    none). GRPO's advantages average zero within a group, so a kept mean above zero says the
    rejection removes the below-average samples more often than the good ones, and the update
    mostly reinforces (`train.advantages_over_kept` recomputes the advantages without them).
    """
    seq_valid_b = jnp.any(mask_bt.astype(bool), axis=1)
    rejected_b = rejected_sequences(loss_mask_bt, mask_bt)
    kept_b = seq_valid_b & ~rejected_b
    adv_b = advantages_b.astype(jnp.float32)

    def share(of_b):
        n = jnp.sum(of_b.astype(jnp.float32))
        return jnp.sum((rejected_b & of_b).astype(jnp.float32)) / jnp.maximum(n, 1.0)

    n_kept = jnp.sum(kept_b.astype(jnp.float32))
    return {
        "rejected_pos_adv_fraction": share(seq_valid_b & (adv_b > 0)),
        "rejected_neg_adv_fraction": share(seq_valid_b & (adv_b < 0)),
        "kept_advantage_mean": jnp.sum(jnp.where(kept_b, adv_b, 0.0)) / jnp.maximum(n_kept, 1.0),
    }


def correction_step_metrics(
    corr: SparseRLCorrection,
    mask_bt: Bool[Array, "B T"] | Float[Array, "B T"],
    advantages_b: Float[Array, " B"],
) -> dict[str, Float[Array, ""]]:
    """A learner step's `correction/*` scalars: `CorrectionMetrics` and `rejection_by_advantage`."""
    split = rejection_by_advantage(corr.loss_mask_bt, mask_bt, advantages_b)
    return {f"correction/{k}": v for k, v in (corr.metrics._asdict() | split).items()}
