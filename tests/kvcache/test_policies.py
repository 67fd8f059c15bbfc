"""(b) Each policy keeps exactly the tokens a hand-computed reference picks.

A one-layer cache is filled token by token through the `DecodeCache` protocol with chosen
queries and keys; each value carries its token's absolute position, so reading the values back
after compression names the kept tokens. Length 10, budget 6, window 2: the 4 best of the 8
candidates (positions 0..7) plus the 2 most recent (8, 9).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.reference import gather_pages
from sparserl_jax.kvcache import CompressionConfig, PagedKVCache, compress, policy_scores

LENGTH = 10


def _fill(keys_lskh, queries_lsnh, *, window, track, page_size=3):
    """A cache holding one row whose token s has key `keys[:, s]`, query `queries[:, s]`."""
    layers, s, kh, h = keys_lskh.shape
    n = queries_lsnh.shape[2]
    cache = PagedKVCache.create(
        num_layers=layers,
        batch=1,
        num_pages=8,
        page_size=page_size,
        max_pages_per_slot=4,
        num_kv_heads=kh,
        head_dim=h,
        num_heads=n,
        window=window,
        track_attention_mass=track,
    )
    for t in range(s):
        cache, pos = cache.begin_step(jnp.ones((1, 1), bool))
        assert int(pos[0, 0]) == t
        for y in range(layers):
            v = jnp.full((1, 1, kh, h), float(t))
            _, cache = cache.attend(
                y, queries_lsnh[y, t][None, None], keys_lskh[y, t][None, None], v
            )
        cache = cache.end_step()
    return cache


def _kept(cache, layer=0, head=0):
    v = gather_pages(cache.split_heads(cache.v_pages)[layer], cache.page_table)
    return [int(x) for x in v[0, : int(cache.lengths_b[0]), head, 0]]


def _keys_from_scalars(a_s):
    """Keys `[a_s, 0]` for one layer and one KV head; queries `[1, 0]`."""
    k = jnp.stack([jnp.asarray(a_s, jnp.float32), jnp.zeros(len(a_s))], axis=-1)
    q = jnp.tile(jnp.array([1.0, 0.0]), (len(a_s), 1))
    return k[None, :, None, :], q[None, :, None, :]


def _check_compressed(cache, config, expected, layer=0, head=0):
    out = compress(cache, config, force=True)
    assert _kept(out, layer, head) == expected
    assert int(out.lengths_b[0]) == config.budget
    assert int(out.next_pos_b[0]) == LENGTH  # absolute positions do not move
    assert int(out.evicted_b[0]) == LENGTH - config.budget
    ps = out.page_size
    assert int(out.num_pages_b[0]) == -(-config.budget // ps)
    assert int(out.free_top) == out.num_pages - -(-config.budget // ps)
    # The next token gets the next absolute position and lands after the kept ones.
    out, pos = out.begin_step(jnp.ones((1, 1), bool))
    assert int(pos[0, 0]) == LENGTH
    return out


@pytest.mark.slow
def test_streaming_keeps_sinks_and_recent():
    k, q = _keys_from_scalars(np.linspace(0, 1, LENGTH))
    cache = _fill(k, q, window=0, track=False)
    config = CompressionConfig(policy="streaming", budget=6, window=2, sink_tokens=2)
    _check_compressed(cache, config, [0, 1, 6, 7, 8, 9])


A_SNAP = [0.1, 3.0, 0.2, 0.5, 0.3, 2.0, 0.4, 0.0, 0.0, 0.0]


@pytest.mark.slow
def test_snapkv_keeps_most_attended():
    # Both window queries are [1, 0]: importance ranks candidates by a_j. Top 4: 1, 5, 3, 6.
    k, q = _keys_from_scalars(A_SNAP)
    cache = _fill(k, q, window=2, track=False)
    config = CompressionConfig(policy="snapkv", budget=6, window=2, kernel_size=1)
    _check_compressed(cache, config, [1, 3, 5, 6, 8, 9])


@pytest.mark.slow
def test_snapkv_max_pool():
    # Kernel 3 over candidates 0..7: pooled = [3, 3, 3, .5, 2, 2, 2, .4]; ties go to the
    # earlier token, so 0, 1, 2 and then 4.
    k, q = _keys_from_scalars(A_SNAP)
    cache = _fill(k, q, window=2, track=False)
    config = CompressionConfig(policy="snapkv", budget=6, window=2, kernel_size=3)
    _check_compressed(cache, config, [0, 1, 2, 4, 8, 9])


@pytest.mark.slow
def test_h2o_keeps_heavy_hitters():
    # Queries [20, 0]; keys [1, 0] at 2 and 5, zero elsewhere. Accumulated mass (to ~1e-8):
    # token 0: 1 + 1/2, token 1: 1/2, token 2: 3 (t = 2..4) + 5/2 (t = 5..9), token 5: 5/2,
    # every other token ~e^-20. Top 4 of 0..7: 2, 5, 0, 1.
    a = np.zeros(LENGTH)
    a[[2, 5]] = 1.0
    k, _ = _keys_from_scalars(a)
    q = jnp.tile(jnp.array([20.0, 0.0]), (LENGTH, 1))[None, :, None, :]
    cache = _fill(k, q, window=0, track=True)
    mass = np.asarray(policy_scores(cache, CompressionConfig(policy="h2o")))[0, 0, 0, :LENGTH]
    want = np.zeros(LENGTH)
    want[[0, 1, 2, 5]] = [1.5, 0.5, 5.5, 2.5]
    np.testing.assert_allclose(mass[[0, 1, 2, 5]], want[[0, 1, 2, 5]], atol=1e-5)
    assert float(np.max(mass[[3, 4, 6, 7, 8, 9]])) < 1e-6
    config = CompressionConfig(policy="h2o", budget=6, window=2)
    out = _check_compressed(cache, config, [0, 1, 2, 5, 8, 9])
    # The mass is compacted with its tokens.
    kept_mass = policy_scores(out, config)[0, 0, 0, :6]
    np.testing.assert_allclose(kept_mass[:4], [1.5, 0.5, 5.5, 2.5], atol=1e-5)


R = 1 / np.sqrt(2)
KEYS_RKV = [[1, 0], [1, 0], [1, 0], [0, 1], [0, 1], [-1, 0], [0, -1], [R, R], [1, 0], [0, 1]]


def _rkv_cache():
    k = jnp.asarray(KEYS_RKV, jnp.float32)[None, :, None, :]
    q = jnp.tile(jnp.array([1.0, 0.0]), (LENGTH, 1))[None, :, None, :]
    return _fill(k, q, window=2, track=False)


@pytest.mark.slow
def test_rkv_redundancy_only():
    # λ = 0: keep the 4 least redundant. Column sums of the cosine matrix over candidates 0..7
    # (diagonal zeroed; each row's last partner with cos > 0.5 zeroed, e.g. row 7's partner 4):
    # [1.71, 1.71, 1.71, 0.71, 0, -3.71, -2.71, -1.41] -> keep 4, 5, 6, 7.
    config = CompressionConfig(policy="rkv", budget=6, window=2, rkv_lambda=0.0)
    _check_compressed(_rkv_cache(), config, [4, 5, 6, 7, 8, 9])
    # Without retain-last, token 7 keeps its similarity to 0..4: column sums become
    # [1.71, 1.71, 1.71, 0.71, 0.71, -3.71, -2.71, 2.12] -> keep 3, 4, 5, 6.
    config = CompressionConfig(
        policy="rkv", budget=6, window=2, rkv_lambda=0.0, rkv_retain_last=False
    )
    _check_compressed(_rkv_cache(), config, [3, 4, 5, 6, 8, 9])


@pytest.mark.slow
def test_rkv_importance_only():
    # λ = 1 is SnapKV: window queries [1, 0] rank candidates by their first key coordinate,
    # 1 for 0, 1, 2 (ties: earliest first), then R for 7. Kernel 1 (no pooling).
    config = CompressionConfig(policy="rkv", budget=6, window=2, rkv_lambda=1.0, kernel_size=1)
    _check_compressed(_rkv_cache(), config, [0, 1, 2, 7, 8, 9])


@pytest.mark.slow
def test_rkv_score_matches_numpy():
    """The mixed score equals a loop-by-loop numpy evaluation of the R-KV formula."""
    cache = _rkv_cache()
    lam = 0.1
    config = CompressionConfig(policy="rkv", budget=6, window=2, rkv_lambda=lam, kernel_size=3)
    got = np.asarray(policy_scores(cache, config))[0, 0, 0, :8]
    keys = np.asarray(KEYS_RKV, np.float64)
    # importance: window queries 8, 9 (both [1, 0]) over keys 0..8 and 0..9.
    imp = np.zeros(8)
    for qi in (8, 9):
        logits = keys[: qi + 1, 0]
        p = np.exp(logits - logits.max())
        imp += (p / p.sum())[:8] / 2
    pooled = np.array([imp[max(0, j - 1) : j + 2].max() for j in range(8)])
    kn = keys[:8] / (np.linalg.norm(keys[:8], axis=1, keepdims=True) + 1e-8)
    sim = kn @ kn.T
    np.fill_diagonal(sim, 0.0)
    for i in range(8):
        partners = [j for j in range(8) if sim[i, j] > 0.5]
        if partners:
            sim[i, partners[-1]] = 0.0
    col = sim.mean(axis=0)
    red = np.exp(col - col.max()) / np.exp(col - col.max()).sum()
    np.testing.assert_allclose(got, lam * pooled - (1 - lam) * red, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["head", "layer", "sequence"])
def test_granularity(granularity):
    """Per head: each KV head keeps its own best; per layer / sequence: the summed score."""
    a0 = np.array([0.1, 3.0, 0.2, 0.5, 0.3, 2.0, 0.4, 0.0, 0.0, 0.0])
    a1 = np.array([2.9, 0.0, 1.9, 0.0, 0.6, 0.0, 0.0, 0.45, 0.0, 0.0])
    k = jnp.stack([jnp.stack([jnp.asarray(a), jnp.zeros(LENGTH)], -1) for a in (a0, a1)], 1)
    k = jnp.stack([k, k[:, ::-1]])  # layer 1: heads swapped
    q = jnp.tile(jnp.array([1.0, 0.0]), (2, LENGTH, 2, 1))
    cache = _fill(k.astype(jnp.float32), q, window=2, track=False)
    config = CompressionConfig(
        policy="snapkv", budget=6, window=2, kernel_size=1, granularity=granularity
    )
    out = compress(cache, config, force=True)
    kept = {(y, h): _kept(out, y, h) for y in range(2) for h in range(2)}
    if granularity == "head":
        best0, best1 = [1, 3, 5, 6, 8, 9], [0, 2, 4, 7, 8, 9]
        assert kept == {(0, 0): best0, (0, 1): best1, (1, 0): best1, (1, 1): best0}
    else:
        # Summed over the two heads (and layers, which hold the same pair): the per-token sum
        # of the two heads' importance decides; every head of every layer keeps the same set.
        per_head = np.asarray(
            policy_scores(
                cache,
                CompressionConfig(
                    policy="snapkv", budget=6, window=2, kernel_size=1, granularity="head"
                ),
            )
        )[0, 0, :, :8]
        total = per_head.sum(axis=0)
        want = sorted(np.argsort(-total, kind="stable")[:4].tolist()) + [8, 9]
        assert all(v == want for v in kept.values())
