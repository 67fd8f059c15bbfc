"""Window scoring (SnapKV / R-KV importance) as a Pallas GPU kernel.

GPU lowering: **Pallas Triton** (`jax.experimental.pallas.triton.CompilerParams`), deprecated from
JAX 0.11 in favour of Mosaic GPU; this kernel stays on Triton until the page gather is ported (see
`paged_attention/kernel_gpu.py`). Runs on CPU with `interpret=True`; checked against XLA on an H100
(docs/results.md). Triton wants power-of-two extents of at least 16 for W, L and H: the window is
padded at its front with zero queries to `padded_rows(w)` (w = 8 runs as 16); a padded row r + (Wp -
w) sees exactly the keys real row r sees and is never a real query, so the scores are unchanged.

One program per (row, query head). Pass 1 walks the row's pages and keeps, for each of the w
window queries, the running max and sum of its causally masked softmax; pass 2 walks them again,
forms the probabilities and writes their mean over the real window queries for every key. The
max over the G query heads of a KV group is taken by the caller (`api.py`), so programs never
reduce across each other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import is_pow2, pool_dims
from pallas_kernels.paged_attention.kernel_gpu import padded_rows

_NEG = -1e30


def unsupported_reason(window: int, page_size: int, head_dim: int) -> str | None:
    """Why Triton would reject these extents (power-of-two dot tiles of at least 16), or None.

    Any window runs (padded at its front, `padded_rows`); page size and head dim are not padded.
    """
    del window
    for name, x in (("page size", page_size), ("head dim", head_dim)):
        if not (is_pow2(x) and x >= 16):
            return f"{name} {x} is not a power of two >= 16 (Triton dot tiles)"
    return None


def _kernel(lens_ref, nq_ref, pt_ref, q_ref, k_ref, o_ref, *, page_size, groups):
    b, n = pl.program_id(0), pl.program_id(1)
    kh = n // groups
    length, nq = lens_ref[b], nq_ref[b]
    q = q_ref[b, n].astype(jnp.float32)  # [W, H]
    w = q.shape[0]
    num_pages = (length + page_size - 1) // page_size

    def logits(p):
        k = k_ref[pt_ref[b, p], :, kh, :].astype(jnp.float32)  # [L, H]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [W, L]
        idx = p * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        row = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        visible = (idx < length) & (idx <= length - w + row)
        return jnp.where(visible, s, -jnp.inf), row

    def stats(p, carry):
        m, den = carry
        s, _ = logits(p)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        l_new = jnp.exp(m - m_new) * den + jnp.sum(jnp.exp(s - m_new[:, None]), axis=1)
        return m_new, l_new

    init = (jnp.full((w,), _NEG, jnp.float32), jnp.zeros((w,), jnp.float32))
    m, den = jax.lax.fori_loop(0, num_pages, stats, init)
    lse = m + jnp.log(jnp.where(den > 0, den, 1.0))
    inv_nq = 1.0 / jnp.maximum(nq, 1).astype(jnp.float32)

    def write(p, carry):
        s, row = logits(p)
        pr = jnp.where(row >= w - nq, jnp.exp(s - lse[:, None]), 0.0)
        o_ref[b, n, pl.ds(p * page_size, page_size)] = jnp.sum(pr, axis=0) * inv_nq
        return carry

    jax.lax.fori_loop(0, num_pages, write, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def window_scores_gpu(
    q_bwnh: Float[Array, "B W N H"],
    k_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    num_queries_b: Int[Array, " B"],
    *,
    interpret: bool = False,
    num_warps: int = 4,
) -> Float[Array, "B K S"]:
    """SnapKV importance `[B, K, M * L]`, zero past each row's length (see `reference.py`)."""
    b, w, n, h = q_bwnh.shape
    # A lane-dense pool is split by head here: free on a GPU (row-major, no tiles).
    shape = pool_dims(k_pages.shape, head_dim=h)
    k_pages = k_pages.reshape(shape)
    _, page_size, kh, _ = shape
    s = page_table_bm.shape[1] * page_size
    q_bwnh = jnp.pad(q_bwnh, ((0, 0), (padded_rows(w) - w, 0), (0, 0), (0, 0)))
    per_head = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, groups=n // kh),
        out_shape=jax.ShapeDtypeStruct((b, n, s), jnp.float32),
        grid=(b, n),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(lengths_b, num_queries_b, page_table_bm, jnp.swapaxes(q_bwnh, 1, 2), k_pages)
    return reduce_groups(per_head, lengths_b, kh)


def reduce_groups(per_head_bns: jax.Array, lengths_b: jax.Array, kv_heads: int) -> jax.Array:
    """Max over the query heads of each KV group; zero past the row's length."""
    b, n, s = per_head_bns.shape
    valid_bs = jnp.arange(s, dtype=jnp.int32)[None, :] < lengths_b[:, None]
    # Unwritten pages (past the length) hold garbage: mask before the max.
    x = jnp.where(valid_bs[:, None, :], per_head_bns, 0.0)
    return jnp.max(x.reshape(b, kv_heads, n // kv_heads, s), axis=2)
