"""Group-relative advantages for the GRPO family.

Rewards arrive flat, `[B]`, with the `G` samples of each prompt stored contiguously
(`B = P * G`, prompt p owns rows `p*G .. p*G + G - 1`), which is how the rollout engine emits
GRPO groups. Every function returns one advantage per sequence, `[B]`; the learner broadcasts it
over the sequence's tokens.

Every estimator gives exactly 0 to the samples of a group whose rewards are all equal
(`reinforce_pp`, which has no groups: to an all-equal batch).

Advantages are computed over the *full* group, before any Sparse-RL rejection (as Sparse-RL does):
rejecting a sample later removes its tokens from the loss, it never changes its siblings'
advantages.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

AdvantageEstimator = Literal[
    "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline"
]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "dr_grpo",
    "dapo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
)


def _groups(rewards_b: Float[Array, " B"], group_size: int) -> Float[Array, "P G"]:
    if rewards_b.ndim != 1:
        raise ValueError(f"rewards must be rank 1 [B], got shape {rewards_b.shape}")
    if group_size < 1 or rewards_b.shape[0] % group_size:
        raise ValueError(
            f"group_size must be >= 1 and divide the batch; got group_size={group_size} "
            f"for {rewards_b.shape[0]} rewards"
        )
    return rewards_b.astype(jnp.float32).reshape(-1, group_size)


def _zero_if_equal(
    adv_pg: Float[Array, "P G"],
    rewards_pg: Float[Array, "P G"],
    kept_pg: Bool[Array, "P G"] | None = None,
):
    # A group whose rewards are all equal carries no preference: its advantage is exactly 0.
    # Computing it as `R - mean` is not enough: for rewards float32 cannot hold exactly (a group
    # of 123.456s) the mean is off by an ulp and dividing by `std + eps` blows that up to ~1.
    # `kept_pg`: only those samples' rewards are compared (one kept sample: all equal).
    hi_pg = rewards_pg if kept_pg is None else jnp.where(kept_pg, rewards_pg, -jnp.inf)
    lo_pg = rewards_pg if kept_pg is None else jnp.where(kept_pg, rewards_pg, jnp.inf)
    same_p1 = jnp.max(hi_pg, axis=1, keepdims=True) == jnp.min(lo_pg, axis=1, keepdims=True)
    return jnp.where(same_p1, 0.0, adv_pg)


def _group_std(rewards_pg: Float[Array, "P G"], ddof: int) -> Float[Array, "P 1"]:
    g = rewards_pg.shape[1]
    if g - ddof <= 0:
        # A group of one sample has no spread; its centred reward is 0 anyway.
        return jnp.zeros((rewards_pg.shape[0], 1), jnp.float32)
    return jnp.std(rewards_pg, axis=1, ddof=ddof, keepdims=True)


def grpo_advantages(
    rewards_b: Float[Array, " B"], *, group_size: int, eps: float = 1e-6, std_ddof: int = 1
) -> Float[Array, " B"]:
    """GRPO advantage `A_i = (R_i - mean_g R) / (std_g R + eps)` (Shao et al. 2024, DeepSeekMath).

    `std_ddof=1` is the unbiased standard deviation that torch's `std` gives in verl / slime /
    TRL (which Sparse-RL ran on); pass 0 for the population std. A group whose rewards are all
    equal gets exactly advantage 0 for every sample (forced where max == min, so a 1-ulp error
    in the mean is never divided by `eps`), so it contributes no policy gradient.
    """
    r_pg = _groups(rewards_b, group_size)
    centred_pg = r_pg - jnp.mean(r_pg, axis=1, keepdims=True)
    return _zero_if_equal(centred_pg / (_group_std(r_pg, std_ddof) + eps), r_pg).reshape(-1)


def dr_grpo_advantages(rewards_b: Float[Array, " B"], *, group_size: int) -> Float[Array, " B"]:
    """Dr.GRPO advantage `A_i = R_i - mean_g R` (Liu et al. 2025, "Understanding R1-Zero-Like
    Training: A Critical Perspective"): no division by the group std, which biases GRPO towards
    groups with low reward spread. Pair it with the `seq_mean_token_sum_norm` aggregation (no
    per-sequence length normalisation).
    """
    r_pg = _groups(rewards_b, group_size)
    return _zero_if_equal(r_pg - jnp.mean(r_pg, axis=1, keepdims=True), r_pg).reshape(-1)


def rloo_advantages(rewards_b: Float[Array, " B"], *, group_size: int) -> Float[Array, " B"]:
    """RLOO advantage `A_i = R_i - (1 / (G - 1)) sum_{j != i} R_j` (Ahmadian et al. 2024, "Back
    to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs";
    Kool et al. 2019): each sample's baseline is the mean of its G - 1 siblings, an unbiased
    baseline. Equals `G / (G - 1) * (R_i - mean_g R)` (verl `rloo`, TRL `RLOOTrainer`).
    A group of one has no sibling: its advantage is 0.
    """
    r_pg = _groups(rewards_b, group_size)
    g = r_pg.shape[1]
    if g == 1:
        return jnp.zeros(r_pg.shape[0], jnp.float32)
    baseline_pg = (jnp.sum(r_pg, axis=1, keepdims=True) - r_pg) / (g - 1)
    return _zero_if_equal(r_pg - baseline_pg, r_pg).reshape(-1)


def _batch_whiten(x_b: Float[Array, " B"], eps: float) -> Float[Array, " B"]:
    # Unbiased std (torch's default, as verl's `masked_whiten`); one sequence has no spread.
    if x_b.shape[0] < 2:
        return jnp.zeros_like(x_b)
    return (x_b - jnp.mean(x_b)) / (jnp.std(x_b, ddof=1) + eps)


def reinforce_pp_advantages(
    rewards_b: Float[Array, " B"], *, group_size: int, eps: float = 1e-6
) -> Float[Array, " B"]:
    """REINFORCE++ advantage `A_i = (R_i - mean_B R) / (std_B R + eps)` (Hu 2025, "REINFORCE++:
    A Simple and Efficient Approach for Aligning Large Language Models"): the outcome reward
    (gamma 1, no critic) normalised over the whole batch instead of per group.

    REINFORCE++ has no groups; `group_size` only checks the batch shape. The all-equal rule
    applies to its "group", the batch: a batch of equal rewards gives exactly 0. Deviation from
    verl (`reinforce_plus_plus`): verl whitens over response *tokens* (each sequence weighted by
    its length); here every sequence counts once.
    """
    r_pg = _groups(rewards_b, group_size)
    r_b = r_pg.reshape(-1)
    same = jnp.max(r_b) == jnp.min(r_b)
    return jnp.where(same, 0.0, _batch_whiten(r_b, eps))


def reinforce_pp_baseline_advantages(
    rewards_b: Float[Array, " B"], *, group_size: int, eps: float = 1e-6
) -> Float[Array, " B"]:
    """REINFORCE++-baseline: `A'_i = R_i - mean_g R` (the group mean as baseline), then
    batch-normalised `A_i = (A'_i - mean_B A') / (std_B A' + eps)` (Hu 2025; verl
    `reinforce_plus_plus_baseline`, OpenRLHF `reinforce_baseline`).

    Samples of an all-equal group get exactly 0 (before and after the normalisation). As in
    `reinforce_pp_advantages`, the batch statistics weight sequences, not tokens.
    """
    r_pg = _groups(rewards_b, group_size)
    centred_pg = _zero_if_equal(r_pg - jnp.mean(r_pg, axis=1, keepdims=True), r_pg)
    whitened_pg = _batch_whiten(centred_pg.reshape(-1), eps).reshape(r_pg.shape)
    return _zero_if_equal(whitened_pg, r_pg).reshape(-1)


def dapo_advantages(
    rewards_b: Float[Array, " B"], *, group_size: int, eps: float = 1e-6, std_ddof: int = 1
) -> Float[Array, " B"]:
    """DAPO advantage (Yu et al. 2025, "DAPO: An Open-Source LLM RL System at Scale").

    DAPO keeps GRPO's group-normalised advantage `(R_i - mean_g R) / (std_g R + eps)`; what it
    changes lives elsewhere: token-level loss aggregation (`token_mean`), clip-higher
    (eps_low 0.2 / eps_high 0.28), dynamic sampling (`dynamic_sampling_mask`) and the soft
    overlong penalty (`dapo_overlong_penalty`, added to the reward before this function).
    """
    return grpo_advantages(rewards_b, group_size=group_size, eps=eps, std_ddof=std_ddof)


def dynamic_sampling_mask(rewards_b: Float[Array, " B"], *, group_size: int) -> Bool[Array, " B"]:
    """DAPO dynamic sampling: True for samples whose group has at least two distinct rewards.

    Groups that are all-correct or all-wrong have zero advantage and only dilute the batch; DAPO
    drops them and samples more prompts.
    """
    r_pg = _groups(rewards_b, group_size)
    informative_p = jnp.max(r_pg, axis=1) > jnp.min(r_pg, axis=1)
    return jnp.repeat(informative_p, group_size)


def dapo_overlong_penalty(
    lengths_b: Int[Array, " B"], *, max_len: int, cache_len: int
) -> Float[Array, " B"]:
    """DAPO soft overlong punishment, added to the task reward.

    `0` if `|y| <= L_max - L_cache`; `((L_max - L_cache) - |y|) / L_cache` inside the cache
    band; `-1` beyond `L_max`.
    """
    if not 0 < cache_len < max_len:
        raise ValueError(f"need 0 < cache_len < max_len, got cache_len={cache_len}, {max_len=}")
    soft = max_len - cache_len
    length = lengths_b.astype(jnp.float32)
    penalty = (soft - length) / cache_len
    return jnp.where(length <= soft, 0.0, jnp.where(length <= max_len, penalty, -1.0))


GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "rloo")


def kept_group_advantages(
    rewards_b: Float[Array, " B"],
    kept_b: Bool[Array, " B"],
    *,
    group_size: int,
    estimator: AdvantageEstimator = "grpo",
    eps: float = 1e-6,
    std_ddof: int = 1,
) -> Float[Array, " B"]:
    """A group estimator (`GROUP_ESTIMATORS`) over the kept samples of each group only.

    A sample with `kept_b` False gets advantage 0 and leaves its group's statistics: the mean,
    the std (GRPO, DAPO) and RLOO's sibling baseline run over the kept samples, so the kept
    advantages of a group again average zero. A group left with fewer than two kept samples, or
    whose kept rewards are all equal, gives 0. With every sample kept this is the estimator
    itself. Sparse-RL keeps its full-group advantages after rejection (`compute_advantages`);
    this is the alternative (`train.advantages_over_kept`).
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(
            f"advantages over the kept samples need a group estimator {GROUP_ESTIMATORS}, "
            f"got {estimator!r}"
        )
    r_pg = _groups(rewards_b, group_size)
    if kept_b.shape != rewards_b.shape:
        raise ValueError(f"kept_b {kept_b.shape} must match the rewards {rewards_b.shape}")
    k_pg = kept_b.reshape(r_pg.shape).astype(bool)
    kf_pg = k_pg.astype(jnp.float32)
    n_p1 = jnp.sum(kf_pg, axis=1, keepdims=True)
    sum_p1 = jnp.sum(r_pg * kf_pg, axis=1, keepdims=True)
    if estimator == "rloo":
        adv_pg = r_pg - (sum_p1 - r_pg) / jnp.maximum(n_p1 - 1, 1.0)
    else:
        adv_pg = r_pg - sum_p1 / jnp.maximum(n_p1, 1.0)
        if estimator != "dr_grpo":
            sq_p1 = jnp.sum(jnp.where(k_pg, adv_pg, 0.0) ** 2, axis=1, keepdims=True)
            std_p1 = jnp.sqrt(sq_p1 / jnp.maximum(n_p1 - std_ddof, 1.0))
            adv_pg = adv_pg / (std_p1 + eps)
    return jnp.where(k_pg, _zero_if_equal(adv_pg, r_pg, k_pg), 0.0).reshape(-1)


def compute_advantages(
    rewards_b: Float[Array, " B"], *, group_size: int, estimator: AdvantageEstimator = "grpo"
) -> Float[Array, " B"]:
    """Dispatch on the estimator name (one of `ADVANTAGE_ESTIMATORS`)."""
    if estimator == "grpo":
        return grpo_advantages(rewards_b, group_size=group_size)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards_b, group_size=group_size)
    if estimator == "dapo":
        return dapo_advantages(rewards_b, group_size=group_size)
    if estimator == "rloo":
        return rloo_advantages(rewards_b, group_size=group_size)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards_b, group_size=group_size)
    if estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards_b, group_size=group_size)
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected {ADVANTAGE_ESTIMATORS}")
