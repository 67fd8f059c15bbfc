"""Paged decode attention as a Mosaic TPU Pallas kernel.

Grid (row, lane block of kv heads, page). The lengths and the flattened page table are
scalar-prefetched into SMEM; each K/V BlockSpec fetches the row's p-th physical page (steps past
the row's last page re-use the last block, so no DMA is issued, and skip compute). The query
heads of a lane block keep an online softmax in VMEM scratch; the last page step writes the output
and the log-sum-exp, and every page step may write its raw logits (for H2O's per-key mass).

Layout for Mosaic's (8, 128) tiling: the pool is viewed as `[P, L, K * H]` and a block holds
`r = 128 // H` kv heads side by side in its 128 lanes (r = 1 when H is a multiple of 128). The
queries of those heads are laid out block-diagonally (`lane_pack_queries`): row `i * G + g`
carries query head g of the i-th kv head in that head's lanes and zeros elsewhere, so one
`[R, r H] x [L, r H]^T` matmul gives every head's logits, and `P V` gives each row's output in
its own head's lanes. Rows are padded to a multiple of 8; outputs are unpacked by the wrapper.

Supported when compiled (`unsupported_reason` says why not; `api.py` then runs XLA): page size a
multiple of 8; head dim a multiple of 128, or a divisor of 128 with the kv heads filling whole
lane blocks (K a multiple of 128 // H, or K * H <= 128); the SMEM tables (B * (M + 1) int32) under
`SMEM_BUDGET_BYTES`. Any dtype the reference takes (bf16, fp32): blocks are upcast to fp32 in
VMEM. Checked by AOT compiles for v5e / v5p / v6e in `tests/kernels/test_tpu_aot.py`. In
interpret mode (CPU tests) any shape runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import cdiv, pool_dims

_NEG = -1e30
LANES, SUBLANES = 128, 8
# SMEM is 1 MiB on v5e, v5p and v6e (a 1 MiB table fails to compile on each); leave half of it
# to the compiler and to other kernels' tables.
SMEM_BUDGET_BYTES = 512 * 1024
_HIGHEST = jax.lax.Precision.HIGHEST


def heads_per_lane_block(kv_heads: int, head_dim: int) -> int | None:
    """How many kv heads share a lane block (r), or None when no block can tile them."""
    if head_dim % LANES == 0:
        return 1
    if LANES % head_dim:
        return None
    r = LANES // head_dim
    if kv_heads % r == 0:
        return r
    return kv_heads if kv_heads * head_dim <= LANES else None


def unsupported_reason(
    kv_shape: tuple[int, ...], batch: int, max_pages: int, *, smem_words: int = 0
) -> str | None:
    """Why Mosaic cannot compile the kernel for a `[P, L, K, H]` pool, or None if it can."""
    _, page_size, kv_heads, head_dim = kv_shape
    if page_size % SUBLANES:
        return f"page size {page_size} is not a multiple of {SUBLANES}"
    if heads_per_lane_block(kv_heads, head_dim) is None:
        return f"{kv_heads} kv heads of dim {head_dim} do not tile {LANES} lanes"
    words = batch * (max_pages + 1) + smem_words
    if 4 * words > SMEM_BUDGET_BYTES:
        return f"scalar tables of {4 * words} bytes exceed SMEM_BUDGET_BYTES={SMEM_BUDGET_BYTES}"
    return None


def lane_pack_queries(q_bnh: Array, kv_heads: int, r: int, rows: int) -> Array:
    """`[B, N, H]` -> `[B, K / r, rows, r * H]` fp32, block-diagonal (see the module docstring)."""
    b, n, h = q_bnh.shape
    g = n // kv_heads
    q = q_bnh.astype(jnp.float32).reshape(b, kv_heads // r, r, g, h)
    eye = jnp.eye(r, dtype=jnp.float32)
    packed = jnp.einsum("bjigh,ik->bjigkh", q, eye).reshape(b, kv_heads // r, r * g, r * h)
    return jnp.pad(packed, ((0, 0), (0, 0), (0, rows - r * g), (0, 0)))


def lane_unpack(x: Array, r: int, groups: int, head_dim: int) -> Array:
    """`[B, J, rows, r * H]` -> `[B, J * r * G, H]`: each row's own head's lanes."""
    b, j = x.shape[:2]
    x = x[:, :, : r * groups].reshape(b, j, r, groups, r, head_dim)
    diag = jnp.stack([x[:, :, i, :, i, :] for i in range(r)], axis=2)
    return diag.reshape(b, j * r * groups, head_dim)


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
        q = q_ref[...]  # [R, C] fp32
        k = k_ref[...].astype(jnp.float32)  # [L, C]
        v = v_ref[...].astype(jnp.float32)
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
        )
        idx = p * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(idx < length, s, -jnp.inf)
        if with_logits:
            logits_ref[...] = s
        m_prev = m_sc[...]  # [R, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        pr = jnp.exp(s - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(pr, axis=1, keepdims=True)
        pv = jnp.dot(pr, v, precision=_HIGHEST, preferred_element_type=jnp.float32)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = m_new

    @pl.when(p == pl.num_programs(2) - 1)
    def _finish():
        den = l_sc[...]
        safe_l = jnp.where(den > 0, den, 1.0)
        o_ref[...] = acc_sc[...] / safe_l
        lse_ref[...] = m_sc[...] + jnp.log(safe_l)


@functools.partial(jax.jit, static_argnames=("return_logits", "interpret"))
def paged_decode_attention_tpu(
    q_bnh: Float[Array, "B N H"],
    k_pages: Float[Array, "P L K H"],
    v_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    *,
    return_logits: bool = False,
    interpret: bool = False,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N"], Float[Array, "B N S"] | None]:
    """Same contract as `kernel_gpu.paged_decode_attention_gpu` (fp32 out, lse, raw logits).

    Any shape in interpret mode; compiled, the shapes `unsupported_reason` accepts.
    `interpret`: run in Pallas' HLO interpreter (any platform), as the api does off a TPU.
    """
    b, n, h = q_bnh.shape
    num_pages, page_size, kh, _ = pool_dims(k_pages.shape, head_dim=h)
    g = n // kh
    m = page_table_bm.shape[1]
    r = heads_per_lane_block(kh, h) or 1
    j, c = kh // r, r * h
    rows = cdiv(r * g, SUBLANES) * SUBLANES
    q_pack = lane_pack_queries(q_bnh, kh, r, rows)
    k_flat = k_pages.reshape(num_pages, page_size, kh * h)
    v_flat = v_pages.reshape(num_pages, page_size, kh * h)

    def kv_map(bi, ji, p, lens_ref, pt_ref):
        last = jnp.maximum((lens_ref[bi] + page_size - 1) // page_size - 1, 0)
        return jnp.maximum(pt_ref[bi * m + jnp.minimum(p, last)], 0), 0, ji

    def row_map(bi, ji, p, *_):
        return bi, ji, 0, 0

    kv_spec = pl.BlockSpec((None, page_size, c), kv_map)
    out_specs = [pl.BlockSpec((None, None, rows, c), row_map)]
    out_specs.append(pl.BlockSpec((None, None, rows, 1), row_map))
    out_shape = [
        jax.ShapeDtypeStruct((b, j, rows, c), jnp.float32),
        jax.ShapeDtypeStruct((b, j, rows, 1), jnp.float32),
    ]
    if return_logits:
        # [B, J, M, rows, L]: the block's last two dims are whole array dims for any page size.
        out_specs.append(
            pl.BlockSpec(
                (None, None, None, rows, page_size), lambda bi, ji, p, *_: (bi, ji, p, 0, 0)
            )
        )
        out_shape.append(jax.ShapeDtypeStruct((b, j, m, rows, page_size), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, j, m),
        in_specs=[pl.BlockSpec((None, None, rows, c), row_map), kv_spec, kv_spec],
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, c), jnp.float32),
        ],
    )
    outs = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, with_logits=return_logits),
        grid_spec=grid_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
    )(
        lengths_b.astype(jnp.int32),
        page_table_bm.reshape(-1).astype(jnp.int32),
        q_pack,
        k_flat,
        v_flat,
    )
    out = lane_unpack(outs[0], r, g, h)
    lse = outs[1][:, :, : r * g, 0].reshape(b, n)
    logits = None
    if return_logits:
        lg = outs[2][:, :, :, : r * g]  # [B, J, M, rG, L]
        logits = jnp.transpose(lg, (0, 1, 3, 2, 4)).reshape(b, n, m * page_size)
    return out, lse, logits
