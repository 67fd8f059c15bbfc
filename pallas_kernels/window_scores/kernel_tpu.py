"""Window scoring (SnapKV / R-KV importance) as a Mosaic TPU Pallas kernel.

Grid (row, lane block of kv heads, pass, page) with the lengths, window sizes and the flattened
page table scalar-prefetched into SMEM. Pass 0 accumulates each window query's softmax max and
sum in VMEM scratch; pass 1 revisits the pages and writes, per query head, the mean (over real
window queries) probability of every key. The max over a KV group's query heads is taken by the
caller. Steps past the row's last page re-use the last block (no DMA) and skip compute.

Layout as in `paged_attention/kernel_tpu.py`: the pool viewed as `[P, L, K * H]`, r kv heads per
128-lane block, queries block-diagonal in rows `(i * G + g) * W + w` (padded to a multiple of 8).
The mean over a head's W rows is a matmul with a 0/1 selection matrix, so no row reshapes happen
inside the kernel. The output is `[B, K / r, M, C, L]` (C = r G rounded up to 8), whose blocks'
last two dims are whole array dims for every page size.

Supported when compiled: the shapes `paged_attention.kernel_tpu.unsupported_reason` accepts (page
size a multiple of 8, kv heads tiling 128 lanes, SMEM tables within budget); bf16 or fp32 pools.
Any shape runs in interpret mode (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import cdiv, pool_dims
from pallas_kernels.paged_attention.kernel_tpu import (
    SUBLANES,
    heads_per_lane_block,
    lane_pack_queries,
)
from pallas_kernels.window_scores.kernel_gpu import reduce_groups

_NEG = -1e30
_HIGHEST = jax.lax.Precision.HIGHEST


def _kernel(
    lens_ref, nq_ref, pt_ref, q_ref, wpos_ref, sel_ref, k_ref, o_ref, m_sc, l_sc, *, page_size, w
):
    b, ph, p = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length, nq = lens_ref[b], nq_ref[b]

    @pl.when((ph == 0) & (p == 0))
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)

    def logits():
        q = q_ref[...]  # [R, C] fp32
        k = k_ref[...].astype(jnp.float32)  # [L, C]
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
        )
        idx = p * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        wpos = wpos_ref[...]  # [R, 1]: the row's window slot (padding rows: far negative)
        visible = (idx < length) & (idx <= length - w + wpos)
        return jnp.where(visible, s, -jnp.inf), wpos

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
        s, wpos = logits()
        den = l_sc[...]
        lse = m_sc[...] + jnp.log(jnp.where(den > 0, den, 1.0))
        pr = jnp.where(wpos >= w - nq, jnp.exp(s - lse), 0.0)
        inv_nq = 1.0 / jnp.maximum(nq, 1).astype(jnp.float32)
        sums = jnp.dot(sel_ref[...], pr, precision=_HIGHEST, preferred_element_type=jnp.float32)
        o_ref[...] = sums * inv_nq


@functools.partial(jax.jit, static_argnames=("interpret",))
def window_scores_tpu(
    q_bwnh: Float[Array, "B W N H"],
    k_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    num_queries_b: Int[Array, " B"],
    *,
    interpret: bool = False,
) -> Float[Array, "B K S"]:
    """SnapKV importance `[B, K, M * L]`, zero past each row's length (see `reference.py`).

    `interpret`: run in Pallas' HLO interpreter (any platform), as the api does off a TPU.
    """
    b, w, n, h = q_bwnh.shape
    num_pages, page_size, kh, _ = pool_dims(k_pages.shape, head_dim=h)
    g = n // kh
    m = page_table_bm.shape[1]
    r = heads_per_lane_block(kh, h) or 1
    j, c = kh // r, r * h
    heads = r * g  # query heads per lane block
    rows = cdiv(heads * w, SUBLANES) * SUBLANES
    out_rows = cdiv(heads, SUBLANES) * SUBLANES
    # Rows (i, g, w): pack [B, N * W, H] with the window innermost, as if N * W query heads.
    q_bnwh = jnp.swapaxes(q_bwnh, 1, 2).reshape(b, n * w, h)
    q_pack = lane_pack_queries(q_bnwh, kh, r, rows)
    row = jnp.arange(rows, dtype=jnp.int32)
    wpos_r1 = jnp.where(row < heads * w, row % w, -(2**30))[:, None]
    sel_cr = (row[None, :] // w == jnp.arange(out_rows, dtype=jnp.int32)[:, None]) & (
        row[None, :] < heads * w
    )
    sel_cr = sel_cr.astype(jnp.float32)
    k_flat = k_pages.reshape(num_pages, page_size, kh * h)

    def k_map(bi, ji, ph, p, lens_ref, nq_ref, pt_ref):
        last = jnp.maximum((lens_ref[bi] + page_size - 1) // page_size - 1, 0)
        return jnp.maximum(pt_ref[bi * m + jnp.minimum(p, last)], 0), 0, ji

    def o_map(bi, ji, ph, p, *_):
        return bi, ji, p * ph, 0, 0  # pass 0 parks on block 0; pass 1 writes every page

    def whole(*shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, j, 2, m),
        in_specs=[
            pl.BlockSpec((None, None, rows, c), lambda bi, ji, ph, p, *_: (bi, ji, 0, 0)),
            whole(rows, 1),
            whole(out_rows, rows),
            pl.BlockSpec((None, page_size, c), k_map),
        ],
        out_specs=pl.BlockSpec((None, None, None, out_rows, page_size), o_map),
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32)],
    )
    per_head = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, w=w),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, j, m, out_rows, page_size), jnp.float32),
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")
        ),
    )(
        lengths_b.astype(jnp.int32),
        num_queries_b.astype(jnp.int32),
        page_table_bm.reshape(-1).astype(jnp.int32),
        q_pack,
        wpos_r1,
        sel_cr,
        k_flat,
    )
    per_head = jnp.transpose(per_head[:, :, :, :heads], (0, 1, 3, 2, 4))  # [B, J, rG, M, L]
    return reduce_groups(per_head.reshape(b, n, m * page_size), lengths_b, kh)
