"""Learner configuration: the policy loss, the optimizer and how a step is run.

The Sparse-RL correction (`SparseRLCorrectionConfig`) and Dynamic Gradient Gating (`DGGConfig`)
keep their configs next to their maths; `LearnerConfig` gathers all four.
"""

import dataclasses
from typing import Literal

import jax
import optax

from sparserl_jax.rl.correction import SparseRLCorrectionConfig
from sparserl_jax.rl.gating import DGGConfig
from sparserl_jax.rl.losses import AGGREGATIONS, KL_ESTIMATORS, Aggregation, KLEstimator
from sparserl_jax.rl.policy_losses import POLICY_LOSSES, PolicyLoss
from sparserl_jax.rollout.logprobs import LOGITS_CHUNK_SIZE

Schedule = Literal["constant", "linear", "cosine"]
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")

# (eps_low, eps_high) when left unset, per policy loss. PPO: the classic 0.2. GSPO: the paper's
# 3e-4 / 4e-4 (a sequence ratio, a geometric mean, moves far less than a token ratio). CISPO: no
# lower bound on the weight (MiniMax-M1) and 0.28 above (verl's CISPO example: 0.2). REINFORCE
# + IS (sequence or token weight): no lower bound, truncation at 2 (verl's
# `rollout_is_threshold` default).
DEFAULT_CLIP: dict[str, tuple[float, float]] = {
    "ppo": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
    "cispo": (1.0, 0.28),
    "reinforce": (1.0, 1.0),
    "reinforce_token": (1.0, 1.0),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The per-token objective: a policy loss on group advantages, optional KL and entropy terms.

    Attributes:
      policy_loss: `ppo` (PPO-clip, dual clip optional), `gspo` (sequence ratio, sequence clip),
        `gspo_token`, `cispo` (clipped stop-gradient IS weight x REINFORCE), `reinforce`
        (REINFORCE x the truncated sequence IS weight `min(prod_t r_t, 1 + eps_high)`: verl's
        `bypass_pg_is`, for bypass mode) or `reinforce_token` (REINFORCE x the truncated token
        weight `min(r_t, 1 + eps_high)`: verl `loss_type="reinforce"` with
        `rollout_is="token"`); verl `actor.policy_loss.loss_mode` (see docs/algorithms.md).
      eps_low, eps_high: clip range `[1 - eps_low, 1 + eps_high]` of the ratio (DAPO: 0.2 /
        0.28); unset (None), they take the policy loss's default (`DEFAULT_CLIP`: 0.2 / 0.2 for
        ppo, 3e-4 / 4e-4 for gspo and gspo_token, 1.0 / 0.28 for cispo, 1.0 / 1.0 for
        reinforce and reinforce_token). `eps_low = 1` means no lower bound.
      dual_clip: cap on the loss of negative-advantage tokens (`None`: off; verl uses 3).
      aggregation: `token_mean` (DAPO), `seq_mean_token_mean` (GRPO), `seq_mean_token_sum_norm`
        (Dr.GRPO).
      max_response_len: Dr.GRPO's constant normaliser (the array width when None).
      kl_coef: weight of KL(pi_theta || pi_ref); needs reference logprobs in the batch when > 0.
      kl_estimator: k1, k2 or k3.
      entropy_coef: entropy bonus (0: entropy is only reported).
      temperature: sampling temperature; logprobs are `log softmax(logits / temperature)`.
    """

    policy_loss: PolicyLoss = "ppo"
    eps_low: float | None = None
    eps_high: float | None = None
    dual_clip: float | None = None
    aggregation: Aggregation = "seq_mean_token_mean"
    max_response_len: int | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    temperature: float = 1.0

    def __post_init__(self):
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"policy_loss {self.policy_loss!r} unknown; expected one of {POLICY_LOSSES}"
            )
        low, high = DEFAULT_CLIP[self.policy_loss]
        if self.eps_low is None:
            object.__setattr__(self, "eps_low", low)
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", high)
        ppo_like = self.policy_loss in ("ppo", "gspo", "gspo_token")
        if not (0 <= self.eps_low < 1 or (self.eps_low == 1 and not ppo_like)):
            raise ValueError(
                f"need 0 <= eps_low < 1 for {self.policy_loss} (1 allowed for cispo, "
                f"reinforce and reinforce_token: no lower bound), got {self.eps_low}"
            )
        if not self.eps_high >= 0:
            raise ValueError(f"need eps_high >= 0, got {self.eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.dual_clip is not None and self.policy_loss != "ppo":
            raise ValueError(
                f"dual_clip applies to policy_loss='ppo' only, got policy_loss="
                f"{self.policy_loss!r} with dual_clip={self.dual_clip}"
            )
        if self.policy_loss == "gspo" and self.aggregation != "seq_mean_token_mean":
            raise ValueError(
                f"policy_loss='gspo' is a per-sequence objective averaged over sequences: it "
                f"needs aggregation='seq_mean_token_mean', got {self.aggregation!r} (use "
                "gspo_token for other aggregations)"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {self.aggregation!r} unknown; expected {AGGREGATIONS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator {self.kl_estimator!r} unknown; expected {KL_ESTIMATORS}"
            )
        if self.max_response_len is not None and self.max_response_len <= 0:
            raise ValueError(f"max_response_len must be positive, got {self.max_response_len}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(
                f"coefficients must be >= 0, got {self.kl_coef=}, {self.entropy_coef=}"
            )
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @classmethod
    def grpo(cls, **overrides) -> "LossConfig":
        return cls(**{"aggregation": "seq_mean_token_mean", **overrides})

    @classmethod
    def dr_grpo(cls, **overrides) -> "LossConfig":
        return cls(**{"aggregation": "seq_mean_token_sum_norm", **overrides})

    @classmethod
    def dapo(cls, **overrides) -> "LossConfig":
        return cls(**{"aggregation": "token_mean", "eps_low": 0.2, "eps_high": 0.28, **overrides})

    @classmethod
    def gspo(cls, **overrides) -> "LossConfig":
        """GSPO with the paper's clip range 3e-4 / 4e-4, averaged over sequences."""
        return cls(**{"policy_loss": "gspo", "aggregation": "seq_mean_token_mean", **overrides})

    @classmethod
    def cispo(cls, **overrides) -> "LossConfig":
        """CISPO as in MiniMax-M1: token-mean aggregation, weight clipped to [0, 1.28]."""
        return cls(**{"policy_loss": "cispo", "aggregation": "token_mean", **overrides})


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with a learning-rate schedule (defaults: Sparse-RL's Adam, lr 1e-6, betas
    (0.9, 0.98), weight decay 0.1). Weight decay skips vectors (biases, norm scales).

    `schedule`: `constant`, `linear` (to `end_lr_ratio * lr` at `total_steps`) or `cosine`;
    each starts with `warmup_steps` of linear warm-up from 0. Steps count applied updates.
    """

    learning_rate: float = 1e-6
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000
    end_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} unknown; expected one of {SCHEDULES}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.warmup_steps < 0 or self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"need 0 <= warmup_steps < total_steps, got {self.warmup_steps}, {self.total_steps}"
            )
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"betas must be in [0, 1), got ({self.b1}, {self.b2})")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")

    def lr_schedule(self) -> optax.Schedule:
        lr, warm = self.learning_rate, self.warmup_steps
        end = lr * self.end_lr_ratio
        if self.schedule == "cosine":
            return optax.warmup_cosine_decay_schedule(0.0, lr, warm, self.total_steps, end)
        if self.schedule == "linear":
            main = optax.linear_schedule(lr, end, self.total_steps - warm)
        else:
            main = optax.constant_schedule(lr)
        if warm == 0:
            return main
        return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), main], [warm])

    def build(self) -> optax.GradientTransformation:
        """The optax transformation (clipping is done by the learner, before the gate)."""
        return optax.adamw(
            self.lr_schedule(),
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            mask=decay_mask,
        )


def decay_mask(params):
    # Decay weight matrices only: biases and norm scales are not decayed (Megatron, most LLM
    # trainers).
    return jax.tree.map(lambda p: p.ndim >= 2, params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """Everything the learner step needs.

    `num_mini_batches`: optimiser steps per pass over a rollout batch (verl's
    `ppo_mini_batch_size` = rows / this): each pass updates on the batch's rows in that many
    strided slices (mini-batch j = rows j, j + n, ..., as the micro-batches: no data moves on
    a data-sharded mesh, and each slice holds samples of every GRPO group; verl's are
    contiguous slices of whole groups), in the same order every pass. Each slice is its own
    loss (its own denominators and Sparse-RL batch statistics, as verl's mini-batches); DGG
    sees every step and, on a fire at pass k > 1, discards it and ends the batch's reuse.
    pi_old is then the weights before the batch's first step, so it is recomputed by a
    separate forward (it cannot come from the first pass's forward, which for slices 2.. runs
    at updated weights).
    `num_micro_batches` splits each mini-batch for gradient accumulation (the rollout batch
    must divide by mini-batches x micro-batches x data shards). The step is exact under
    accumulation: loss denominators and Sparse-RL weights are computed on the whole
    mini-batch first.
    `logits_chunk_size`: sequence positions per chunk of the LM head (`rollout.head_logprobs`)
    in the loss and in pi_old / pi_ref: `[micro-batch, chunk, V]` fp32 logits at a time instead
    of `[micro-batch, T, V]`, recomputed in the backward pass (a T - 1 not divisible by it pads
    the last chunk). Results do not depend on it beyond float rounding.
    `old_logp_from_first_pass`: when pi_old is missing from a batch, take it from the first
    pass's forward (stop-gradient) instead of a separate teacher-forced recompute, saving one
    forward per batch (`rl.objective`; equal to the recompute to float rounding). Where a
    configuration cannot (`rl.objective.first_pass_fallback`: a KL or entropy term next to
    batch-normalised weights over several micro-batches) the learner recomputes.
    `attention_mask`: "dense" (default) computes the dense policy; "replay" the sparse policy
    the sampler ran, its recorded evictions replayed in the attention (`RLBatch.evict_pos_bykt`
    from `rollout.record_evictions`; `kvcache.evictions`): pi_old and pi_theta are then sparse
    policies, so rho = pi_old / mu starts at 1 up to float rounding and measures only staleness.
    """

    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    correction: SparseRLCorrectionConfig = dataclasses.field(
        default_factory=SparseRLCorrectionConfig
    )
    gating: DGGConfig = dataclasses.field(default_factory=DGGConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    num_mini_batches: int = 1
    num_micro_batches: int = 1
    logits_chunk_size: int = LOGITS_CHUNK_SIZE
    old_logp_from_first_pass: bool = True
    attention_mask: Literal["dense", "replay"] = "dense"

    def __post_init__(self):
        if self.attention_mask not in ("dense", "replay"):
            raise ValueError(
                f"attention_mask must be 'dense' or 'replay', got {self.attention_mask!r}"
            )
        if self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {self.num_micro_batches}")
        if self.num_mini_batches < 1:
            raise ValueError(f"num_mini_batches must be >= 1, got {self.num_mini_batches}")
        if self.logits_chunk_size < 1:
            raise ValueError(f"logits_chunk_size must be >= 1, got {self.logits_chunk_size}")
