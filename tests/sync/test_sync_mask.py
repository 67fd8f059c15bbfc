"""Visible mask, state digest and sharded extraction against numpy references."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.sync import (
    extract_changes,
    leaf_digests,
    publish_bits,
    to_bits,
    visible_bitmap,
    visible_delta,
)
from sparserl_jax.sync.mask import digest_update, element_hash, visible_mask


def np_bf16_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def test_mask_hand_values():
    # Hand-computed: +0 vs -0 differs, identical NaN and inf do not, RNE ties go to even.
    master = np.array(
        [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, 1.0, 1 + 2**-9, 1 + 2**-8, 1 + 3 * 2**-8],
        np.float32,
    )
    sent_vals = [-0.0, -0.0, np.nan, np.inf, np.inf, 0.0, 1.0, 1.0, 1.0, 1.0]
    sent = to_bits(jnp.asarray(np.array(sent_vals, np.float32)))
    masks, counts = visible_mask({"w": jnp.asarray(master)}, {"w": sent})
    expect = [True, False, False, False, True, True, False, False, False, True]
    np.testing.assert_array_equal(np.asarray(masks["w"]), expect)
    assert int(counts["w"]) == 4
    new_bits = np.asarray(to_bits(jnp.asarray(master)))
    assert new_bits[9] == 0x3F82 and new_bits[8] == 0x3F80 and new_bits[1] == 0x8000


def test_mask_matches_numpy_reference_random():
    rng = np.random.default_rng(0)
    master = (rng.standard_normal((37, 11)) * 0.02).astype(np.float32)
    sent_master = master + rng.standard_normal(master.shape).astype(np.float32) * 1e-5
    sent = np_bf16_bits(sent_master)
    masks, counts = visible_mask({"w": jnp.asarray(master)}, {"w": jnp.asarray(sent)})
    ref = np_bf16_bits(master) != sent
    np.testing.assert_array_equal(np.asarray(masks["w"]), ref)
    assert int(counts["w"]) == int(ref.sum()) > 0
    delta = visible_delta({"w": jnp.asarray(master)}, {"w": jnp.asarray(sent)})
    np.testing.assert_array_equal(np.asarray(delta["w"]), np_bf16_bits(master) ^ sent)


def test_non_float_leaves_are_published_as_is():
    tree = {"i": jnp.array([1, -2, 3], jnp.int32), "b": jnp.array([True, False]), "f": jnp.ones(2)}
    bits = publish_bits(tree, jnp.bfloat16)
    assert bits["i"].dtype == jnp.uint32 and bits["b"].dtype == jnp.uint8
    assert bits["f"].dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(bits["i"]), np.array([1, -2, 3], np.int32).view("u4"))
    kept = publish_bits(tree, None)
    assert kept["f"].dtype == jnp.uint32


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))


@pytest.mark.parametrize("shape", [(12, 10), (12, 16), (4, 6, 32)])
@pytest.mark.parametrize("spec", [P("a"), P(None, "b"), P("a", "b"), P()])
def test_sharded_mask_counts_and_extraction_match_unsharded(spec, shape):
    if shape[-1] == 10 and spec == P(None, "b"):
        spec = P(None, None)
    rng = np.random.default_rng(1)
    master = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    sent = np_bf16_bits(master + rng.standard_normal(master.shape).astype(np.float32) * 3e-4)
    sh = NamedSharding(_mesh(), spec)
    m_dev, s_dev = jax.device_put(master, sh), jax.device_put(sent, sh)
    masks, counts = visible_mask({"w": m_dev}, {"w": s_dev})
    assert masks["w"].sharding.is_equivalent_to(sh, 2)
    ref = np_bf16_bits(master) != sent
    assert int(counts["w"]) == int(ref.sum())
    bitmaps, packed, new_bits = visible_bitmap({"w": m_dev}, {"w": s_dev})
    assert packed == (shape[-1] % 8 == 0 and sh.shard_shape(shape)[-1] % 8 == 0,)
    if packed[0]:  # little bit order along the last axis, as np.packbits
        ref_packed = np.packbits(ref, axis=-1, bitorder="little")
        np.testing.assert_array_equal(np.asarray(bitmaps["w"]), ref_packed)
    else:
        np.testing.assert_array_equal(np.asarray(bitmaps["w"]), ref.astype(np.uint8))
    np.testing.assert_array_equal(np.asarray(new_bits["w"]), np_bf16_bits(master))
    ch = extract_changes(bitmaps["w"], s_dev, new_bits["w"], packed=packed[0])
    np.testing.assert_array_equal(ch.index, np.flatnonzero(ref))
    np.testing.assert_array_equal(ch.old, sent.reshape(-1)[ch.index])
    np.testing.assert_array_equal(ch.new, np_bf16_bits(master).reshape(-1)[ch.index])


def test_mask_does_not_gather_sharded_arrays():
    sh = NamedSharding(_mesh(), P("a", "b"))
    m = jax.device_put(jnp.zeros((16, 32), jnp.float32), sh)
    s = jax.device_put(jnp.zeros((16, 32), jnp.uint16), sh)
    hlo = visible_mask.lower({"w": m}, {"w": s}).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    hlo = leaf_digests.lower({"w": s}).compile().as_text()
    assert "all-gather" not in hlo
    from sparserl_jax.sync.mask import changed_bitmap

    lowered = changed_bitmap.lower({"w": s}, {"w": s}, pack=(True,), shardings=(sh,))
    hlo = lowered.compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "all-reduce" not in hlo


def np_digest(bits: np.ndarray) -> np.ndarray:
    idx = np.arange(bits.size, dtype=np.uint32)
    b = bits.reshape(-1).astype(np.uint32)
    return np.array([np.sum(element_hash(idx, b, k), dtype=np.uint32) for k in range(2)])


def test_digest_matches_numpy_and_sharding_and_incremental_update():
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**16, (12, 10), dtype=np.uint16)
    ref = np_digest(bits)
    np.testing.assert_array_equal(np.asarray(leaf_digests({"w": jnp.asarray(bits)})["w"]), ref)
    sh = NamedSharding(_mesh(), P("a", "b"))
    got = leaf_digests({"w": jax.device_put(bits, sh)})["w"]
    np.testing.assert_array_equal(np.asarray(got), ref)
    new = bits.copy().reshape(-1)
    idx = np.array([0, 5, 119])
    new[idx] ^= np.uint16(0x8000)  # sign flips, e.g. +0 -> -0
    upd = digest_update(ref, idx, bits.reshape(-1)[idx], new[idx])
    np.testing.assert_array_equal(upd, np_digest(new))
    assert not np.array_equal(upd, ref)


@pytest.mark.parametrize("shape", [(), (7,), (12, 10), (3, 4, 40)])
def test_receiver_digest_one_device_and_sharded_match_numpy(shape):
    # `_digest` sums both lanes in one variadic reduction on one device and per lane when
    # sharded; both must be the digest.
    from sparserl_jax.sync.receiver import digest_of as _digest

    bits = np.random.default_rng(3).integers(0, 2**16, shape, dtype=np.uint16)
    ref = np_digest(bits)
    x = jnp.asarray(bits).view(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(_digest(x)), ref)
    if len(shape) == 2:
        sharded = jax.device_put(x, NamedSharding(_mesh(), P("a", "b")))
        np.testing.assert_array_equal(np.asarray(_digest(sharded)), ref)


def test_digest_detects_swapped_elements():
    bits = np.arange(10, dtype=np.uint16)
    swapped = bits.copy()
    swapped[[2, 7]] = swapped[[7, 2]]
    assert not np.array_equal(np_digest(bits), np_digest(swapped))
