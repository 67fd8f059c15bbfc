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
