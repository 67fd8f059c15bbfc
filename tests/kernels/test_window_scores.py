"""Window scoring kernels (Triton-lowered GPU kernel with interpret=True, Mosaic TPU kernel under
force_tpu_interpret_mode) against the pure-jnp reference, and the api dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import window_scores
from pallas_kernels.window_scores import kernel_gpu, kernel_tpu
from pallas_kernels.window_scores.reference import window_scores_reference
from sparserl_jax.testing.kernels import LENGTHS, PAGE_TABLE, TOL, H, N, W, pools, queries

# Row 0 has a full window, row 1 only 2 real queries (a short row), row 2 is empty.
NUM_QUERIES = jnp.array([3, 2, 0], jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernel_matches_reference(backend, dtype):
    k, _ = pools(dtype)
    q = queries((3, W, N, H), dtype)
    want = window_scores_reference(q, k, PAGE_TABLE, LENGTHS, NUM_QUERIES)
    if backend == "gpu":
        got = kernel_gpu.window_scores_gpu(q, k, PAGE_TABLE, LENGTHS, NUM_QUERIES, interpret=True)
    else:
        with pltpu.force_tpu_interpret_mode():
            got = kernel_tpu.window_scores_tpu(q, k, PAGE_TABLE, LENGTHS, NUM_QUERIES)
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_reference_hand_example():
    """One key head, one query head, w = 2: softmax rows computed by hand."""
    k = jnp.zeros((1, 4, 1, 2)).at[0, :, 0, 0].set(jnp.array([0.0, jnp.log(2.0), 0.0, 0.0]))
    q = jnp.zeros((1, 2, 1, 2)).at[0, :, 0, 0].set(1.0)
    got = window_scores_reference(
        q, k, jnp.array([[0]], jnp.int32), jnp.array([4], jnp.int32), jnp.array([2], jnp.int32)
    )
    # Query 0 (token 2) sees keys 0..2 with weights 1, 2, 1; query 1 (token 3) sees 1, 2, 1, 1.
    want = (np.array([1, 2, 1, 0]) / 4 + np.array([1, 2, 1, 1]) / 5) / 2
    np.testing.assert_allclose(got[0, 0], want, atol=1e-6)


def test_api_dispatch():
    k, _ = pools(jnp.float32)
    q = queries((3, W, N, H), jnp.float32)
    want = window_scores(q, k, PAGE_TABLE, LENGTHS, NUM_QUERIES, impl="xla")
    got = window_scores(q, k, PAGE_TABLE, LENGTHS, NUM_QUERIES, impl="pallas_gpu")
    np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize(("kv_heads", "head_dim", "groups"), [(4, 32, 3), (2, 128, 5)])
def test_tpu_kernel_lane_packing(kv_heads, head_dim, groups):
    """Several kv heads per 128-lane block and padded (head, window) rows."""
    ks = jax.random.split(jax.random.key(6), 2)
    k = jax.random.normal(ks[0], (6, 8, kv_heads, head_dim))
    q = jax.random.normal(ks[1], (2, 3, kv_heads * groups, head_dim)) / jnp.sqrt(head_dim)
    pt = jnp.array([[4, 1, 0], [5, -1, -1]], jnp.int32)
    lens, nq = jnp.array([20, 7], jnp.int32), jnp.array([3, 2], jnp.int32)
    want = window_scores_reference(q, k, pt, lens, nq)
    with pltpu.force_tpu_interpret_mode():
        got = kernel_tpu.window_scores_tpu(q, k, pt, lens, nq)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
