"""PULSELoCo math vs numpy references: gate, error feedback, payload mean, outer step, bytes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax.sync import loco

P_ = 331  # fixed length: one compilation for every hypothesis example
# No subnormals: XLA:CPU flushes subnormal results of `θ − s` to zero while numpy keeps them, so
# the numpy reference would be a different arithmetic (the bf16 cast of subnormals is covered by
# PULSESync's mask tests).
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, 2.0**-126, 1.0, -2.0], np.float32)


def np_bf16_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bits32(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def draw_vectors(seed: int, theta_scale: float, s_scale: float, special: float):
    """θ ~ N(0, θ_scale²) and s ~ N(0, s_scale²) with some entries replaced by special values."""
    rng = np.random.default_rng(seed)
    theta = (rng.normal(size=P_) * theta_scale).astype(np.float32)
    s = (rng.normal(size=P_) * s_scale).astype(np.float32)
    for x in (theta, s):
        pick = rng.random(P_) < special
        x[pick] = rng.choice(SPECIALS, int(pick.sum()))
    return theta, s


vectors = st.tuples(
    st.integers(0, 2**31 - 1),
    st.sampled_from([1e-3, 0.02, 1.0, 300.0]),
    st.sampled_from([1e-7, 1e-5, 1e-3, 1.0]),
    st.sampled_from([0.0, 0.1]),
)


def test_gate_hand_values():
    # θ = 1: bf16 spacing is 2^-8 below 1 and 2^-7 above; ties round to even (1.0 is even).
    theta = np.ones(6, np.float32)
    s = np.array(
        [2**-9, 2**-8, -(2**-8), -(2**-8 + 2**-12), 0.0, 1e-30], np.float32
    )  # 1-2^-9 is a tie -> 1.0; 1-2^-8 exact; 1+2^-8 tie -> 1.0; just past the tie -> 1+2^-7
    mask = loco.pulse_gate(jnp.asarray(theta), jnp.asarray(s))
    np.testing.assert_array_equal(np.asarray(mask), [False, True, False, True, False, False])
    # At θ = 0 any nonzero s is visible (bf16 keeps fp32's exponent range).
    zero = jnp.zeros(2, jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(loco.pulse_gate(zero, jnp.asarray([1e-30, 0.0], jnp.float32))), [True, False]
    )


@settings(max_examples=40, deadline=None)
@given(vectors)
def test_gate_is_bf16_bit_visibility(case):
    theta, s = draw_vectors(*case)
    with np.errstate(invalid="ignore", over="ignore"):
        expect = np_bf16_bits(theta) != np_bf16_bits(theta - s)
    got = np.asarray(loco.pulse_gate(jnp.asarray(theta), jnp.asarray(s)))
    np.testing.assert_array_equal(got, expect)
    f16 = np.asarray(loco.pulse_gate(jnp.asarray(theta), jnp.asarray(s), jnp.float16))
    with np.errstate(invalid="ignore", over="ignore"):
        e16 = theta.astype(np.float16).view(np.uint16) != (theta - s).astype(np.float16).view(
            np.uint16
        )
    np.testing.assert_array_equal(f16, e16)


@settings(max_examples=40, deadline=None)
@given(vectors, st.integers(0, 2**31 - 1))
def test_error_feedback_conserves_mass_each_round(case, seed):
    theta, delta = draw_vectors(*case)
    delta = np.where(np.isfinite(delta), delta, np.float32(0.5))  # pseudo-gradients are finite
    residual = (np.random.default_rng(seed).normal(size=P_) * case[2]).astype(np.float32)
    sent, new_res, mask = (
        np.asarray(x)
        for x in loco.error_feedback(jnp.asarray(theta), jnp.asarray(residual), jnp.asarray(delta))
    )
    s = residual + delta  # numpy fp32: the same single rounding as the library
    expect_mask = np_bf16_bits(theta) != np_bf16_bits(theta - s)
    np.testing.assert_array_equal(mask, expect_mask)
    # Every entry of s goes to exactly one side, bit for bit; the other side holds +0.
    np.testing.assert_array_equal(bits32(np.where(mask, sent, new_res)), bits32(s))
    np.testing.assert_array_equal(bits32(np.where(mask, new_res, sent)), bits32(np.zeros(P_)))
    np.testing.assert_array_equal(sent + new_res, s)  # sent + residual = s exactly


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 8))
def test_error_feedback_conserves_mass_over_rounds(value_dtype, seed, rounds):
    # Pseudo-gradients are multiples of 2^-20 below 2^-10 in size, so every fp32 sum below is
    # exact and must equal the integer sum: Σ_t sent_t + e_T = Σ_t Δ_t with nothing lost. bf16
    # values round s to 8 significant bits, still whole multiples of 2^-20 here, the rest
    # staying in e.
    rng = np.random.default_rng(seed)
    ef = jax.jit(loco.error_feedback, static_argnames="value_dtype")
    residual = jnp.zeros(P_, jnp.float32)
    total_sent = np.zeros(P_, np.int64)
    total_delta = np.zeros(P_, np.int64)
    fired = 0
    for _ in range(rounds):
        units = rng.integers(-(2**10), 2**10, P_)
        theta = (rng.normal(size=P_) * 0.05).astype(np.float32)
        sent, residual, mask = ef(
            jnp.asarray(theta),
            residual,
            jnp.asarray((units * 2.0**-20).astype(np.float32)),
            value_dtype=value_dtype,
        )
        if value_dtype == "bfloat16":
            assert not np.any(bits32(sent) & 0xFFFF)  # bf16 values
        total_sent += (np.asarray(sent, np.float64) * 2**20).astype(np.int64)
        total_delta += units
        fired += int(np.asarray(mask).sum())
    final = (np.asarray(residual, np.float64) * 2**20).astype(np.int64)
    np.testing.assert_array_equal(total_sent + final, total_delta)
    assert 0 < fired < rounds * P_  # the gate really split the mass


def test_gate_off_sends_everything():
    rng = np.random.default_rng(0)
    theta, delta = (rng.normal(size=(2, P_)) * 1e-3).astype(np.float32)
    sent, residual, mask = loco.error_feedback(
        jnp.asarray(theta), jnp.zeros(P_, jnp.float32), jnp.asarray(delta), gate=False
    )
    assert bool(np.all(np.asarray(mask)))
    np.testing.assert_array_equal(bits32(sent), bits32(delta))
    np.testing.assert_array_equal(bits32(residual), bits32(np.zeros(P_)))


@pytest.mark.parametrize("replicas", [1, 3])
def test_payload_mean_matches_numpy(replicas):
    rng = np.random.default_rng(replicas)
    values = rng.normal(size=(replicas, P_)).astype(np.float32)
    masks = rng.random((replicas, P_)) < np.array([0.05, 0.5, 1.0][:replicas])[:, None]
    counts = masks.sum(1)
    size = int(counts.max()) + 3  # extra padding must be dropped
    rows = [
        loco.compact(jnp.asarray(m), jnp.asarray(v), size=size)
        for m, v in zip(masks, values, strict=True)
    ]
    for (index, value), m, v in zip(rows, masks, values, strict=True):
        index, value = np.asarray(index), np.asarray(value)
        assert index.dtype == np.int32
        np.testing.assert_array_equal(index[: m.sum()], np.flatnonzero(m))
        np.testing.assert_array_equal(index[m.sum() :], P_)  # padding: out of range
        np.testing.assert_array_equal(value, np.concatenate([v[m], np.zeros(size - m.sum())]))
    index_rn = jnp.stack([r[0] for r in rows])
    value_rn = jnp.stack([r[1] for r in rows])
    got = np.asarray(jax.jit(loco.mean_of_payloads, static_argnums=2)(index_rn, value_rn, P_))
    acc = np.zeros(P_, np.float32)
    for m, v in zip(masks, values, strict=True):  # replica order, fp32, then * fp32(1/R)
        acc = acc + np.where(m, v, np.float32(0))
    np.testing.assert_array_equal(bits32(got), bits32(acc * np.float32(1 / replicas)))


def test_all_entries_payload_equals_dense_mean():
    rng = np.random.default_rng(5)
    delta_rp = rng.normal(size=(3, P_)).astype(np.float32)
    index_rn = jnp.broadcast_to(jnp.arange(P_, dtype=jnp.int32), (3, P_))
    sparse = jax.jit(loco.mean_of_payloads, static_argnums=2)(index_rn, jnp.asarray(delta_rp), P_)
    dense = jax.jit(loco.mean_of_dense)(jnp.asarray(delta_rp))
    np.testing.assert_array_equal(bits32(sparse), bits32(dense))
    expect = ((np.float32(0) + delta_rp[0]) + delta_rp[1]) + delta_rp[2]
    np.testing.assert_array_equal(bits32(dense), bits32(expect * np.float32(1 / 3)))


def test_outer_nesterov_hand_values():
    # Dyadic values and lr = momentum = 1/2: every product and sum is exact (FMA or not).
    cfg = loco.LoCoConfig(outer_lr=0.5, outer_momentum=0.5)
    tx = cfg.outer_optimizer()
    theta = jnp.asarray([1.0, -2.0, 0.25], jnp.float32)
    g1 = jnp.asarray([0.5, 0.25, -1.0], jnp.float32)
    g2 = jnp.asarray([-0.5, 0.5, 0.0], jnp.float32)
    state = tx.init(theta)
    step = jax.jit(lambda t, s, g: loco.outer_update(tx, t, s, g))
    theta1, state = step(theta, state, g1)
    # m1 = g1; θ1 = θ − lr (g1 + μ m1) = θ − 0.75 g1
    np.testing.assert_array_equal(np.asarray(theta1), [0.625, -2.1875, 1.0])
    theta2, _ = step(theta1, state, g2)
    # m2 = μ m1 + g2 = [-0.25, 0.625, -0.5]; θ2 = θ1 − lr (g2 + μ m2)
    np.testing.assert_array_equal(np.asarray(theta2), [0.9375, -2.59375, 1.125])


def test_outer_default_is_diloco_nesterov():
    # lr 0.7 / momentum 0.9 against float64 (XLA:CPU fuses mul+add into FMA, so only a few fp32
    # roundings separate them: relative 1e-6 is ~8 ulps).
    cfg = loco.LoCoConfig()
    assert (cfg.outer_lr, cfg.outer_momentum, cfg.nesterov) == (0.7, 0.9, True)
    tx = cfg.outer_optimizer()
    rng = np.random.default_rng(1)
    theta = rng.normal(size=P_).astype(np.float32)
    grads = (rng.normal(size=(3, P_)) * 1e-3).astype(np.float32)
    t, state = jnp.asarray(theta), tx.init(jnp.asarray(theta))
    ref, m = theta.astype(np.float64), np.zeros(P_)
    for g in grads:
        t, state = loco.outer_update(tx, t, state, jnp.asarray(g))
        m = 0.9 * m + g
        ref = ref - 0.7 * (g + 0.9 * m)
    np.testing.assert_allclose(np.asarray(t), ref, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 70), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_mask_pack_unpack_roundtrip(length, density, seed):
    mask = np.random.default_rng(seed).random(length) < density
    packed = np.asarray(loco.pack_mask(jnp.asarray(mask)))
    assert packed.dtype == np.uint8 and packed.size == -(-length // 8)
    np.testing.assert_array_equal(packed, np.packbits(mask, bitorder="little"))
    np.testing.assert_array_equal(np.asarray(loco.unpack_mask(jnp.asarray(packed), length)), mask)


def test_bitmask_payload_gives_the_index_payload_indices():
    # A receiver re-deriving the indices from the packed gate gets the sender's own, padding too.
    mask = np.random.default_rng(3).random(P_) < 0.3
    size = int(mask.sum()) + 5
    index, _ = loco.compact(jnp.asarray(mask), jnp.zeros(P_, jnp.float32), size=size)
    unpacked = loco.unpack_mask(loco.pack_mask(jnp.asarray(mask)), P_)
    np.testing.assert_array_equal(np.asarray(loco.mask_indices(unpacked, size)), np.asarray(index))


def test_byte_accounting():
    assert loco.payload_bytes([0, 10, 3], 1000) == 3 * 4 + 13 * 8
    assert loco.padded_payload_bytes(3, 10, 1000) == 3 * (4 + 80)
    # bitmask: the packed gate, ceil(P/8) bytes, plus a count and an fp32 value per entry.
    assert loco.payload_bytes([0, 10, 3], 1001, "bitmask") == 3 * (4 + 126) + 13 * 4
    assert loco.padded_payload_bytes(3, 10, 1001, "bitmask") == 3 * (4 + 126 + 40)
    # bf16 values: 2 B each.
    assert loco.payload_bytes([0, 10, 3], 1000, "index", value_bytes=2) == 3 * 4 + 13 * 6
    assert loco.padded_payload_bytes(3, 10, 1001, "bitmask", 2) == 3 * (4 + 126 + 20)
    with pytest.raises(ValueError, match="payload format 'zstd' unknown"):
        loco.payload_bytes([1], 8, "zstd")
    # Coded: each replica's byte count and its measured blob.
    assert loco.coded_payload_bytes([100, 7]) == 4 + 100 + 4 + 7
    # auto: the bitmask wins once more than P/32 entries are sent (4 B per entry vs P/8 B),
    # whatever the value dtype.
    for value_dtype in ("float32", "bfloat16"):
        auto = loco.LoCoConfig(payload="auto", value_dtype=value_dtype)
        got = [auto.payload_format(3200, n) for n in (99, 100, 101)]
        assert got == ["index", "index", "bitmask"]
    assert loco.LoCoConfig(payload="index").payload_format(3200, 3200) == "index"
    assert loco.LoCoConfig(payload="bitmask").payload_format(3200, 1) == "bitmask"
    assert loco.LoCoConfig().payload_format(3200, 1) == "coded"
    assert (
        loco.LoCoConfig().value_bytes == 2
        and loco.LoCoConfig(value_dtype="float32").value_bytes == 4
    )
    assert loco.diloco_bytes(1000, 4, rounds=5) == 5 * 4 * 1000 * 4
    assert loco.ddp_bytes(1000, 4, steps=50) == 50 * 4 * 1000 * 4
    cfg = loco.LoCoConfig(pad_multiple=256)
    assert [cfg.padded_count(n) for n in (0, 1, 256, 257)] == [256, 256, 256, 512]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "sparse"}, "method 'sparse' unknown; expected one of"),
        ({"inner_steps": 0}, "inner_steps must be an int >= 1, got 0"),
        ({"outer_lr": 0.0}, "outer_lr must be > 0, got 0.0"),
        ({"outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\), got 1.0"),
        ({"gate_dtype": "float8"}, "gate_dtype 'float8' unknown"),
        ({"pad_multiple": 0}, "pad_multiple must be an int >= 1, got 0"),
        ({"payload": "zstd"}, "payload 'zstd' unknown; expected one of"),
        ({"value_dtype": "float16"}, "value_dtype 'float16' unknown; expected one of"),
        ({"zstd_level": 0}, "zstd_level must be an int in 1..22, got 0"),
        ({"method": "diloco", "gate": False}, "gate=False only applies to method='pulseloco'"),
    ],
)
def test_config_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        loco.LoCoConfig(**kwargs)


def test_plain_momentum_option():
    tx = loco.LoCoConfig(outer_momentum=0.0).outer_optimizer()
    theta = jnp.asarray([1.0, 2.0], jnp.float32)
    out, _ = loco.outer_update(tx, theta, tx.init(theta), jnp.asarray([0.5, -0.5], jnp.float32))
    expect = optax.apply_updates(theta, jnp.asarray([-0.35, 0.35], jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expect))
