"""Tiny paged inputs for the kernel tests (ragged lengths, an empty row, -1 table slots)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

P, L, K, H, N, M, W = 9, 4, 2, 8, 4, 3, 3
PAGE_TABLE = jnp.array([[3, 0, 5], [6, 2, -1], [-1, -1, -1]], jnp.int32)
LENGTHS = jnp.array([11, 5, 0], jnp.int32)
# Tolerances per input dtype. Both kernel and reference upcast to fp32 before any arithmetic, so
# the inputs are identical and only the summation order differs: the same bound holds for both.
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-6}


def pools(dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(ks[0], (P, L, K, H)).astype(dtype)
    v = jax.random.normal(ks[1], (P, L, K, H)).astype(dtype)
    return k, v


def queries(shape, dtype, seed=1):
    return (jax.random.normal(jax.random.key(seed), shape) / jnp.sqrt(H)).astype(dtype)
