"""Chunked (online-softmax, flash-style) causal GQA attention over packed segments, pure XLA.

The teacher-forcing attention without `[T, T]` arrays: queries are taken `block_q` rows at a
time and keys `block_kv` columns at a time; each key block updates a running row max `m`, row
sum `l` and output accumulator (FlashAttention, Dao et al. 2022, arXiv 2205.14135; the
backward of FlashAttention-2, arXiv 2307.08691). The mask of a `[block_q, block_kv]` tile is
computed from token indices and segment ids, and key blocks wholly after a query block
(causally invisible) are never visited, forward or backward. The gradient is a `custom_vjp`
that keeps only q, k, v, the output and the row log-sum-exp (O(T)) and recomputes each tile's
probabilities; dk and dv accumulate in fp32 carries of shape `[B, T, K, H]`.

Numerics match `models.layers.gqa_attention` (the dense reference): pre-scaled queries, fp32
scores and softmax, fp32 output; a row with nothing to attend (never the case in causal
self-attention, whose diagonal is always visible) gives zeros and zero gradients, never NaN.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Tile of scores: [B, K, G, block_q, block_kv] in fp32. Block tensors keep the layouts
# q [B, bq, K, G, H] and k/v [B, bk, K, H] so no transpose of the activations is needed.
_QK = "bqkgh,bskh->bkgqs"
_PV = "bkgqs,bskh->bqkgh"
_DKV = "bkgqs,bqkgh->bskh"


def _pad_len(t: int, block_q: int, block_kv: int) -> tuple[int, int, int]:
    bq, bk = min(block_q, t), min(block_kv, t)
    step = math.lcm(bq, bk)
    return bq, bk, -(-t // step) * step


def _tile_mask(i, j, seg_q_bq, seg_kv_bs, ev_kv_bsk, bq: int, bk: int):
    """`[B, 1, 1, bq, bk]`: key index <= query index, same segment; with an eviction record
    (`ev_kv_bsk`, the key block's `[B, bk, K]`), `[B, K, 1, bq, bk]`: and the query comes before
    the key's eviction (`kvcache.evictions`)."""
    q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)
    kv_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)
    causal_qs = kv_idx[None, :] <= q_idx[:, None]
    same_bqs = seg_q_bq[:, :, None] == seg_kv_bs[:, None, :]
    mask = (causal_qs[None] & same_bqs)[:, None, None]
    if ev_kv_bsk is None:
        return mask
    seen_bkqs = q_idx[None, None, :, None] < jnp.moveaxis(ev_kv_bsk, 2, 1)[:, :, None, :]
    return mask & seen_bkqs[:, :, None]


def _kv_blocks(i, bq: int, bk: int, nk: int):
    """How many key blocks query block `i` sees: those starting at or before its last row."""
    return jnp.minimum(nk, ((i + 1) * bq - 1) // bk + 1)


def blocks(x, n: int, b: int):
    """`[B, n*b, ...] -> [n, B, b, ...]`."""
    return jnp.moveaxis(x.reshape(x.shape[0], n, b, *x.shape[2:]), 1, 0)


def unblocks(x):
    """`[n, B, b, ...] -> [B, n*b, ...]`."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _key_block(x, j, bk: int):
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, j * bk, bk, axis=1)


def _forward(q_btkgh, k_btkh, v_btkh, seg_bt, ev_btk, bq: int, bk: int):
    """Padded operands -> (fp32 output `[B, T, K, G, H]`, row log-sum-exp `[nq, B, K, G, bq]`)."""
    b, t, kh, g, h = q_btkgh.shape
    nq, nk = t // bq, t // bk

    def q_block(args):
        i, q_i, seg_i = args

        def body(j, carry):
            m, denom, acc = carry
            k_j = jax.lax.dynamic_slice_in_dim(k_btkh, j * bk, bk, axis=1)
            v_j = jax.lax.dynamic_slice_in_dim(v_btkh, j * bk, bk, axis=1)
            seg_j = jax.lax.dynamic_slice_in_dim(seg_bt, j * bk, bk, axis=1)
            mask = _tile_mask(i, j, seg_i, seg_j, _key_block(ev_btk, j, bk), bq, bk)
            s = jnp.einsum(_QK, q_i, k_j.astype(q_i.dtype), preferred_element_type=jnp.float32)
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # A row with no visible key so far keeps m = -inf: shift by 0 so exp gives 0, not NaN.
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(m - shift)
            denom = alpha * denom + jnp.sum(p, axis=-1)
            pv = jnp.einsum(_PV, p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32)
            acc = alpha.transpose(0, 3, 1, 2)[..., None] * acc + pv
            return m_new, denom, acc

        m0 = jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32)
        init = (m0, jnp.zeros_like(m0), jnp.zeros((b, bq, kh, g, h), jnp.float32))
        m, denom, acc = jax.lax.fori_loop(0, _kv_blocks(i, bq, bk, nk), body, init)
        seen = denom > 0
        out = acc / jnp.where(seen, denom, 1.0).transpose(0, 3, 1, 2)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), 0.0)
        return out, lse

    xs = (jnp.arange(nq, dtype=jnp.int32), blocks(q_btkgh, nq, bq), blocks(seg_bt, nq, bq))
    out, lse = jax.lax.map(q_block, xs)
    return unblocks(out), lse


def _backward(q_btkgh, k_btkh, v_btkh, seg_bt, ev_btk, out_btkgh, lse, do_btkgh, bq: int, bk: int):
    """One pass over query blocks; each visits its visible key blocks and adds its share of dk
    and dv into fp32 carries. Returns fp32 (dq, dk, dv)."""
    b, t, kh, g, h = q_btkgh.shape
    nq, nk = t // bq, t // bk
    cdt = q_btkgh.dtype
    # D_i = rowsum(dO * O): the softmax Jacobian's diagonal term.
    delta_btkg = jnp.sum(do_btkgh.astype(jnp.float32) * out_btkgh, axis=-1)
    delta = blocks(delta_btkg, nq, bq).transpose(0, 1, 3, 4, 2)  # [nq, B, K, G, bq]

    def q_block(carry, args):
        dk, dv = carry
        i, q_i, do_i, seg_i, lse_i, delta_i = args
        do_c = do_i.astype(cdt)

        def body(j, inner):
            dq, dk, dv = inner
            k_j = jax.lax.dynamic_slice_in_dim(k_btkh, j * bk, bk, axis=1).astype(cdt)
            v_j = jax.lax.dynamic_slice_in_dim(v_btkh, j * bk, bk, axis=1).astype(cdt)
            seg_j = jax.lax.dynamic_slice_in_dim(seg_bt, j * bk, bk, axis=1)
            s = jnp.einsum(_QK, q_i, k_j, preferred_element_type=jnp.float32)
            mask = _tile_mask(i, j, seg_i, seg_j, _key_block(ev_btk, j, bk), bq, bk)
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
            dp = jnp.einsum(_QK, do_c, v_j, preferred_element_type=jnp.float32)
            # ds stays fp32 (as the reference's autodiff keeps it): rounding it to bf16 for the
            # MXU doubles the error of dk in bf16 (tests/models/test_attention.py).
            ds = p * (dp - delta_i[..., None])
            dq = dq + jnp.einsum(_PV, ds, k_j.astype(jnp.float32))
            dk_j = jnp.einsum(_DKV, ds, q_i.astype(jnp.float32))
            dv_j = jnp.einsum(_DKV, p.astype(cdt), do_c, preferred_element_type=jnp.float32)
            start = j * bk
            dk = jax.lax.dynamic_update_slice_in_dim(
                dk, jax.lax.dynamic_slice_in_dim(dk, start, bk, axis=1) + dk_j, start, axis=1
            )
            dv = jax.lax.dynamic_update_slice_in_dim(
                dv, jax.lax.dynamic_slice_in_dim(dv, start, bk, axis=1) + dv_j, start, axis=1
            )
            return dq, dk, dv

        dq0 = jnp.zeros((b, bq, kh, g, h), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, _kv_blocks(i, bq, bk, nk), body, (dq0, dk, dv))
        return (dk, dv), dq

    zeros = jnp.zeros((b, t, kh, h), jnp.float32)
    xs = (
        jnp.arange(nq, dtype=jnp.int32),
        blocks(q_btkgh, nq, bq),
        blocks(do_btkgh, nq, bq),
        blocks(seg_bt, nq, bq),
        lse,
        delta,
    )
    (dk, dv), dq = jax.lax.scan(q_block, (zeros, zeros), xs)
    return unblocks(dq), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attend(q, k, v, seg, ev, bq, bk):
    return _forward(q, k, v, seg, ev, bq, bk)[0]


def _attend_fwd(q, k, v, seg, ev, bq, bk):
    out, lse = _forward(q, k, v, seg, ev, bq, bk)
    return out, (q, k, v, seg, ev, out, lse)


def _attend_bwd(bq, bk, res, do):
    q, k, v, seg, ev, out, lse = res
    dq, dk, dv = _backward(q, k, v, seg, ev, out, lse, do, bq, bk)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def chunked_attention(
    q_btnh: Float[Array, "B T N H"],
    k_btkh: Float[Array, "B T K H"],
    v_btkh: Float[Array, "B T K H"],
    segment_ids_bt: Int[Array, "B T"] | None = None,
    *,
    block_q: int = 512,
    block_kv: int = 512,
    evict_pos_bkt: Int[Array, "B K T"] | None = None,
) -> Float[Array, "B T N H"]:
    """Causal self-attention of pre-scaled queries, restricted to equal segment ids; fp32 out.

    Query head n uses KV head n // G. Token t attends to tokens s <= t with
    `segment_ids[s] == segment_ids[t]` (None: one segment), and with an eviction record
    `evict_pos_bkt` (`[B, K or 1, T]`, `kvcache.evictions`) only while `t < evict_pos[s]`: the
    attention a sparse sampler computed. T need not be a multiple of the
    blocks: the operands are padded (padded keys come after every real query, so causality
    hides them) and the padded rows dropped. Never builds a `[T, T]` array.
    """
    b, t, n, h = q_btnh.shape
    kh = k_btkh.shape[2]
    if block_q <= 0 or block_kv <= 0:
        raise ValueError(f"attention blocks must be positive, got {block_q} and {block_kv}")
    if n % kh:
        raise ValueError(f"{n} query heads are not a multiple of {kh} KV heads")
    bq, bk, tp = _pad_len(t, block_q, block_kv)
    if segment_ids_bt is None:
        segment_ids_bt = jnp.zeros((b, t), jnp.int32)
    pad = ((0, 0), (0, tp - t))
    seg = jnp.pad(segment_ids_bt.astype(jnp.int32), pad)
    q = jnp.pad(q_btnh, pad + ((0, 0), (0, 0))).reshape(b, tp, kh, n // kh, h)
    k = jnp.pad(k_btkh, pad + ((0, 0), (0, 0)))
    v = jnp.pad(v_btkh, pad + ((0, 0), (0, 0)))
    ev = None
    if evict_pos_bkt is not None:
        ev = jnp.broadcast_to(evict_pos_bkt.astype(jnp.int32), (b, kh, t)).transpose(0, 2, 1)
        ev = jnp.pad(ev, pad + ((0, 0),), constant_values=jnp.iinfo(jnp.int32).max)
    out = _attend(q, k, v, seg, ev, bq, bk)
    return out.reshape(b, tp, n, h)[:, :t]
