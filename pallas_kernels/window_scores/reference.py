"""Pure-jnp window scoring: the SnapKV importance every paged-cache policy builds on.

SnapKV (Li et al., arXiv 2404.14469) and R-KV (arXiv 2505.24133), as Sparse-RL runs them
(`r1kv_utils.py`): for the last w (observation-window) queries,
`a_j = max_{g in group} mean_{i in window} softmax_j(q_i . k_j)`, the softmax over the row's kept
keys with the causal mask of the window (window query i, the i-th of the last w tokens, sees keys
up to kept index `len - w + i`). Window slot i is a real query only when `i >= w - n_queries`
(a row shorter than w has fewer). The 1-D max-pool (kernel 7) is applied by the policy, not here.

Layout as in `pallas_kernels.paged_attention.reference` (either pool layout); queries are
pre-scaled by 1/sqrt(H).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import pool_dims
from pallas_kernels.paged_attention.reference import gather_pages


def window_scores_reference(
    q_bwnh: Float[Array, "B W N H"],
    k_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    num_queries_b: Int[Array, " B"],
) -> Float[Array, "B K S"]:
    """Importance `[B, K, S]` (S = M * L) of each kept key; zero past the row's length."""
    b, w, n, h = q_bwnh.shape
    kh = pool_dims(k_pages.shape, head_dim=h)[2]
    g = n // kh
    s = page_table_bm.shape[1] * k_pages.shape[1]
    k_bskh = gather_pages(k_pages, page_table_bm).reshape(b, s, kh, h).astype(jnp.float32)
    key_s = jnp.arange(s, dtype=jnp.int32)
    win_w = jnp.arange(w, dtype=jnp.int32)
    # Window query i is token `len - w + i`; it sees kept keys up to and including itself.
    last_bw = lengths_b[:, None] - w + win_w[None, :]
    mask_bws = (key_s[None, None, :] <= last_bw[:, :, None]) & (
        key_s[None, None, :] < lengths_b[:, None, None]
    )
    q_valid_bw = win_w[None, :] >= (w - num_queries_b)[:, None]
    q_bwkgh = q_bwnh.reshape(b, w, kh, g, h).astype(jnp.float32)
    logits_bkgws = jnp.einsum(
        "bwkgh,bskh->bkgws", q_bwkgh, k_bskh, preferred_element_type=jnp.float32
    )
    logits_bkgws = jnp.where(mask_bws[:, None, None], logits_bkgws, -jnp.inf)
    max_bkgw1 = jnp.max(logits_bkgws, axis=-1, keepdims=True)
    max_bkgw1 = jnp.where(jnp.isfinite(max_bkgw1), max_bkgw1, 0.0)
    p_bkgws = jnp.exp(logits_bkgws - max_bkgw1)
    denom = jnp.sum(p_bkgws, axis=-1, keepdims=True)
    p_bkgws = p_bkgws / jnp.where(denom > 0, denom, 1.0)
    p_bkgws = jnp.where(q_valid_bw[:, None, None, :, None], p_bkgws, 0.0)
    mean_bkgs = jnp.sum(p_bkgws, axis=3) / jnp.maximum(num_queries_b, 1)[:, None, None, None]
    return jnp.max(mean_bkgs, axis=2)
