"""Paged decode attention as a Mosaic TPU Pallas kernel.

Grid (row, kv head, page): the page table and lengths are scalar-prefetched into SMEM so each
K/V BlockSpec fetches the row's p-th physical page (steps past the row's last page re-use the last
block, so no DMA is issued, and skip compute). The G query heads of the group keep an online
softmax in VMEM scratch; the last page step writes the output and the log-sum-exp, and every page
step may write its raw logits (for H2O's per-key probabilities).

Tested on CPU under `pltpu.force_tpu_interpret_mode()`. On a real TPU the blocks' last two dims
must tile (8, 128): use page_size a multiple of 128 when returning logits, and G padded to 8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

_NEG = -1e30


def _page_index(b, p, lens_ref, pt_ref, page_size):
    last = jnp.maximum((lens_ref[b] + page_size - 1) // page_size - 1, 0)
    return jnp.maximum(pt_ref[b, jnp.minimum(p, last)], 0)


def _kernel(lens_ref, pt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *rest, page_size, with_logits):
    logits_ref = rest[0] if with_logits else None
    m_sc, l_sc, acc_sc = rest[-3:]
    b, p = pl.program_id(0), pl.program_id(2)
    length = lens_ref[b]

    @pl.when(p == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(p * page_size < length)
    def _step():
        q = q_ref[...].astype(jnp.float32)  # [G, H]
        k = k_ref[...].astype(jnp.float32)  # [L, H]
        v = v_ref[...].astype(jnp.float32)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        idx = p * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(idx < length, s, -jnp.inf)
        if with_logits:
            logits_ref[...] = s
        m_prev = m_sc[...]  # [G, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        pr = jnp.exp(s - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(pr, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + jnp.dot(pr, v, preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(p == pl.num_programs(2) - 1)
    def _finish():
        den = l_sc[...]
        safe_l = jnp.where(den > 0, den, 1.0)
        o_ref[...] = acc_sc[...] / safe_l
        lse_ref[...] = m_sc[...] + jnp.log(safe_l)


@functools.partial(jax.jit, static_argnames=("return_logits",))
def paged_decode_attention_tpu(
    q_bnh: Float[Array, "B N H"],
    k_pages: Float[Array, "P L K H"],
    v_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    *,
    return_logits: bool = False,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N"], Float[Array, "B N S"] | None]:
    """Same contract as `kernel_gpu.paged_decode_attention_gpu` (fp32 out, lse, raw logits)."""
    b, n, h = q_bnh.shape
    _, page_size, kh, _ = k_pages.shape
    g = n // kh
    m = page_table_bm.shape[1]
    q_bkgh = q_bnh.reshape(b, kh, g, h)
    page_map = functools.partial(_page_index, page_size=page_size)

    def kv_map(bi, ki, p, lens_ref, pt_ref):
        return page_map(bi, p, lens_ref, pt_ref), 0, ki, 0

    def row_map(bi, ki, p, lens_ref, pt_ref):
        return bi, ki, 0, 0

    kv_spec = pl.BlockSpec((None, page_size, None, h), kv_map)
    out_specs = [
        pl.BlockSpec((None, None, g, h), row_map),
        pl.BlockSpec((None, None, g, 1), row_map),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, kh, g, h), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, g, 1), jnp.float32),
    ]
    if return_logits:
        out_specs.append(
            pl.BlockSpec((None, None, g, page_size), lambda bi, ki, p, *_: (bi, ki, 0, p))
        )
        out_shape.append(jax.ShapeDtypeStruct((b, kh, g, m * page_size), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, kh, m),
        in_specs=[pl.BlockSpec((None, None, g, h), row_map), kv_spec, kv_spec],
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((g, 1), jnp.float32),
            pltpu.VMEM((g, 1), jnp.float32),
            pltpu.VMEM((g, h), jnp.float32),
        ],
    )
    outs = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, with_logits=return_logits),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
    )(lengths_b, page_table_bm, q_bkgh, k_pages, v_pages)
    out = outs[0].reshape(b, n, h)
    lse = outs[1].reshape(b, n)
    logits = outs[2].reshape(b, n, m * page_size) if return_logits else None
    return out, lse, logits
