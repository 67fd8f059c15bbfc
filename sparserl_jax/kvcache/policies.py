"""Token scores of the four compression policies, and the top-k selection they share.

Every policy scores each kept token of one layer, `[B, K, S]` (higher = keep); `select_tokens`
turns scores into the kept indices: the top (B − w) candidates by score plus the w most recent
tokens, sorted by position (Sparse-RL / R-KV). Candidates are the tokens before the window.

- StreamingLLM (Xiao et al., arXiv 2309.17453): the first `sink_tokens` plus the most recent.
- SnapKV (Li et al., arXiv 2404.14469): `a_j` = window attention (mean over the last w queries,
  max over the query heads of a KV group), then a 1-D max-pool (kernel 7) over candidates.
  The softmax runs over all kept keys with the window's causal mask (SnapKV); R-KV's code
  normalises over the candidates only, which rescales each query's row.
- H2O (Zhang et al., arXiv 2306.14048): the attention mass each key has received over all
  steps so far (summed over the query heads of its group).
- R-KV (Cai et al., arXiv 2505.24133): `λ·a_j − (1−λ)·r_j`, `a` as SnapKV, `r_j` = softmax over
  candidates of the mean (over rows i) cosine similarity `cos(k_i, k_j)`, diagonal zeroed and,
  with `retain_last`, each row's most recent partner above the threshold zeroed (R-KV's
  `retain_direction="last"`; rows with no such partner are left alone, where R-KV's argmax would
  zero column 0).

Axis letters as in the package docstring (`sparserl_jax`).

Granularity: per KV head uses the scores as they are; per layer sums them over KV heads; per
sequence sums over layers and KV heads (Sparse-RL sums over heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import window_scores
from pallas_kernels.paged_attention.reference import gather_pages, layer_pages
from sparserl_jax.kvcache.config import CompressionConfig
from sparserl_jax.kvcache.paged import PagedKVCache


def candidate_mask(lengths_b: Int[Array, " B"], s: int, window: int) -> Bool[Array, "B S"]:
    """Tokens that compete for the B − w scored places: those before the recent window."""
    return jnp.arange(s, dtype=jnp.int32)[None, :] < (lengths_b - window)[:, None]


def max_pool_1d(
    x_bks: Float[Array, "B K S"], valid_bs: Bool[Array, "B S"], kernel_size: int
) -> Float[Array, "B K S"]:
    """Stride-1 max-pool of width `kernel_size` over valid positions (others are ignored)."""
    x = jnp.where(valid_bs[:, None, :], x_bks, -jnp.inf)
    pad = kernel_size // 2
    pooled = jax.lax.reduce_window(
        x, -jnp.inf, jax.lax.max, (1, 1, kernel_size), (1, 1, 1), ((0, 0), (0, 0), (pad, pad))
    )
    return jnp.where(valid_bs[:, None, :], pooled, 0.0)


def streaming_scores(cache: PagedKVCache, config: CompressionConfig, layer: int):
    """Sinks rank above everything, then tokens rank by recency. `[B, K, S]`, as every scorer:
    one layer's scores."""
    del layer
    s = cache.capacity
    j = jnp.arange(s, dtype=jnp.float32)
    score_s = jnp.where(j < config.sink_tokens, 2.0 * s, j)
    return jnp.broadcast_to(score_s, (cache.page_table.shape[0], cache.kv_heads, s))


def snapkv_scores(cache: PagedKVCache, config: CompressionConfig, layer: int):
    """Pooled window attention (needs the recorded query window)."""
    if cache.q_window is None:
        raise ValueError("snapkv/rkv scoring needs a cache created with window > 0")
    valid_bs = candidate_mask(cache.lengths_b, cache.capacity, config.window)
    qw_bwnh, nq_b = cache.window_queries(layer)
    # The whole stacked pool with the layer's page table (`layer_pages`: no slice copied).
    k_flat, table = layer_pages(cache.k_pages, cache.page_table, layer)
    a_bks = window_scores(
        qw_bwnh, k_flat, table, cache.lengths_b, nq_b, impl=cache.impl, mesh=cache.mesh
    )
    return max_pool_1d(a_bks, valid_bs, config.kernel_size)


def h2o_scores(cache: PagedKVCache, config: CompressionConfig, layer: int):
    """Accumulated attention mass per stored key, read through the page table."""
    del config
    if cache.attn_mass is None:
        raise ValueError("h2o scoring needs a cache created with track_attention_mass=True")
    mass_bsk = gather_pages(*layer_pages(cache.attn_mass, cache.page_table, layer))
    return jnp.transpose(mass_bsk, (0, 2, 1))


def redundancy_scores(
    k_bskh: Float[Array, "B S K H"],
    valid_bs: Bool[Array, "B S"],
    *,
    threshold: float,
    retain_last: bool,
) -> Float[Array, "B K S"]:
    """R-KV redundancy: softmax over candidates of the mean cosine similarity to the others."""
    s = k_bskh.shape[1]
    k32 = k_bskh.astype(jnp.float32)
    kn = k32 / (jnp.linalg.norm(k32, axis=-1, keepdims=True) + 1e-8)
    sim_bkij = jnp.einsum("bikh,bjkh->bkij", kn, kn, preferred_element_type=jnp.float32)
    eye = jnp.eye(s, dtype=bool)
    pair_bij = valid_bs[:, :, None] & valid_bs[:, None, :] & ~eye[None]
    sim_bkij = jnp.where(pair_bij[:, None], sim_bkij, 0.0)
    if retain_last:
        j = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]
        partner = jnp.where(sim_bkij > threshold, j, -1)
        last_bki = jnp.max(partner, axis=-1)
        sim_bkij = jnp.where(j == last_bki[..., None], 0.0, sim_bkij)
    rows_b = jnp.maximum(jnp.sum(valid_bs, axis=1), 1).astype(jnp.float32)
    mean_bkj = jnp.sum(sim_bkij, axis=2) / rows_b[:, None, None]
    logits = jnp.where(valid_bs[:, None, :], mean_bkj, -jnp.inf)
    red = jax.nn.softmax(logits, axis=-1)
    return jnp.where(valid_bs[:, None, :], red, 0.0)


# Slots scored together by R-KV's redundancy: its `[slots, K, S, S]` similarities are built
# for this many slots at a time (`lax.map`), so its temporaries do not grow with the batch.
REDUNDANCY_BLOCK = 8


def rkv_redundancy(
    cache: PagedKVCache,
    valid_bs: Bool[Array, "B S"],
    config: CompressionConfig,
    layer: int,
    *,
    block: int,
) -> Float[Array, "B K S"]:
    """`redundancy_scores` of one layer, `block` slots at a time, each block's keys read from
    the pool through its page table (no `[B, S, K, H]` copy of the layer's keys)."""
    table_bm = jnp.maximum(cache.page_table, 0)
    b = table_bm.shape[0]

    def rows(args):
        table_gm, valid_gs = args
        k_gmlc = cache.k_pages[layer, table_gm]  # whole pages of token rows
        k_gskh = k_gmlc.reshape(k_gmlc.shape[0], -1, cache.kv_heads, cache.head_dim)
        return redundancy_scores(
            k_gskh,
            valid_gs,
            threshold=config.rkv_sim_threshold,
            retain_last=config.rkv_retain_last,
        )

    # Blocks of `block` rows: [B // block, block, ...] mapped sequentially, the rest
    # (B % block rows) in one more call.
    full = b - b % block
    out = []
    if full:
        blocked = jax.tree.map(
            lambda x: x[:full].reshape((full // block, block) + x.shape[1:]),
            (table_bm, valid_bs),
        )
        red = jax.lax.map(rows, blocked)
        out.append(red.reshape((full,) + red.shape[2:]))
    if b % block:
        out.append(rows((table_bm[full:], valid_bs[full:])))
    return out[0] if len(out) == 1 else jnp.concatenate(out)


def rkv_scores(cache: PagedKVCache, config: CompressionConfig, layer: int):
    """`λ·importance − (1−λ)·redundancy` per KV head."""
    importance = snapkv_scores(cache, config, layer)
    valid_bs = candidate_mask(cache.lengths_b, cache.capacity, config.window)
    red = rkv_redundancy(cache, valid_bs, config, layer, block=REDUNDANCY_BLOCK)
    lam = config.rkv_lambda
    return lam * importance - (1.0 - lam) * red


SCORERS = {
    "streaming": streaming_scores,
    "snapkv": snapkv_scores,
    "h2o": h2o_scores,
    "rkv": rkv_scores,
}


def layer_scores(cache: PagedKVCache, config: CompressionConfig, layer: int):
    """Layer `layer`'s scores `[B, K, S]` (fp32), summed over KV heads (broadcast) unless the
    granularity is per head; per sequence the caller sums them over layers too."""
    if config.policy == "none":
        raise ValueError("policy 'none' has no scores")
    scores = SCORERS[config.policy](cache, config, layer).astype(jnp.float32)
    if config.granularity != "head":
        scores = jnp.broadcast_to(jnp.sum(scores, axis=1, keepdims=True), scores.shape)
    return scores


def policy_scores(cache: PagedKVCache, config: CompressionConfig) -> Float[Array, "Y B K S"]:
    """Scores `[layers, B, K, S]` of `config.policy`, reduced to its granularity (broadcast)."""
    scores = jnp.stack([layer_scores(cache, config, y) for y in range(cache.k_pages.shape[0])])
    if config.granularity == "sequence":
        scores = jnp.broadcast_to(jnp.sum(scores, axis=0, keepdims=True), scores.shape)
    return scores


def select_tokens(
    scores_ybks: Float[Array, "Y B K S"], lengths_b: Int[Array, " B"], config: CompressionConfig
) -> Int[Array, "Y B K J"]:
    """Kept indices `[layers, B, K, budget]`, increasing: top (B − w) candidates + the last w.

    Meaningful for rows longer than the budget (the others are not compressed). Ties go to the
    earlier token (`lax.top_k`).
    """
    s = scores_ybks.shape[-1]
    w, budget = config.window, config.budget
    valid_bs = candidate_mask(lengths_b, s, w)
    masked = jnp.where(valid_bs[None, :, None, :], scores_ybks, -jnp.inf)
    _, top = jax.lax.top_k(masked, budget - w)
    top = jnp.sort(top.astype(jnp.int32), axis=-1)
    recent_bw = lengths_b[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None, :]
    recent = jnp.broadcast_to(recent_bw[None, :, None, :], top.shape[:-1] + (w,))
    return jnp.concatenate([top, recent], axis=-1)
