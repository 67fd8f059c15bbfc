"""Pure-jnp paged attention: the specification the kernels are tested against.

Layout (one layer): `k_pages, v_pages [P, L, K, H]` (P pages of L tokens, K kv heads, head dim
H), or lane-dense `[P, L, K * H]` (`_dispatch.pool_dims`; the rollout cache stores them so);
`page_table [B, M]` lists the pages of each row in logical order (entries past the row's pages
are ignored and may be -1); logical token j of row b lives at
`pages[page_table[b, j // L], j % L]`. Queries are pre-scaled by 1/sqrt(H). Query head n uses kv
head n // G, G = N // K (Hugging Face `repeat_kv`). Softmax in fp32; outputs are fp32.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import pool_dims


def gather_pages(
    pages_pl: Float[Array, "P L ..."], page_table_bm: Int[Array, "B M"]
) -> Float[Array, "B S ..."]:
    """Each row's pages laid end to end: `[B, M * L, ...]` (unused pages read page 0)."""
    b, m = page_table_bm.shape
    gathered = jnp.take(pages_pl, jnp.maximum(page_table_bm, 0), axis=0)
    return gathered.reshape((b, m * pages_pl.shape[1]) + pages_pl.shape[2:])


def layer_pages(
    pool_yp: Float[Array, "Y P L ..."], page_table_bm: Int[Array, "B M"], layer: int
) -> tuple[Float[Array, "YP L ..."], Int[Array, "B M"]]:
    """Layer `layer` of a stacked pool as an op reads or updates it without slicing it out:
    the pool seen as one pool of `Y * P` pages (a free reshape, the lane-dense layout's leading
    dims) and the page table shifted to the layer's pages (-1 stays -1). A slice `pool[layer]`
    given to a kernel or an in-place update is a copy of the layer (and stacking the layers
    back builds a new pool)."""
    y, p = pool_yp.shape[:2]
    flat = pool_yp.reshape((y * p,) + pool_yp.shape[2:])
    return flat, jnp.where(page_table_bm >= 0, page_table_bm + layer * p, -1)


def paged_attention_reference(
    q_btnh: Float[Array, "B T N H"],
    k_pages: Float[Array, "P L K H"],
    v_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    q_index_bt: Int[Array, "B T"],
    kv_len_b: Int[Array, " B"],
    *,
    return_probs: bool = False,
) -> tuple[Float[Array, "B T N H"], Float[Array, "B T N S"] | None]:
    """Causal attention of T queries per row over the row's paged keys.

    Query t of row b sits at logical index `q_index_bt[b, t]` and sees keys j with
    `j <= q_index_bt[b, t]` and `j < kv_len_b[b]`. A query with no visible key returns zeros.
    With `return_probs`, also the softmax probabilities `[B, T, N, S]` (S = M * L), zero on
    masked keys: what H2O accumulates.
    """
    b, t, n, h = q_btnh.shape
    kh = pool_dims(k_pages.shape, head_dim=h)[2]
    g = n // kh
    # Gathered whole pages (token rows of K * H in the lane-dense layout), then split by head.
    s = page_table_bm.shape[1] * k_pages.shape[1]
    k_bskh = gather_pages(k_pages, page_table_bm).reshape(b, s, kh, h)
    v_bskh = gather_pages(v_pages, page_table_bm).reshape(b, s, kh, h)
    key_s = jnp.arange(s, dtype=jnp.int32)
    mask_bts = (key_s[None, None, :] <= q_index_bt[:, :, None]) & (
        key_s[None, None, :] < kv_len_b[:, None, None]
    )
    q_btkgh = q_btnh.reshape(b, t, kh, g, h).astype(jnp.float32)
    logits_bkgts = jnp.einsum(
        "btkgh,bskh->bkgts", q_btkgh, k_bskh.astype(jnp.float32), preferred_element_type=jnp.float32
    )
    logits_bkgts = jnp.where(mask_bts[:, None, None], logits_bkgts, -jnp.inf)
    max_bkgt1 = jnp.max(logits_bkgts, axis=-1, keepdims=True)
    max_bkgt1 = jnp.where(jnp.isfinite(max_bkgt1), max_bkgt1, 0.0)
    p_bkgts = jnp.exp(logits_bkgts - max_bkgt1)
    denom_bkgt1 = jnp.sum(p_bkgts, axis=-1, keepdims=True)
    p_bkgts = p_bkgts / jnp.where(denom_bkgt1 > 0, denom_bkgt1, 1.0)
    out_btkgh = jnp.einsum(
        "bkgts,bskh->btkgh", p_bkgts, v_bskh.astype(jnp.float32), preferred_element_type=jnp.float32
    )
    out_btnh = out_btkgh.reshape(b, t, n, h)
    if not return_probs:
        return out_btnh, None
    probs_btns = jnp.transpose(p_bkgts, (0, 3, 1, 2, 4)).reshape(b, t, n, s)
    return out_btnh, probs_btns


def paged_decode_attention_reference(
    q_bnh: Float[Array, "B N H"],
    k_pages: Float[Array, "P L K H"],
    v_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    *,
    return_probs: bool = False,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N S"] | None]:
    """One decode query per row over its first `lengths_b[b]` keys (the new key included)."""
    q_index_b1 = (lengths_b - 1)[:, None]
    out, probs = paged_attention_reference(
        q_bnh[:, None],
        k_pages,
        v_pages,
        page_table_bm,
        q_index_b1,
        lengths_b,
        return_probs=return_probs,
    )
    return out[:, 0], None if probs is None else probs[:, 0]


def probs_from_logits(
    logits_bns: Float[Array, "B N S"], lse_bn: Float[Array, "B N"], lengths_b: Int[Array, " B"]
) -> Float[Array, "B N S"]:
    """Per-key probabilities from a kernel's raw logits and log-sum-exp (masked past length)."""
    s = logits_bns.shape[-1]
    valid_bs = jnp.arange(s, dtype=jnp.int32)[None, :] < lengths_b[:, None]
    probs = jnp.exp(logits_bns - lse_bn[:, :, None])
    return jnp.where(valid_bs[:, None, :], probs, 0.0)


__all__ = [
    "gather_pages",
    "layer_pages",
    "paged_attention_reference",
    "paged_decode_attention_reference",
    "probs_from_logits",
]
