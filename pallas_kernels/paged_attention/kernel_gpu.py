"""Paged decode attention as a Pallas GPU kernel.

GPU lowering: **Pallas Triton** (`jax.experimental.pallas.triton.CompilerParams`). The Triton
backend of Pallas is deprecated from JAX 0.11; its successor is Mosaic GPU, which has no scalar-
indexed page gather in its BlockSpec pipeline yet, so this kernel stays on Triton until it is
ported. On a CPU it runs with `interpret=True`; on an H100 and an H200 (JAX 0.11.2) it matches
the XLA path within 3e-4 relative error, and on the lane-dense pool the engine decodes 1.5x faster
through the kernels than through XLA on an H200 (docs/results.md). Triton wants power-of-
two block extents (G, L, H) and dot tiles of at least 16: the query heads of each group are padded
with zero queries to the next power of two >= 16 (Qwen2.5's G = 7 runs as 16), as
`jax.experimental.pallas.ops.gpu.paged_attention` does; the padded rows are sliced off the outputs.

One program per (row, kv head): the G query heads of the group walk the row's pages in order
with an online softmax (flash-decoding without the split-K), optionally writing the raw logits so
the caller can form per-key probabilities (H2O) with the returned log-sum-exp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import is_pow2, pool_dims

_NEG = -1e30  # finite: an all-masked page must not produce inf - inf


def padded_rows(x: int) -> int:
    """`x` rounded up to a power of two of at least 16 (a Triton dot tile's extent)."""
    return max(16, 1 << (x - 1).bit_length())


def unsupported_reason(groups: int, page_size: int, head_dim: int) -> str | None:
    """Why Triton would reject these extents (power-of-two dot tiles of at least 16), or None.

    Any group size runs (padded, `padded_rows`); page size and head dim are not padded.
    """
    del groups
    for name, x in (("page size", page_size), ("head dim", head_dim)):
        if not (is_pow2(x) and x >= 16):
            return f"{name} {x} is not a power of two >= 16 (Triton dot tiles)"
    return None


def _kernel(lens_ref, pt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *logit_refs, page_size, groups):
    b, kh = pl.program_id(0), pl.program_id(1)
    length = lens_ref[b]
    q = q_ref[b, pl.ds(kh * groups, groups), :].astype(jnp.float32)  # [G, H]
    h = q.shape[-1]

    def body(p, carry):
        m, den, acc = carry
        page = pt_ref[b, p]
        k = k_ref[page, :, kh, :].astype(jnp.float32)  # [L, H]
        v = v_ref[page, :, kh, :].astype(jnp.float32)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [G, L]
        idx = p * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(idx < length, s, -jnp.inf)
        if logit_refs:
            logit_refs[0][b, pl.ds(kh * groups, groups), pl.ds(p * page_size, page_size)] = s
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        pr = jnp.exp(s - m_new[:, None])
        l_new = alpha * den + jnp.sum(pr, axis=1)
        acc_new = alpha[:, None] * acc + jnp.dot(pr, v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc_new

    init = (
        jnp.full((groups,), _NEG, jnp.float32),
        jnp.zeros((groups,), jnp.float32),
        jnp.zeros((groups, h), jnp.float32),
    )
    num_pages = (length + page_size - 1) // page_size
    m, den, acc = jax.lax.fori_loop(0, num_pages, body, init)
    safe_l = jnp.where(den > 0, den, 1.0)
    o_ref[b, pl.ds(kh * groups, groups), :] = acc / safe_l[:, None]
    lse_ref[b, pl.ds(kh * groups, groups)] = m + jnp.log(safe_l)


@functools.partial(jax.jit, static_argnames=("return_logits", "interpret", "num_warps"))
def paged_decode_attention_gpu(
    q_bnh: Float[Array, "B N H"],
    k_pages: Float[Array, "P L K H"],
    v_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    *,
    return_logits: bool = False,
    interpret: bool = False,
    num_warps: int = 4,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N"], Float[Array, "B N S"] | None]:
    """Outputs `[B, N, H]` (fp32), log-sum-exp `[B, N]` and, if asked, raw logits `[B, N, S]`.

    Logits past a row's length are unspecified (mask them, e.g. `probs_from_logits`).
    """
    b, n, h = q_bnh.shape
    # A lane-dense pool is split by head here: free on a GPU (row-major, no tiles).
    shape = pool_dims(k_pages.shape, head_dim=h)
    k_pages, v_pages = k_pages.reshape(shape), v_pages.reshape(shape)
    _, page_size, kh, _ = shape
    s = page_table_bm.shape[1] * page_size
    g = n // kh
    gp = padded_rows(g)
    # Zero queries pad each group to gp rows; they are computed and dropped.
    q_bkgh = jnp.pad(q_bnh.reshape(b, kh, g, h), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    np_ = kh * gp
    out_shape = [
        jax.ShapeDtypeStruct((b, np_, h), jnp.float32),
        jax.ShapeDtypeStruct((b, np_), jnp.float32),
    ]
    if return_logits:
        out_shape.append(jax.ShapeDtypeStruct((b, np_, s), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, groups=gp),
        out_shape=out_shape,
        grid=(b, kh),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(lengths_b, page_table_bm, q_bkgh.reshape(b, np_, h), k_pages, v_pages)

    def unpad(x):  # [B, K * gp, ...] -> [B, N, ...]
        return x.reshape(b, kh, gp, *x.shape[2:])[:, :, :g].reshape(b, n, *x.shape[2:])

    return unpad(outs[0]), unpad(outs[1]), unpad(outs[2]) if return_logits else None
