"""Paged decode attention kernels (Triton-lowered GPU kernel with interpret=True, Mosaic TPU
kernel under force_tpu_interpret_mode) against the pure-jnp reference, and the api dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import paged_decode_attention, resolve_impl
from pallas_kernels.paged_attention import kernel_gpu, kernel_tpu
from pallas_kernels.paged_attention.reference import (
    paged_decode_attention_reference,
    probs_from_logits,
)
from sparserl_jax.testing.kernels import LENGTHS, PAGE_TABLE, TOL, H, N, pools, queries


def _run(backend, q, k, v, return_logits):
    if backend == "gpu":
        return kernel_gpu.paged_decode_attention_gpu(
            q, k, v, PAGE_TABLE, LENGTHS, return_logits=return_logits, interpret=True
        )
    with pltpu.force_tpu_interpret_mode():
        return kernel_tpu.paged_decode_attention_tpu(
            q, k, v, PAGE_TABLE, LENGTHS, return_logits=return_logits
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernel_matches_reference(backend, dtype):
    k, v = pools(dtype)
    q = queries((3, N, H), dtype)
    want_out, want_probs = paged_decode_attention_reference(
        q, k, v, PAGE_TABLE, LENGTHS, return_probs=True
    )
    out, lse, logits = _run(backend, q, k, v, return_logits=True)
    tol = TOL[dtype]
    # The empty row (length 0) must give zeros, like the reference, not NaN.
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=tol)
    probs = probs_from_logits(logits, lse, LENGTHS)
    np.testing.assert_allclose(probs, want_probs, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.sum(probs[:2], axis=-1), 1.0, atol=1e-5)


def test_api_dispatch(monkeypatch):
    k, v = pools(jnp.float32)
    q = queries((3, N, H), jnp.float32)
    assert resolve_impl("auto") == "xla"  # CPU
    ref_out, ref_probs = paged_decode_attention(
        q, k, v, PAGE_TABLE, LENGTHS, return_probs=True, impl="xla"
    )
    for impl in ("pallas_gpu", "pallas_tpu"):
        out, probs = paged_decode_attention(
            q, k, v, PAGE_TABLE, LENGTHS, return_probs=True, impl=impl
        )
        np.testing.assert_allclose(out, ref_out, atol=2e-6)
        np.testing.assert_allclose(probs, ref_probs, atol=2e-6)
    monkeypatch.setenv("SPARSERL_KERNEL_IMPL", "pallas_gpu")
    assert resolve_impl("auto") == "pallas_gpu"
    monkeypatch.setenv("SPARSERL_KERNEL_IMPL", "cuda")
    with pytest.raises(ValueError, match="SPARSERL_KERNEL_IMPL='cuda'"):
        resolve_impl("auto")
    with pytest.raises(ValueError, match="unknown kernel impl 'triton'"):
        resolve_impl("triton")  # type: ignore[arg-type]


@pytest.mark.parametrize(("kv_heads", "head_dim", "groups"), [(4, 32, 3), (2, 128, 5), (3, 16, 1)])
def test_tpu_kernel_lane_packing(kv_heads, head_dim, groups):
    """Several kv heads per 128-lane block, padded query rows, one head per block."""
    ks = jax.random.split(jax.random.key(5), 3)
    k = jax.random.normal(ks[0], (6, 8, kv_heads, head_dim))
    v = jax.random.normal(ks[1], (6, 8, kv_heads, head_dim))
    q = jax.random.normal(ks[2], (2, kv_heads * groups, head_dim)) / jnp.sqrt(head_dim)
    pt = jnp.array([[4, 1, 0], [5, -1, -1]], jnp.int32)
    lens = jnp.array([20, 7], jnp.int32)
    want_out, want_probs = paged_decode_attention_reference(q, k, v, pt, lens, return_probs=True)
    with pltpu.force_tpu_interpret_mode():
        out, lse, logits = kernel_tpu.paged_decode_attention_tpu(
            q, k, v, pt, lens, return_logits=True
        )
    np.testing.assert_allclose(out, want_out, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(probs_from_logits(logits, lse, lens), want_probs, atol=2e-6)
