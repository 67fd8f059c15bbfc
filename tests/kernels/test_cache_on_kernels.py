"""The paged cache gives the same results on the kernels (interpret mode) as on the XLA path:
decode attention with H2O's per-key mass, then SnapKV and H2O compressions (window scoring and
compaction kernels); also with the kernels run per device on a mesh (`_dispatch.on_mesh`), KV
heads split (2 devices) or replicated (4 devices, which 2 KV heads do not divide)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_kernels._dispatch import kv_head_axes
from pallas_kernels.paged_attention.reference import gather_pages
from sparserl_jax.kvcache import CompressionConfig, PagedKVCache, compress

B, K, G, H, STEPS = 2, 2, 2, 4, 11


def _run(impl, policy, mesh=None):
    cache = PagedKVCache.create(
        num_layers=1,
        batch=B,
        num_pages=10,
        page_size=3,
        max_pages_per_slot=5,
        num_kv_heads=K,
        head_dim=H,
        num_heads=K * G,
        window=3,
        track_attention_mass=True,
        impl=impl,
        mesh=mesh,
    )
    if mesh is not None:
        cache = jax.device_put(cache, cache.shardings())
    qkv = jax.random.normal(jax.random.key(0), (STEPS, 3, B, 1, K * G, H))

    def step(cache, x):
        q, k, v = x[0], x[1, :, :, :K], x[2, :, :, :K]
        # Row 1 skips every third step: ragged lengths.
        t = jnp.sum(cache.steps)
        mask = jnp.stack([jnp.ones((1,), bool), jnp.full((1,), t % 3 != 2)])
        cache, _ = cache.begin_step(mask)
        out, cache = cache.attend(0, q, k, v)
        return cache.end_step(), out

    cache, outs = jax.jit(lambda c, x: jax.lax.scan(step, c, x))(cache, qkv)
    config = CompressionConfig(policy=policy, budget=6, window=3, granularity="head")
    compressed = jax.jit(lambda c: compress(c, config, force=True))(cache)
    return outs, cache, compressed


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_cache_on_kernels_matches_xla(impl, policy):
    _check_against_xla(_run(impl, policy), policy)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
@pytest.mark.parametrize("devices", [2, 4])
def test_cache_on_kernels_on_a_mesh_matches_xla(devices, policy):
    mesh = jax.make_mesh(
        (devices,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices]
    )
    split = kv_head_axes(mesh, K) is not None
    assert split == (devices == 2)
    got = _run("pallas_tpu", policy, mesh)
    if split:
        assert got[1].k_pages.sharding.spec[3] in ("fsdp", ("fsdp",))
    _check_against_xla(got, policy)


def _check_against_xla(got, policy):
    want_out, want_cache, want_comp = _run("xla", policy)
    got_out, got_cache, got_comp = got
    np.testing.assert_allclose(got_out, want_out, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(got_cache.attn_mass, want_cache.attn_mass, atol=2e-6)
    np.testing.assert_array_equal(got_comp.lengths_b, want_comp.lengths_b)
    np.testing.assert_array_equal(got_comp.page_table, want_comp.page_table)
    assert int(jnp.sum(got_comp.evicted_b)) > 0
    # Compare the kept K/V through the page tables (freed pages may hold anything).
    for name in ("k_pages", "v_pages"):
        got = gather_pages(getattr(got_comp, name)[0], got_comp.page_table)[:, :6]
        want = gather_pages(getattr(want_comp, name)[0], want_comp.page_table)[:, :6]
        np.testing.assert_array_equal(got, want)
