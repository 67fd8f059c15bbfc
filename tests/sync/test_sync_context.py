"""Format 3's receiver context: context order against a sort, the ordered bit line, the bound."""

import itertools

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax.sync.classes import (
    MAX_CUTS,
    best_cuts,
    choose_cuts,
    class_mask_bits,
    cut_counts,
    exponent_histogram,
    exponent_key,
    max_exponent,
)
from sparserl_jax.sync.order import (
    ContextCache,
    _Ranges,
    _select_in_word,
    context_order,
    context_rank,
    context_select,
)
from sparserl_jax.sync.values import entropy_bound, from_line, to_line

FLOATS = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


def sorted_positions(key: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The reference: each element's place in a stable sort of the leaf by class."""
    order = np.argsort(key, kind="stable")
    inverse = np.empty(key.size, np.int64)
    inverse[order] = np.arange(key.size)
    return inverse[index]


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(sorted(FLOATS)),
    n=st.integers(1, 700),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_context_rank_is_a_stable_sort_by_class_and_select_inverts_it(
    dtype, n, density, seed, data
):
    rng = np.random.default_rng(seed)
    size = FLOATS[dtype]
    bits = rng.integers(0, 2 ** (8 * size), n, dtype=np.uint64).astype(f"<u{size}")
    top = max_exponent(dtype)
    cuts = sorted(data.draw(st.sets(st.integers(1, top), max_size=MAX_CUTS)))
    index = np.flatnonzero(rng.random(n) < density)
    cls = np.searchsorted(cuts, exponent_key(bits, dtype), side="right")
    pos = context_rank(bits, dtype, cuts, index)
    np.testing.assert_array_equal(pos, sorted_positions(cls, index))
    np.testing.assert_array_equal(context_select(bits, dtype, cuts, pos), index)
    ordered = np.sort(pos)  # as the decoder sees them: in context order
    reference = np.argsort(cls, kind="stable")[ordered]
    np.testing.assert_array_equal(context_select(bits, dtype, cuts, ordered), reference)
    np.testing.assert_array_equal(context_rank(bits, dtype, [], index), index)  # flat order


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(FLOATS)),
    n=st.integers(1, 300),
    versions=st.integers(1, 8),
    max_cuts=st.integers(MAX_CUTS, MAX_CUTS + 3),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_context_cache_advanced_each_version_equals_a_rebuild(
    dtype, n, versions, max_cuts, seed, data
):
    """Held bitmaps and histogram, advanced by each version's changes (with or without their
    old bits), are those rebuilt from the bits, whatever cuts each version picks; the cache never
    holds more than `max_cuts` bitmaps per leaf."""
    rng = np.random.default_rng(seed)
    size = FLOATS[dtype]
    bits = rng.integers(0, 2 ** (8 * size), n, dtype=np.uint64).astype(f"<u{size}")
    top = max_exponent(dtype)
    cache = ContextCache(max_cuts=max_cuts)
    for _ in range(versions):
        cuts = sorted(data.draw(st.sets(st.integers(1, top), max_size=MAX_CUTS)))
        got, want = cache.ranges("w", bits, bits.size, dtype, cuts), _Ranges.of(bits, dtype, cuts)
        np.testing.assert_array_equal(got.below, want.below)
        np.testing.assert_array_equal(got.starts, want.starts)
        held = cache.histogram("w", bits, dtype)
        np.testing.assert_array_equal(held, exponent_histogram(bits, dtype))
        assert held.sum() == n
        index = context_rank(bits, dtype, cuts, np.arange(0, n, 3))
        ordered = np.sort(index)
        np.testing.assert_array_equal(
            context_select(bits, dtype, cuts, ordered, got),
            context_select(bits, dtype, cuts, ordered),
        )
        held = cache._leaves.get("w")
        assert held is None or len(held.slot) <= max_cuts  # nothing held for no cuts
        changed = np.flatnonzero(rng.random(n) < rng.random())  # sorted, unique
        new = rng.integers(0, 2 ** (8 * size), changed.size, dtype=np.uint64).astype(bits.dtype)
        with_old = data.draw(st.booleans())
        cache.advance("w", changed, new, bits[changed] if with_old else None)
        bits = bits.copy()
        bits[changed] = new
    cache.histogram("w", bits, dtype)
    with np.testing.assert_raises(ValueError):  # indices must be sorted and unique
        cache.advance("w", np.array([1, 1]), np.resize(bits, 2))
    cache.drop("w")
    assert "w" not in cache._leaves and "w" not in cache._hist


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 300), density=st.floats(0.0, 1.0))
def test_context_order_sorts_by_class_with_rising_positions(seed, n, density):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**16, n).astype(np.uint16)
    cuts = [118, 122, 126, 127]
    index = np.flatnonzero(rng.random(n) < density)
    order, pos = context_order(bits, "bfloat16", cuts, index)
    cls = np.searchsorted(cuts, exponent_key(bits, "bfloat16"), side="right")
    np.testing.assert_array_equal(order, np.argsort(cls[index], kind="stable"))
    np.testing.assert_array_equal(pos, sorted_positions(cls, index[order]))
    assert np.all(np.diff(pos) > 0)  # sorted flat indices: rising in context order


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), density=st.floats(0.01, 1.0))
def test_select_in_word_finds_the_kth_set_bit(seed, density):
    rng = np.random.default_rng(seed)
    bits = rng.random((500, 64)) < density
    bits[:, rng.integers(0, 64, 500)] = True  # at least one set bit per word
    words = np.packbits(bits, axis=1, bitorder="little").view("<u8").reshape(-1)
    k = (rng.random(500) * bits.sum(axis=1)).astype(np.int64)
    want = [np.flatnonzero(row)[j] for row, j in zip(bits, k, strict=True)]
    np.testing.assert_array_equal(_select_in_word(words, k), want)


def test_cuts_split_classes_of_different_change_rates():
    rng = np.random.default_rng(1)
    # Exponents 120..123 (small values) change often, 124..127 rarely.
    e = rng.integers(120, 128, 50_000)
    bits = ((e << 7) | rng.integers(0, 128, e.size)).astype(np.uint16)
    changed = rng.random(e.size) < np.where(e < 124, 0.3, 0.003)
    cuts = choose_cuts(bits, bits[changed], "bfloat16")
    assert 124 in cuts and len(cuts) <= MAX_CUTS
    assert choose_cuts(bits, bits[changed], "int16") == []
    assert choose_cuts(bits, bits[:0], "bfloat16") == []


def test_exponent_keys_per_dtype():
    x = np.array([1.0, -1.0, 2.0, 0.5, 0.0], np.float32)
    np.testing.assert_array_equal(
        exponent_key(x.view(np.uint32), "float32"), [127, 127, 128, 126, 0]
    )
    b = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(exponent_key(b, "bfloat16"), [127, 127, 128, 126, 0])
    h = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(exponent_key(h, "float16"), [15, 15, 16, 14, 0])
    assert exponent_key(np.arange(4, dtype=np.int32), "int32") is None


def _all_bf16() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def test_ordered_line_is_a_bijection_monotone_in_value():
    bits = _all_bf16()
    line = to_line(bits, 2)
    assert np.unique(line).size == bits.size and line.min() == -(1 << 15) and line.max() < 1 << 15
    np.testing.assert_array_equal(from_line(line, 2), bits)
    vals = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    finite = np.isfinite(vals)
    order = np.argsort(line[finite], kind="stable")
    assert np.all(np.diff(vals[finite][order]) >= 0)  # larger line -> never a smaller value
    # One ulp up from +0 is the smallest subnormal; one down from +0 is -0.
    assert from_line(np.array([1, -1]), 2).tolist() == [0x0001, 0x8000]
    w = np.array([0, 1 << 31, (1 << 32) - 1, 0x3F800000], np.uint32)
    np.testing.assert_array_equal(from_line(to_line(w, 4), 4), w)


def test_entropy_bound_counts_mask_and_steps():
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, 4096).astype(np.uint16)
    assert entropy_bound(old, old, "bfloat16") == (0.0, 0.0)
    # One class (no exponent): the mask bound is N * H2(k/N); steps of +1 only: 0 value bits.
    ints = np.arange(1, 4097, dtype=np.uint16)
    new = ints.copy()
    new[::4] += 1
    mask, values = entropy_bound(ints, new, "uint16")
    p = 0.25
    assert np.isclose(mask * 8, 4096 * -(p * np.log2(p) + (1 - p) * np.log2(1 - p)))
    assert values == 0.0
    # Steps +1/-1 with equal counts: one bit per change.
    new[::8] -= 2
    assert np.isclose(entropy_bound(ints, new, "uint16")[1] * 8, 1024)


def test_cuts_keep_the_preferred_ones_while_nearly_as_good():
    rng = np.random.default_rng(2)
    e = rng.integers(118, 130, 200_000)
    bits = ((e << 7) | rng.integers(0, 128, e.size)).astype(np.uint16)
    changed = rng.random(e.size) < np.exp2(118 - e)  # the rate halves per exponent
    best = choose_cuts(bits, bits[changed], "bfloat16")
    counts = exponent_histogram(bits, "bfloat16")
    assert choose_cuts(bits, bits[changed], "bfloat16", counts=counts) == best
    # A neighbour of the best cuts costs little more: kept; a poor split is replaced by the best.
    near = [*best[:-1], best[-1] + 1]
    assert near != best
    assert (
        choose_cuts(bits, bits[changed], "bfloat16", counts=counts, prefer=near, slack=0.05) == near
    )
    assert choose_cuts(bits, bits[changed], "bfloat16", counts=counts, prefer=near, slack=0) == best
    assert (
        choose_cuts(bits, bits[changed], "bfloat16", counts=counts, prefer=[129], slack=0.05)
        == best
    )


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), leaves=st.integers(1, 6))
def test_best_cuts_of_many_leaves_are_each_leafs_own(seed, leaves):
    """One dynamic program over several leaves (padded to the most exponents) picks what a
    program per leaf picks."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(leaves):
        lo = int(rng.integers(100, 126))
        e = rng.integers(lo, lo + int(rng.integers(1, 12)), int(rng.integers(1, 5000)))
        bits = ((e << 7) | rng.integers(0, 128, e.size)).astype(np.uint16)
        changed = rng.random(e.size) < np.exp2((e.min() - e) * rng.random())
        cases.append(
            cut_counts(bits, bits[changed], "bfloat16", counts=exponent_histogram(bits, "bfloat16"))
        )
    cases = [c for c in cases if c is not None]
    assert best_cuts(cases) == [best_cuts([c])[0] for c in cases]
    for (n_c, k_c), cuts in zip(cases, best_cuts(cases), strict=True):
        # no split into at most 5 ranges is cheaper (brute force over the present exponents)
        present = np.flatnonzero(n_c > 0)
        best = min(
            _split_cost(n_c, k_c, list(cs))
            for m in range(MAX_CUTS + 1)
            for cs in itertools.combinations(present[1:].tolist(), m)
        )
        assert _split_cost(n_c, k_c, cuts) <= best + 1e-6


def _split_cost(n_c, k_c, cuts):
    """Mask bits of the classes `cuts` make, plus a byte per cut (as `choose_cuts` counts)."""
    return class_mask_bits(*(np.add.reduceat(x, [0, *cuts]) for x in (n_c, k_c))) + 8 * len(cuts)
