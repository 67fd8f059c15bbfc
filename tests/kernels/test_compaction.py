"""Compaction kernels (Triton-lowered GPU kernel with interpret=True, Mosaic TPU kernel under
force_tpu_interpret_mode) against the pure-jnp reference, and the api dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compact_pages
from pallas_kernels.compaction import kernel_gpu, kernel_tpu
from pallas_kernels.compaction.reference import compact_pages_reference
from sparserl_jax.testing.kernels import PAGE_TABLE, K, pools

# Row 0 (11 tokens) keeps 6 per head, row 1 (5 tokens) keeps 3, row 2 keeps nothing.
KEEP = jnp.array(
    [
        [[0, 2, 5, 6, 9, 10], [1, 3, 4, 8, 9, 10]],
        [[1, 3, 4, 0, 0, 0], [0, 2, 4, 0, 0, 0]],
        [[0] * 6, [0] * 6],
    ],
    jnp.int32,
)
NEW_LEN = jnp.array([6, 3, 0], jnp.int32)


def _run(backend, pages):
    if backend == "gpu":
        return kernel_gpu.compact_pages_gpu(pages, PAGE_TABLE, KEEP, NEW_LEN, interpret=True)
    # "tpu-blocks": one row per call, as a batch whose SMEM tables exceed the budget runs.
    rows = 1 if backend == "tpu-blocks" else None
    with pltpu.force_tpu_interpret_mode():
        return kernel_tpu.compact_pages_tpu(pages, PAGE_TABLE, KEEP, NEW_LEN, rows=rows)


@pytest.mark.parametrize("lane_dense", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("backend", ["gpu", "tpu", "tpu-blocks"])
def test_kernel_matches_reference(backend, dtype, lane_dense):
    # A copy is exact in every dtype (-0.0 included): the tolerance is zero, bits compared.
    k, _ = pools(jnp.float32)
    pages = (k * 100).astype(dtype)
    if dtype != jnp.int32:
        pages = pages.at[0, 0, 0, 0].set(-0.0)
    if lane_dense:  # the rollout cache's layout, [P, L, K * H]
        pages = pages.reshape(pages.shape[:2] + (-1,))
    want = compact_pages_reference(pages, PAGE_TABLE, KEEP, NEW_LEN)
    got = _run(backend, pages)
    assert got.shape == pages.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _bits(x):
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


def test_reference_moves_tokens_and_leaves_the_rest():
    # Values name (page, offset, head): the kept tokens must arrive in order at the front.
    p, ps = 9, 4
    ids = jnp.arange(p * ps * K, dtype=jnp.int32).reshape(p, ps, K)
    out = np.asarray(compact_pages_reference(ids, PAGE_TABLE, KEEP, NEW_LEN))
    pt = np.asarray(PAGE_TABLE)

    def at(b, j, h, arr):
        return arr[pt[b, j // ps], j % ps, h]

    for b in range(3):
        for h in range(K):
            for j in range(int(NEW_LEN[b])):
                assert at(b, j, h, out) == at(b, int(KEEP[b, h, j]), h, np.asarray(ids))
    # Pages no row owns are untouched.
    free = sorted(set(range(p)) - set(pt[pt >= 0].tolist()))
    np.testing.assert_array_equal(out[free], np.asarray(ids)[free])


def test_api_dispatch_mass_pool():
    """The H2O mass pool `[P, L, K]` (no head dim) goes through the same op."""
    mass = jax.random.uniform(jax.random.key(3), (9, 4, K))
    want = compact_pages(mass, PAGE_TABLE, KEEP, NEW_LEN, impl="xla")
    for impl in ("pallas_gpu", "pallas_tpu"):
        got = compact_pages(mass, PAGE_TABLE, KEEP, NEW_LEN, impl=impl)
        np.testing.assert_array_equal(got, want)
