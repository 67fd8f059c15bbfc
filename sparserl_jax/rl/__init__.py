"""RL maths and the learner: GRPO-family advantages and losses, the Sparse-RL correction,
Dynamic Gradient Gating and the sharded learner step.

Research code can import the pure functions into its own JAX loop:

    from sparserl_jax.rl import grpo_advantages, ppo_clip_loss, aggregate_loss, sparse_rl_weights

or use the whole sharded step: `Learner(model, LearnerConfig(), mesh=mesh)`.
"""

from sparserl_jax.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    dapo_advantages,
    dapo_overlong_penalty,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from sparserl_jax.rl.config import LearnerConfig, LossConfig, OptimizerConfig
from sparserl_jax.rl.correction import (
    CorrectionMetrics,
    SparseRLCorrection,
    SparseRLCorrectionConfig,
    sparse_rl_weights,
)
from sparserl_jax.rl.gating import (
    DGGConfig,
    DGGDecision,
    DGGState,
    GradientGate,
    dynamic_gradient_gating,
    lm_head_grad_energy,
    lm_head_grad_energy_gram,
)
from sparserl_jax.rl.learner import (
    Learner,
    LearnerState,
    RLBatch,
    batch_shards,
    train_step,
)
from sparserl_jax.rl.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Aggregation,
    KLEstimator,
    aggregate_loss,
    aggregation_weights,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    ppo_clip_fraction,
    ppo_clip_loss,
    shifted_token_logprobs,
    token_logprobs,
)
from sparserl_jax.rl.policy_losses import (
    POLICY_LOSSES,
    PolicyLoss,
    cispo_loss,
    compute_policy_loss,
    gspo_loss,
    gspo_token_loss,
    reinforce_is_loss,
    sequence_log_ratio,
)
from sparserl_jax.rl.rejection import (
    REJECTION_CRITERIA,
    RejectionCriterion,
    divergence_rejection_mask,
    divergence_statistic,
    parse_rejection,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "AdvantageEstimator",
    "Aggregation",
    "CorrectionMetrics",
    "DGGConfig",
    "DGGDecision",
    "DGGState",
    "GradientGate",
    "KLEstimator",
    "KL_ESTIMATORS",
    "Learner",
    "LearnerConfig",
    "LearnerState",
    "LossConfig",
    "OptimizerConfig",
    "POLICY_LOSSES",
    "PolicyLoss",
    "REJECTION_CRITERIA",
    "RLBatch",
    "batch_shards",
    "RejectionCriterion",
    "SparseRLCorrection",
    "SparseRLCorrectionConfig",
    "aggregate_loss",
    "aggregation_weights",
    "cispo_loss",
    "compute_advantages",
    "compute_policy_loss",
    "dapo_advantages",
    "dapo_overlong_penalty",
    "divergence_rejection_mask",
    "divergence_statistic",
    "dr_grpo_advantages",
    "dynamic_gradient_gating",
    "dynamic_sampling_mask",
    "entropy_from_logits",
    "grpo_advantages",
    "gspo_loss",
    "gspo_token_loss",
    "kl_penalty",
    "lm_head_grad_energy",
    "lm_head_grad_energy_gram",
    "masked_mean",
    "parse_rejection",
    "ppo_clip_fraction",
    "ppo_clip_loss",
    "reinforce_is_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_log_ratio",
    "shifted_token_logprobs",
    "sparse_rl_weights",
    "token_logprobs",
    "train_step",
]
