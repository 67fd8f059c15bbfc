"""Build a `PagedKVCache` sized for a model, a compression config and a batch."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import Mesh

from pallas_kernels._dispatch import Impl
from sparserl_jax.kvcache.config import CompressionConfig, cdiv
from sparserl_jax.kvcache.evictions import record_shape
from sparserl_jax.kvcache.paged import PagedKVCache


def paged_cache_for(
    model_cfg,
    config: CompressionConfig,
    *,
    batch: int,
    max_len: int,
    prompt_len: int = 0,
    page_size: int = 16,
    num_pages: int | None = None,
    dtype: jnp.dtype | None = None,
    impl: Impl = "auto",
    mesh: Mesh | None = None,
    record_evictions: bool = False,
) -> PagedKVCache:
    """An empty cache for `batch` slots of a `ModelConfig`-like `model_cfg`.

    Pages per slot: `ceil(max_len / page_size)` with no compression, else
    `config.pages_per_slot(page_size, prompt_len)` (capped by that). The pool defaults to
    `batch * pages_per_slot` pages: exactly what a full batch can hold at once. `mesh`: the
    devices the kernels run on (`PagedKVCache.create`). `record_evictions`: keep the eviction
    record of `max_len` positions at the config's granularity (`kvcache.evictions`).
    """
    full = cdiv(max_len, page_size)
    per_slot = (
        full if config.policy == "none" else min(full, config.pages_per_slot(page_size, prompt_len))
    )
    record = None
    if record_evictions:
        record = record_shape(
            config.granularity,
            layers=model_cfg.num_layers,
            kv_heads=model_cfg.num_kv_heads,
            max_len=max_len,
        )
    return PagedKVCache.create(
        num_layers=model_cfg.num_layers,
        batch=batch,
        num_pages=num_pages if num_pages is not None else batch * per_slot,
        page_size=page_size,
        max_pages_per_slot=per_slot,
        num_kv_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        num_heads=model_cfg.num_heads,
        window=config.window if config.needs_queries else 0,
        track_attention_mass=config.needs_attention_mass,
        evict_record=record,
        dtype=jnp.dtype(dtype if dtype is not None else model_cfg.compute_dtype),
        impl=impl,
        mesh=mesh,
    )
