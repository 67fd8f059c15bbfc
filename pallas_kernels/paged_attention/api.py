"""Paged decode attention: dispatch between the XLA reference and the Pallas kernels."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from pallas_kernels._dispatch import (
    Concrete,
    Impl,
    by_platform,
    cdiv,
    choose_impl,
    local_kv_heads,
    mesh_platform,
    on_mesh,
    pool_dims,
)
from pallas_kernels.paged_attention import kernel_gpu, kernel_tpu
from pallas_kernels.paged_attention.reference import (
    layer_pages,
    paged_decode_attention_reference,
    probs_from_logits,
)


def decode_impl(
    kv_shape: tuple[int, ...],
    num_heads: int,
    batch: int,
    max_pages: int,
    *,
    impl: Impl = "auto",
    mesh: Mesh | None = None,
    platform: str | None = None,
) -> Concrete:
    """What `paged_decode_attention` runs for a `[P, L, K, H]` pool (`kv_shape`: the pool's
    dims, `_dispatch.pool_dims`, whichever layout it is stored in) on `platform` (default: the
    mesh's, else `_dispatch.target_platform()`).

    The chosen kernel when it compiles for these shapes, else "xla" (logged once); see
    `_dispatch.choose_impl` and each kernel's `unsupported_reason`. On a `mesh` the shapes
    checked are one device's (`_dispatch.on_mesh`).
    """
    pages, page_size, kv_heads, head_dim = kv_shape
    local = local_kv_heads(mesh, kv_heads)
    num_heads, kv_heads = num_heads // kv_heads * local, local
    kv_shape = (pages, page_size, kv_heads, head_dim)

    def unsupported(which: Concrete) -> str | None:
        if which == "pallas_tpu":
            return kernel_tpu.unsupported_reason(kv_shape, batch, max_pages)
        return kernel_gpu.unsupported_reason(num_heads // kv_heads, page_size, head_dim)

    platform = platform or mesh_platform(mesh)
    return choose_impl("paged_decode_attention", impl, unsupported, platform=platform)


def decode_kernel(
    which: Concrete, *, interpret: bool, return_probs: bool, mesh: Mesh | None
) -> Callable[..., tuple[jax.Array, jax.Array | None]]:
    """Kernel `which` as `paged_decode_attention` runs it: `(q, k_pages, v_pages, page_table,
    lengths) -> (out, probs or None)`, per device on a `mesh`, in interpret mode if asked."""

    def kernel(q, kp, vp, pt, lens):
        if which == "pallas_gpu":
            return kernel_gpu.paged_decode_attention_gpu(
                q, kp, vp, pt, lens, return_logits=return_probs, interpret=interpret
            )
        return kernel_tpu.paged_decode_attention_tpu(
            q, kp, vp, pt, lens, return_logits=return_probs, interpret=interpret
        )

    def arrays_only(*args):
        out, lse, logits = kernel(*args)
        return (out, lse) if logits is None else (out, lse, logits)

    def run(q, kp, vp, pt, lens):
        got = on_mesh(
            arrays_only,
            (q, kp, vp, pt, lens),
            mesh=mesh,
            kv_heads=pool_dims(kp.shape, head_dim=q.shape[-1])[2],
            in_head_dims=(1, 2, 2, None, None),
            out_head_dims=(1, 1, 1) if return_probs else (1, 1),
        )
        out, lse, logits = got if return_probs else (*got, None)
        return out, probs_from_logits(logits, lse, lens) if return_probs else None

    return run


def paged_decode_attention(
    q_bnh: Float[Array, "B N H"],
    k_pages: Float[Array, "P L K H"],
    v_pages: Float[Array, "P L K H"],
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    *,
    return_probs: bool = False,
    impl: Impl = "auto",
    mesh: Mesh | None = None,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N S"] | None]:
    """One pre-scaled decode query per row against its first `lengths_b[b]` paged keys.

    Returns fp32 outputs `[B, N, H]` and, with `return_probs`, the per-key softmax
    probabilities `[B, N, M * L]` (zero past the length) that H2O accumulates. See
    `reference.py` for the layout. `impl`: "auto" (the Mosaic kernel on TPU, Triton on GPU, XLA
    on CPU), "xla", "pallas_tpu" or "pallas_gpu" (interpret mode off their platform), decided for
    the platform the program is lowered for (`_dispatch.by_platform`); a kernel that cannot
    compile these shapes falls back to XLA (`decode_impl`). On a `mesh` a kernel runs per device
    (`_dispatch.on_mesh`: heads split when the KV heads divide by the mesh size).
    """
    b, m = page_table_bm.shape

    def choose(platform: str) -> Concrete:
        n = q_bnh.shape[1]
        kv_shape = pool_dims(k_pages.shape, head_dim=q_bnh.shape[-1])
        return decode_impl(kv_shape, n, b, m, impl=impl, mesh=mesh, platform=platform)

    def build(which: Concrete, interpret: bool):
        if which == "xla":
            return functools.partial(paged_decode_attention_reference, return_probs=return_probs)
        return decode_kernel(which, interpret=interpret, return_probs=return_probs, mesh=mesh)

    args = (q_bnh, k_pages, v_pages, page_table_bm, lengths_b)
    return by_platform(choose, build, args, mesh=mesh)


def paged_decode_attention_xla_bucketed(
    q_bnh: Float[Array, "B N H"],
    k_pool: Float[Array, "Y P L K H"],
    v_pool: Float[Array, "Y P L K H"],
    layer: int,
    page_table_bm: Int[Array, "B M"],
    lengths_b: Int[Array, " B"],
    *,
    return_probs: bool = False,
    buckets: int = 8,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N S"] | None]:
    """The XLA decode path of a stacked pool (`Y` layers), bounded by the longest row.

    The reference over only the first `m_i` page-table columns, `m_i` the smallest of `buckets`
    static sizes (multiples of M / buckets) that covers the longest row. Keys past a row's length
    get exactly zero weight in the reference, so dropping columns that hold none changes nothing
    but the work: a dense rollout attends over its current length, not its final one.
    `lax.switch` picks the size at run time; every branch has static shapes and reads the
    layer's pages itself (a sliced pool passed as a branch operand would be copied every step).
    Probabilities are zero-padded back to `M * L` keys.
    """
    b, m = page_table_bm.shape
    pl = k_pool.shape[2]
    sizes = sorted({max(1, cdiv(m * i, buckets)) for i in range(1, buckets + 1)})

    def branch(mi):
        def attend(q, kp, vp, pt, lens):
            # The layer's pages read through the stacked pool (`layer_pages`: no slice of it).
            (kp, pt), (vp, _) = (layer_pages(x, pt[:, :mi], layer) for x in (kp, vp))
            out, probs = paged_decode_attention_reference(
                q, kp, vp, pt, lens, return_probs=return_probs
            )
            if probs is not None:
                probs = jnp.pad(probs, ((0, 0), (0, 0), (0, (m - mi) * pl)))
            return out, probs

        return attend

    operands = (q_bnh, k_pool, v_pool, page_table_bm, lengths_b)
    if len(sizes) == 1:
        return branch(m)(*operands)
    need = (jnp.max(lengths_b) + pl - 1) // pl
    index = jnp.clip(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), need), 0, len(sizes) - 1)
    return jax.lax.switch(index, [branch(mi) for mi in sizes], *operands)
