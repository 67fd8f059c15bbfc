"""KV-cache memory: peak KV bytes of a dense and a compressed greedy generation."""

from __future__ import annotations

import jax
from flax import nnx

from sparserl_jax.kvcache import CompressionConfig, paged_cache_for
from sparserl_jax.testing.kv_oracle import greedy_generate


def memory_benchmark(
    model: nnx.Module,
    config: CompressionConfig,
    *,
    batch: int,
    gen_len: int,
    prompt_len: int = 16,
    page_size: int = 16,
    seed: int = 0,
    impl: str = "auto",
) -> dict:
    """Peak KV bytes in use for a dense (uncompressed, paged) run and a `config` run.

    Both runs share the model, the prompt and the page size; bytes are the peak of pages in use
    times the bytes per page (all layers, K and V, plus H2O's mass when tracked), not the pool's
    capacity. Returns `{"dense": {...}, "sparse": {...}, "ratio": sparse / dense}`.
    """
    cfg = model.cfg
    prompt = jax.random.randint(jax.random.key(seed), (batch, prompt_len), 0, cfg.vocab_size)
    max_len = prompt_len + gen_len
    results = {}
    runs = [
        (
            "dense",
            CompressionConfig(
                policy="none", budget=config.budget, window=config.window, interval=config.interval
            ),
        )
    ]
    runs.append(("sparse", config))
    for name, run_cfg in runs:
        cache = paged_cache_for(
            cfg,
            run_cfg,
            batch=batch,
            max_len=max_len,
            prompt_len=prompt_len,
            page_size=page_size,
            impl=impl,
        )
        _, cache, stats = greedy_generate(model, cache, prompt, gen_len=gen_len, config=run_cfg)
        aux = 0 if cache.q_window is None else cache.q_window.size * cache.q_window.dtype.itemsize
        results[name] = {
            "policy": run_cfg.policy,
            "kv_peak_bytes": stats.kv_peak_bytes,
            "peak_pages": stats.peak_pages,
            "page_bytes": stats.page_bytes,
            "pool_pages": stats.pool_pages,
            "tokens_evicted": stats.tokens_evicted,
            "final_lengths": stats.final_lengths,
            "query_window_bytes": aux,
        }
    results["ratio"] = results["sparse"]["kv_peak_bytes"] / results["dense"]["kv_peak_bytes"]
    results["target_ratio"] = (config.budget + config.interval + page_size) / (prompt_len + gen_len)
    return results
