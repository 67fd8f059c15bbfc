"""The reference decode loop: static greedy generation over `model.decode` on any cache.

The oracle of the rollout engine's sparse tests and of the long-generation test, and the loop of
`benchmarks.kv_memory`; the rollout engine (sampling, stop tokens, continuous batching) lives in
`sparserl_jax.rollout`. Each jitted chunk runs `chunk` decode steps in a `lax.scan`: one token
per row per step, then `compress` (a no-op unless the step counter is on the interval and a row
is above budget).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Int

from sparserl_jax.kvcache.compress import compress
from sparserl_jax.kvcache.config import CompressionConfig
from sparserl_jax.kvcache.paged import PagedKVCache, check_overflow


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """What a generation used: the peak of pages in use (not the pool's capacity)."""

    peak_pages: int
    peak_tokens: int
    page_bytes: int
    pool_pages: int
    tokens_evicted: int
    final_lengths: list[int]

    @property
    def kv_peak_bytes(self) -> int:
        return self.peak_pages * self.page_bytes


def greedy_generate(
    model: nnx.Module,
    cache: PagedKVCache,
    prompt_bt: Int[Array, "B T"],
    *,
    gen_len: int,
    config: CompressionConfig,
    chunk: int = 64,
) -> tuple[Int[Array, "B G"], PagedKVCache, GenerationStats]:
    """Prefill `prompt_bt`, then generate `gen_len` tokens greedily (argmax) per row.

    Raises `PoolExhaustedError` if any slot ran out of pages. Returns the generated tokens
    `[B, gen_len]`, the final cache and its memory statistics.
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, cache, prompt_bt):
        logits, cache = nnx.merge(graphdef, state).decode(prompt_bt, cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    @jax.jit
    def run_chunk(state, cache, tok_b, num_steps):
        mdl = nnx.merge(graphdef, state)

        def step(carry, i):
            cache, tok_b = carry
            live = i < num_steps  # the last chunk may be partial; its extra steps are masked
            logits, cache = mdl.decode(
                tok_b[:, None], cache, jnp.broadcast_to(live, tok_b.shape)[:, None]
            )
            cache = compress(cache, config)
            nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            return (cache, jnp.where(live, nxt, tok_b)), nxt

        (cache, tok_b), toks = jax.lax.scan(step, (cache, tok_b), jnp.arange(chunk))
        return cache, tok_b, toks.T

    tok_b, cache = prefill(state, cache, prompt_bt)
    out = [tok_b[:, None]]
    done = 1
    while done < gen_len:
        n = min(chunk, gen_len - done)
        cache, tok_b, toks = run_chunk(state, cache, tok_b, n)
        out.append(toks[:, :n])
        done += n
    check_overflow(cache)
    stats = GenerationStats(
        peak_pages=int(cache.peak_pages),
        peak_tokens=int(cache.peak_tokens),
        page_bytes=cache.page_bytes,
        pool_pages=cache.num_pages,
        tokens_evicted=int(jnp.sum(cache.evicted_b)),
        final_lengths=[int(x) for x in cache.lengths_b],
    )
    return jnp.concatenate(out, axis=1)[:, :gen_len], cache, stats
