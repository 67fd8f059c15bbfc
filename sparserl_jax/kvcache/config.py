"""Compression settings for the paged KV cache.

Defaults follow Sparse-RL's release (arXiv 2601.10079 and its code): budget B = 512 tokens,
observation window w = 8, re-compress every 128 decode steps once a row holds more than B tokens,
keep the top (B - w) tokens by score plus the w most recent, 1-D max-pool kernel 7, R-KV mixing
λ = 0.1 (the R-KV repository uses 0.07).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Policy = Literal["none", "streaming", "snapkv", "h2o", "rkv"]
Granularity = Literal["sequence", "layer", "head"]
POLICIES: tuple[str, ...] = ("none", "streaming", "snapkv", "h2o", "rkv")
GRANULARITIES: tuple[str, ...] = ("sequence", "layer", "head")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveBudgetConfig:
    """A controller of the budget B between RL steps (`rollout.kv.adaptive`; off by default).

    It watches `correction/rho_p5`, the 5th percentile of the token ratio pi_old / mu, and keeps
    it at or above `target` (Sparrow, arXiv 2606.08446: p5 >= ~0.86; the mean cannot tell a
    stable run from a collapsing one). The law (`kvcache.adaptive.BudgetController`): after a
    step, p5 < target raises B one rung of the ladder at once; p5 > target + margin for
    `patience` steps in a row lowers it one rung; in between B holds. The ladder is `levels`
    budgets from `min_budget` to `max_budget` in equal whole-page steps through the start
    budget, so the rollout programs compile at most once per rung
    (`kvcache.adaptive.budget_ladder`).

    Attributes:
      enabled: run the controller (`sparserl train` only; the decoupled jobs refuse it).
      target: the p5 floor.
      margin: the hysteresis band: B is lowered only while p5 > target + margin.
      patience: steps in a row above the band before B is lowered (raising never waits).
      min_budget: the lowest budget (tokens); None: half of `budget` (at least window + 1), so
        the budget can go down from where it starts.
      max_budget: the highest budget (tokens); None: the rollout's whole length
        (`max_prompt_len + max_new_tokens`, where nothing is ever evicted).
      levels: the most rungs on the ladder (min and max included).
      backoff: a lowering whose rung falls below `target` within `patience` steps multiplies the
        wait before the next lowering by this (1: never; `kvcache.adaptive`'s docstring).
      max_patience: the longest wait, in steps above the band, that the backoff reaches.
      max_rejected: also raise B after a step whose correction rejected more than this fraction
        of its sequences (`correction/rejected_seq_fraction`); None: p5 alone (Sparrow's law).
    """

    enabled: bool = False
    target: float = 0.86
    margin: float = 0.05
    patience: int = 2
    min_budget: int | None = None
    max_budget: int | None = None
    levels: int = 6
    backoff: int = 2
    max_patience: int = 32
    max_rejected: float | None = None

    def __post_init__(self):
        if not 0 < self.target <= 1:
            raise ValueError(f"adaptive.target must be in (0, 1], got {self.target}")
        if not self.margin > 0:
            raise ValueError(
                f"adaptive.margin must be > 0 (the hysteresis band), got {self.margin}"
            )
        if self.patience < 1:
            raise ValueError(f"adaptive.patience must be >= 1, got {self.patience}")
        if self.levels < 2:
            raise ValueError(f"adaptive.levels must be >= 2, got {self.levels}")
        if self.backoff < 1:
            raise ValueError(f"adaptive.backoff must be >= 1 (1: no backoff), got {self.backoff}")
        if self.max_patience < self.patience:
            raise ValueError(
                f"adaptive.max_patience ({self.max_patience}) must be >= adaptive.patience "
                f"({self.patience})"
            )
        if self.max_rejected is not None and not 0 <= self.max_rejected < 1:
            raise ValueError(f"adaptive.max_rejected must be in [0, 1), got {self.max_rejected}")
        lo, hi = self.min_budget, self.max_budget
        if lo is not None and hi is not None and not lo < hi:
            raise ValueError(f"adaptive needs min_budget < max_budget, got [{lo}, {hi}]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Which tokens a compression keeps, and when it runs.

    Attributes:
      policy: none (never compress), streaming (StreamingLLM: sinks + recent), snapkv (window
        attention, pooled), h2o (accumulated attention mass), rkv (λ·importance −
        (1−λ)·redundancy).
      budget: B, the tokens a row keeps after a compression.
      window: w, the observation window (queries scored with) and the recent tokens always kept.
      interval: compress when the batch step counter is a multiple of this and a row holds > B.
      kernel_size: the 1-D max-pool applied to SnapKV / R-KV importance (odd).
      rkv_lambda: λ in `score = λ·a − (1−λ)·s` (Sparse-RL 0.1, R-KV repo 0.07).
      rkv_sim_threshold: cosine similarity above which a later key is a "highly similar partner".
      rkv_retain_last: zero each key's similarity to its most recent highly similar partner
        before averaging (R-KV `retain_direction="last"`), so the latest copy survives.
      sink_tokens: StreamingLLM's always-kept first tokens.
      granularity: one kept set per sequence (Sparse-RL), per layer, or per KV head (R-KV).
      adaptive: move `budget` between RL steps to hold the ratio's tail (`AdaptiveBudgetConfig`);
        `budget` is then where it starts.
    """

    policy: Policy = "rkv"
    budget: int = 512
    window: int = 8
    interval: int = 128
    kernel_size: int = 7
    rkv_lambda: float = 0.1
    rkv_sim_threshold: float = 0.5
    rkv_retain_last: bool = True
    sink_tokens: int = 4
    granularity: Granularity = "sequence"
    adaptive: AdaptiveBudgetConfig = AdaptiveBudgetConfig()

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} unknown; expected one of {POLICIES}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"granularity {self.granularity!r} unknown; expected one of {GRANULARITIES}"
            )
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.budget <= self.window:
            raise ValueError(f"budget ({self.budget}) must exceed window ({self.window})")
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {self.kernel_size}")
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"rkv_lambda must be in [0, 1], got {self.rkv_lambda}")
        if self.sink_tokens < 0 or (
            self.policy == "streaming" and self.sink_tokens > self.budget - self.window
        ):
            raise ValueError(
                f"sink_tokens must be in [0, budget - window = {self.budget - self.window}], "
                f"got {self.sink_tokens}"
            )
        ad = self.adaptive
        if ad.enabled:
            if self.policy == "none":
                raise ValueError("adaptive.enabled needs a compression policy, not 'none'")
            lo = self.budget if ad.min_budget is None else ad.min_budget
            if lo <= self.window:
                raise ValueError(f"adaptive.min_budget ({lo}) must exceed window ({self.window})")
            hi = "the rollout length" if ad.max_budget is None else ad.max_budget
            if not lo <= self.budget <= (ad.max_budget or self.budget):
                raise ValueError(
                    f"budget ({self.budget}) is where the adaptive budget starts: it must lie "
                    f"in [adaptive.min_budget, adaptive.max_budget] = [{lo}, {hi}]"
                )

    @property
    def needs_queries(self) -> bool:
        """SnapKV and R-KV score with the last w queries, which the cache must record."""
        return self.policy in ("snapkv", "rkv")

    @property
    def needs_attention_mass(self) -> bool:
        """H2O scores with the attention mass each key has received."""
        return self.policy == "h2o"

    def pages_per_slot(self, page_size: int, prompt_len: int = 0) -> int:
        """Pages a slot can need: `ceil((max(B, prompt) + interval) / page_size)` plus one spare.

        Between two compressions a row grows by at most `interval` tokens past the larger of B
        and its prompt (the check before let it pass at length <= B, or it was just prefilled),
        so that is the ceiling; the spare page absorbs a budget that is not a multiple of the
        page size.
        """
        if self.policy == "none":
            raise ValueError("policy 'none' never compresses; size the pool for the full length")
        return cdiv(max(self.budget, prompt_len) + self.interval, page_size) + 1
