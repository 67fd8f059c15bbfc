"""(c) Allocator + compaction properties (hypothesis): no page owned twice, no kept token lost,
pages in use match the counts.

Random programs of ragged appends (some overflowing the pool or a slot's table), compressions of
random rows (H2O with random keys, per KV head or per sequence) and slot releases run on a tiny
cache. Values carry (absolute position, slot); after every operation the invariants are checked
against a pure-Python model of what each slot holds, which follows each compression's selection
once it has checked that selection is a sorted subset of the slot's tokens ending in the window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.paged_attention.reference import gather_pages
from sparserl_jax.kvcache import CompressionConfig, PagedKVCache, compress_rows, release_slots

B, PAGE, MAXP, POOL, KH = 3, 2, 6, 14, 2
BUDGET, WINDOW = 5, 2


def _append(cache, counts, stamp):
    """Append `counts[b]` tokens to slot b; each value is (absolute position, slot, head)."""
    t = 4  # static: counts are at most 4, ragged through the mask
    mask = jnp.arange(t)[None, :] < counts[:, None]
    cache, pos_bt = cache.begin_step(mask)
    v = jnp.stack(
        [
            jnp.broadcast_to(pos_bt[:, :, None].astype(jnp.float32), (B, t, KH)),
            jnp.broadcast_to(jnp.arange(B, dtype=jnp.float32)[:, None, None], (B, t, KH)),
            jnp.broadcast_to(jnp.arange(KH, dtype=jnp.float32)[None, None, :] + stamp, (B, t, KH)),
        ],
        axis=-1,
    )
    # Random keys so the H2O mass differs per head (and the kept sets with it).
    k = jax.random.normal(jax.random.key(stamp), (B, t, KH, 3))
    q = jnp.zeros((B, t, KH, 3))
    _, cache = cache.attend(0, q, k, v)
    return cache.end_step()


def _check(cache, model):
    pt = np.asarray(cache.page_table)
    npages = np.asarray(cache.num_pages_b)
    top = int(cache.free_top)
    owned = [p for b in range(B) for p in pt[b, : npages[b]]]
    free = np.asarray(cache.free_stack)[:top].tolist()
    # No page owned twice, none both owned and free, and together they are the whole pool.
    assert len(owned) == len(set(owned))
    assert not set(owned) & set(free)
    assert sorted(owned + free) == list(range(POOL))
    assert (pt[np.arange(MAXP)[None, :] >= npages[:, None]] == -1).all()
    # Pages in use match the kept counts.
    lengths = np.asarray(cache.lengths_b)
    np.testing.assert_array_equal(npages, -(-lengths // PAGE))
    assert POOL - top == npages.sum()
    assert int(cache.peak_pages) >= POOL - top
    # Every kept token is where the model says (per head), with its own slot and head stamp.
    v = np.asarray(gather_pages(cache.split_heads(cache.v_pages)[0], cache.page_table))
    for b in range(B):
        assert lengths[b] == len(model[b][0])
        for h in range(KH):
            got = v[b, : lengths[b], h]
            np.testing.assert_array_equal(got[:, 0], model[b][h])
            np.testing.assert_array_equal(got[:, 1], b)


op = st.one_of(
    st.tuples(st.just("append"), st.lists(st.integers(0, 4), min_size=B, max_size=B)),
    st.tuples(st.just("compress"), st.lists(st.booleans(), min_size=B, max_size=B)),
    st.tuples(st.just("release"), st.lists(st.booleans(), min_size=B, max_size=B)),
)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=10), granularity=st.sampled_from(["head", "sequence"]))
def test_allocator_and_compaction_invariants(ops, granularity):
    cache = PagedKVCache.create(
        num_layers=1,
        batch=B,
        num_pages=POOL,
        page_size=PAGE,
        max_pages_per_slot=MAXP,
        num_kv_heads=KH,
        head_dim=3,
        num_heads=KH,
        track_attention_mass=True,
    )
    config = CompressionConfig(policy="h2o", budget=BUDGET, window=WINDOW, granularity=granularity)
    model = [[[] for _ in range(KH)] for _ in range(B)]  # kept absolute positions per head
    next_pos = [0] * B
    append = jax.jit(_append)
    crows = jax.jit(lambda c, r: compress_rows(c, config, r))
    for stamp, (kind, arg) in enumerate(ops):
        if kind == "append":
            before_over = np.asarray(cache.overflow_b)
            cache = append(cache, jnp.asarray(arg, jnp.int32), stamp)
            over = np.asarray(cache.overflow_b)
            for b in range(B):
                if over[b] and not before_over[b]:
                    continue  # no room: nothing stored, the flag says so
                if over[b]:
                    continue
                for h in range(KH):
                    model[b][h] += list(range(next_pos[b], next_pos[b] + arg[b]))
                next_pos[b] += arg[b]
            np.testing.assert_array_equal(cache.next_pos_b, next_pos)
        elif kind == "compress":
            rows = np.array(arg) & (np.asarray(cache.lengths_b) > BUDGET)
            old = [[list(m) for m in slot] for slot in model]
            cache = crows(cache, jnp.asarray(rows))
            v = np.asarray(gather_pages(cache.split_heads(cache.v_pages)[0], cache.page_table))
            for b in np.flatnonzero(rows):
                for h in range(KH):
                    kept = v[b, :BUDGET, h, 0].astype(int).tolist()
                    # A kept token is one the slot held, in order, the window always kept.
                    assert kept == sorted(set(kept)) and set(kept) <= set(old[b][h])
                    assert kept[-WINDOW:] == old[b][h][-WINDOW:]
                    model[b][h] = kept
                if granularity == "sequence":
                    assert model[b][0] == model[b][1]
        else:
            cache = release_slots(cache, jnp.asarray(arg))
            for b in np.flatnonzero(arg):
                model[b] = [[] for _ in range(KH)]
                next_pos[b] = 0
        _check(cache, model)
