"""Window scoring (SnapKV / R-KV importance) as a Mosaic TPU Pallas kernel.

Grid (row, query head, pass, page) with the lengths, window sizes and page table
scalar-prefetched. Pass 0 accumulates each window query's softmax max and sum in VMEM scratch;
pass 1 revisits the pages and writes the mean (over real window queries) probability of every
key. The max over a KV group's query heads is taken by the caller. Steps past the row's last page
re-use the last block (no DMA) and skip compute.

Tested on CPU under `pltpu.force_tpu_interpret_mode()`. On a real TPU the output block's last dim
(the page size) should be a multiple of 128 and W a multiple of 8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels.window_scores.kernel_gpu import reduce_groups

_NEG = -1e30


def _kernel(lens_ref, nq_ref, pt_ref, q_ref, k_ref, o_ref, m_sc, l_sc, *, page_size):
    b, ph, p = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length, nq = lens_ref[b], nq_ref[b]
    q = q_ref[...].astype(jnp.float32)  # [W, H]
    w = q.shape[0]

    @pl.when((ph == 0) & (p == 0))
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)

    def logits():
        k = k_ref[...].astype(jnp.float32)  # [L, H]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        idx = p * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        row = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        visible = (idx < length) & (idx <= length - w + row)
        return jnp.where(visible, s, -jnp.inf), row

    live = p * page_size < length

    @pl.when(live & (ph == 0))
    def _stats():
        s, _ = logits()
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        l_sc[...] = jnp.exp(m_prev - m_new) * l_sc[...] + jnp.sum(
            jnp.exp(s - m_new), axis=1, keepdims=True
        )
        m_sc[...] = m_new

    @pl.when(live & (ph == 1))
    def _write():
        s, row = logits()
        den = l_sc[...]
        lse = m_sc[...] + jnp.log(jnp.where(den > 0, den, 1.0))
        pr = jnp.where(row >= w - nq, jnp.exp(s - lse), 0.0)
        inv_nq = 1.0 / jnp.maximum(nq, 1).astype(jnp.float32)
        o_ref[...] = jnp.sum(pr, axis=0, keepdims=True) * inv_nq


@jax.jit
def window_scores_tpu(
    q_bwnh: Float[Array, "B W N H"],
    k_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    num_queries_b: Int[Array, " B"],
) -> Float[Array, "B K S"]:
    """SnapKV importance `[B, K, M * L]`, zero past each row's length (see `reference.py`)."""
    b, w, n, h = q_bwnh.shape
    _, page_size, kh, _ = k_pages.shape
    g = n // kh
    m = page_table_bm.shape[1]

    def k_map(bi, ni, ph, p, lens_ref, nq_ref, pt_ref):
        last = jnp.maximum((lens_ref[bi] + page_size - 1) // page_size - 1, 0)
        return jnp.maximum(pt_ref[bi, jnp.minimum(p, last)], 0), 0, ni // g, 0

    def o_map(bi, ni, ph, p, *_):
        return bi, ni, 0, p * ph  # pass 0 parks on block 0; pass 1 writes every page

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, n, 2, m),
        in_specs=[
            pl.BlockSpec((None, None, w, h), lambda bi, ni, ph, p, *_: (bi, ni, 0, 0)),
            pl.BlockSpec((None, page_size, None, h), k_map),
        ],
        out_specs=pl.BlockSpec((None, None, 1, page_size), o_map),
        scratch_shapes=[pltpu.VMEM((w, 1), jnp.float32), pltpu.VMEM((w, 1), jnp.float32)],
    )
    per_head = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, n, 1, m * page_size), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")
        ),
    )(lengths_b, num_queries_b, page_table_bm, jnp.swapaxes(q_bwnh, 1, 2), k_pages)
    return reduce_groups(per_head[:, :, 0], lengths_b, kh)
