"""Paged, compressible KV cache: page pools, a jittable free-page stack, and the StreamingLLM,
SnapKV, H2O and R-KV compression policies that really give pages back."""

from sparserl_jax.kvcache.adaptive import BudgetController, BudgetState, budget_ladder
from sparserl_jax.kvcache.builder import paged_cache_for
from sparserl_jax.kvcache.compress import compress, compress_rows, release_slots, should_compress
from sparserl_jax.kvcache.config import (
    AdaptiveBudgetConfig,
    CompressionConfig,
    Granularity,
    Policy,
)
from sparserl_jax.kvcache.paged import PagedKVCache, PoolExhaustedError, check_overflow
from sparserl_jax.kvcache.policies import policy_scores, select_tokens

__all__ = [
    "AdaptiveBudgetConfig",
    "BudgetController",
    "BudgetState",
    "CompressionConfig",
    "Granularity",
    "PagedKVCache",
    "Policy",
    "PoolExhaustedError",
    "budget_ladder",
    "check_overflow",
    "compress",
    "compress_rows",
    "paged_cache_for",
    "policy_scores",
    "release_slots",
    "select_tokens",
    "should_compress",
]
