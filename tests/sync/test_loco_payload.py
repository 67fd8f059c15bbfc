"""The PULSELoCo payload: bf16 values with the rounding error kept in the residual, and the
entropy-coded positions (`loco_codec`): exactness, round trips, sizes, refusals."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax.sync import loco, loco_codec
from sparserl_jax.sync.errors import CorruptPatchError, TruncatedPatchError

P_ = 331  # fixed length: one compilation for every hypothesis example
F32_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
# ±0, subnormals (smallest, a bf16-exact one, the largest), the split threshold and its
# neighbours, values that round to bf16 ties, the bf16 overflow edge and fp32's largest.
EDGES = np.array(
    [0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-133, 1.1754942e-38, 2.0**-126, -(2.0**-126),
     2.0**-103, np.nextafter(np.float32(2.0**-103), np.float32(0)), 1.2345 * 2.0**-103,
     1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8 + 2.0**-20), BF16_MAX,
     np.nextafter(np.float32(BF16_MAX), np.float32(np.inf)), 3.3961776e38, F32_MAX, -F32_MAX,
     1e30, -3e-30, 0.1, np.inf, -np.inf],
    np.float32,
)  # fmt: skip

split = jax.jit(loco.split_bf16)


def bits32(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def draw_floats(seed: int, edges: float) -> np.ndarray:
    """Random fp32 bit patterns of every kind (no NaN), a fraction replaced by edge values."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, P_, dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    x[np.isnan(x)] = 1.5
    scale = rng.choice([1e-38, 1e-20, 1e-3, 1.0, 1e20], P_).astype(np.float32)
    normal = rng.random(P_) < 0.5
    x[normal] = (rng.normal(size=int(normal.sum())) * scale[normal]).astype(np.float32)
    pick = rng.random(P_) < edges
    x[pick] = rng.choice(EDGES, int(pick.sum()))
    return x


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.2, 1.0]))
def test_split_bf16_is_exact(seed, edges):
    s = draw_floats(seed, edges)
    hi, lo, exact = (np.asarray(x) for x in split(jnp.asarray(s)))
    assert not np.any(bits32(hi) & 0xFFFF)  # hi is a bf16 value: it travels as bf16 losslessly
    finite = np.isfinite(s)
    # Where it splits, hi + lo == s exactly in fp32 (as values: -0 splits into -0 and +0), and
    # the fp32 lo is the exact error (the same sum in float64, where nothing could round).
    ok = exact & finite
    np.testing.assert_array_equal(hi[ok] + lo[ok], s[ok])
    nz = ok & (s != 0)
    np.testing.assert_array_equal(bits32(hi[nz] + lo[nz]), bits32(s[nz]))
    np.testing.assert_array_equal(hi[ok].astype(np.float64) + lo[ok], s[ok].astype(np.float64))
    # hi is bf16 round-to-nearest-even, or truncation where that would overflow to ±inf.
    rne = s.astype(ml_dtypes.bfloat16)
    over = finite & np.isinf(rne)
    np.testing.assert_array_equal(bits32(hi[~over]) >> 16, rne[~over].view(np.uint16))
    np.testing.assert_array_equal(bits32(hi[over]) >> 16, bits32(s[over]) >> 16)
    assert np.all(np.isfinite(hi[finite]))
    # Non-finite entries travel whole; only tiny entries with nonzero low bits cannot split.
    np.testing.assert_array_equal(hi[~finite], s[~finite])
    np.testing.assert_array_equal(bits32(lo[~finite]), 0)
    tiny = (np.abs(s) < 2.0**-103) & (bits32(s) & 0xFFFF != 0)
    np.testing.assert_array_equal(~exact, tiny)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_bf16_rounding_error_is_exact_in_fp32(seed):
    # The claim behind split_bf16, in numpy (gradual underflow, no flush to zero): for every
    # finite fp32 x whose bf16 rounding stays finite, x - fp32(bf16(x)) computed in fp32 is exact,
    # subnormals included.
    x = draw_floats(seed, 0.2)
    with np.errstate(over="ignore"):
        back = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    ok = np.isfinite(x) & np.isfinite(back)
    err32 = x[ok] - back[ok]
    np.testing.assert_array_equal(err32.astype(np.float64), x[ok].astype(np.float64) - back[ok])


@pytest.mark.parametrize("value_dtype", ["bfloat16", "float32"])
@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1e-7, 1e-5, 1e-3]))
def test_error_feedback_bf16_values_conserve_mass(value_dtype, seed, s_scale):
    rng = np.random.default_rng(seed)
    theta = (rng.normal(size=P_) * 0.02).astype(np.float32)
    theta[:3] = [0.0, -0.0, 1.0]
    residual, delta = (rng.normal(size=(2, P_)) * s_scale).astype(np.float32)
    residual[:6], delta[:6] = 0.0, [1e-35, -3e-33, 1e30, 0.0, -0.0, 2.0**-103]
    sent, new_res, mask = (
        np.asarray(x)
        for x in jax.jit(loco.error_feedback, static_argnames="value_dtype")(
            jnp.asarray(theta), jnp.asarray(residual), jnp.asarray(delta), value_dtype=value_dtype
        )
    )
    s = residual + delta
    gate = theta.astype(ml_dtypes.bfloat16).view(np.uint16) != (theta - s).astype(
        ml_dtypes.bfloat16
    ).view(np.uint16)
    np.testing.assert_array_equal(sent + new_res, s)  # no mass lost or invented, bit for bit
    np.testing.assert_array_equal(bits32(sent[~mask]), 0)
    np.testing.assert_array_equal(bits32(new_res[~mask]), bits32(s[~mask]))
    if value_dtype == "float32":
        np.testing.assert_array_equal(mask, gate)
        np.testing.assert_array_equal(bits32(sent[mask]), bits32(s[mask]))
        return
    # Tiny entries (θ = ±0 fires for any s) are held back whole; the rest of the gate is sent.
    np.testing.assert_array_equal(
        mask, gate & ~((np.abs(s) < 2.0**-103) & (bits32(s) & 0xFFFF != 0))
    )
    assert not mask[0] and mask[2]
    np.testing.assert_array_equal(sent[mask], s[mask].astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(new_res[mask], s[mask] - sent[mask])


def random_payload(seed: int, num: int, density: float, itemsize: int, context: bool):
    """Sorted flat indices, random value bits and (`context`) θ-like bf16 bits over several
    binades, where entries fire more often at small |θ| (a smaller ulp), as the gate does."""
    rng = np.random.default_rng(seed)
    rate, ctx = np.full(num, density), None
    if context:
        theta = rng.normal(size=num) * rng.choice([1e-3, 0.05, 1.0], num)
        ctx = theta.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        rate = rate * np.where(np.abs(theta) < 0.01, 3.0, 0.3)
    index = np.flatnonzero(rng.random(num) < rate)
    bits = rng.integers(0, 2 ** (8 * itemsize), index.size, dtype=np.uint64)
    return index, bits.astype(np.dtype(f"<u{itemsize}")), ctx


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([1, 7, 300, 4099, 70_000]),
    st.sampled_from([0.0, 1e-4, 0.07, 0.5, 1.0]),
    st.sampled_from([2, 4]),
    st.booleans(),
)
def test_codec_round_trips_exactly(seed, num, density, itemsize, context):
    index, bits, ctx = random_payload(seed, num, density, itemsize, context)
    enc = loco_codec.encode_payload(index, bits, num_params=num, context=ctx)
    dec = loco_codec.decode_payload(enc.blob, num_params=num, value_itemsize=itemsize, context=ctx)
    np.testing.assert_array_equal(dec.index, index)
    np.testing.assert_array_equal(dec.bits, bits)
    assert dec.bits.dtype == bits.dtype
    assert (dec.position_bytes, dec.value_bytes) == (enc.position_bytes, enc.value_bytes)
    header = len(enc.blob) - enc.position_bytes - enc.value_bytes
    assert 16 <= header <= 16 + 4 + 4 * (4 + itemsize)


@pytest.mark.parametrize(("density", "mode"), [(0.02, 0), (0.07, 0), (0.15, 0), (0.5, 1), (0.8, 1)])
def test_codec_near_the_gate_entropy(density, mode):
    # An iid gate: positions cost within 6% of P * H2(k / P) bits, as gaps where few entries
    # fire and as the packed gate where many do (the header's position mode, byte 7).
    rng = np.random.default_rng(0)
    num = 200_000
    index = np.flatnonzero(rng.random(num) < density)
    enc = loco_codec.encode_payload(index, np.zeros(index.size, np.uint16), num_params=num)
    bound = loco_codec.gate_entropy_bits(index.size, num) / 8
    assert bound < enc.position_bytes < 1.06 * bound
    assert enc.blob[7] == mode
    assert enc.value_bytes < 100  # constant values compress to almost nothing
    dec = loco_codec.decode_payload(enc.blob, num_params=num, value_itemsize=2)
    np.testing.assert_array_equal(dec.index, index)


def test_context_coding_uses_the_exponent_classes():
    # The gate fires only where θ's exponent is small: with the context the positions cost about
    # the conditional entropy, far below the plain gate entropy.
    rng = np.random.default_rng(1)
    num = 100_000
    theta = rng.choice([1e-3, 1.0], num) * (1 + rng.random(num))
    ctx = theta.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    index = np.flatnonzero((theta < 0.01) & (rng.random(num) < 0.2))
    zeros = np.zeros(index.size, np.uint16)
    flat = loco_codec.encode_payload(index, zeros, num_params=num)
    coded = loco_codec.encode_payload(index, zeros, num_params=num, context=ctx)
    cond = loco_codec.context_entropy_bits(ctx, index) / 8
    assert cond < 0.8 * loco_codec.gate_entropy_bits(index.size, num) / 8
    assert coded.position_bytes < 1.06 * cond + 32 < flat.position_bytes


def test_entropy_helpers():
    assert loco_codec.gate_entropy_bits(0, 100) == loco_codec.gate_entropy_bits(100, 100) == 0
    assert loco_codec.gate_entropy_bits(50, 100) == pytest.approx(100.0)
    p = 0.07
    expect = -(p * np.log2(p) + (1 - p) * np.log2(1 - p)) * 1000  # 0.366 bit per entry
    assert loco_codec.gate_entropy_bits(70, 1000) == pytest.approx(expect)
    ctx = np.array([0x3F80] * 4 + [0x3A80] * 4, np.uint16)  # two exponents, 4 entries each
    assert loco_codec.context_entropy_bits(ctx, np.array([0, 1, 2, 3])) == 0.0
    assert loco_codec.context_entropy_bits(ctx, np.array([0, 4])) == pytest.approx(
        2 * 4 * 0.811278, rel=1e-5
    )


def test_decode_refuses_bad_payloads():
    index, bits, ctx = random_payload(3, 5000, 0.07, 2, True)
    blob = loco_codec.encode_payload(index, bits, num_params=5000, context=ctx).blob
    dec = lambda b, **kw: loco_codec.decode_payload(  # noqa: E731
        b, **({"num_params": 5000, "value_itemsize": 2, "context": ctx} | kw)
    )
    assert dec(blob).index.size == index.size
    with pytest.raises(TruncatedPatchError, match="shorter than its header"):
        dec(blob[:10])
    with pytest.raises(TruncatedPatchError, match="bytes, expected"):
        dec(blob[:-1])
    with pytest.raises(CorruptPatchError, match="1 extra bytes"):
        dec(blob + b"\0")
    with pytest.raises(CorruptPatchError, match="bad magic"):
        dec(b"XXXX" + blob[4:])
    with pytest.raises(CorruptPatchError, match="for 5000 parameters, not 4999"):
        dec(blob, num_params=4999)
    with pytest.raises(CorruptPatchError, match="value itemsize 2, expected 4"):
        dec(blob, value_itemsize=4)
    with pytest.raises(CorruptPatchError, match="context-coded, but no context was given"):
        dec(blob, context=None)
    # Flat positions past the end: one entry whose gap points beyond num_params.
    far = loco_codec.encode_payload(np.array([4999]), np.array([1], np.uint16), num_params=5000)
    lying = far.blob[:12] + (4000).to_bytes(4, "little") + far.blob[16:]
    with pytest.raises(CorruptPatchError, match=r"positions out of \[0, 4000\)"):
        loco_codec.decode_payload(lying, num_params=4000, value_itemsize=2)
    # A packed gate whose count was changed: its value streams no longer fit.
    half = np.flatnonzero(np.random.default_rng(4).random(5000) < 0.5)
    dense = loco_codec.encode_payload(half, np.zeros(half.size, np.uint16), num_params=5000)
    assert dense.blob[7] == 1
    lying = dense.blob[:8] + (half.size + 1).to_bytes(4, "little") + dense.blob[12:]
    with pytest.raises(CorruptPatchError, match="loco payload stream 1: zstd frame claims"):
        loco_codec.decode_payload(lying, num_params=5000, value_itemsize=2)
    with pytest.raises(ValueError, match="sorted, unique"):
        loco_codec.encode_payload(np.array([3, 3]), np.zeros(2, np.uint16), num_params=10)
    with pytest.raises(ValueError, match="uint16/uint32"):
        loco_codec.encode_payload(np.array([3]), np.zeros(1, np.uint8), num_params=10)
