"""Sparse-RL correction against hand-computed values, including its edge cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax.rl import (
    SparseRLCorrectionConfig,
    aggregate_loss,
    sparse_rl_weights,
)
from sparserl_jax.rl.correction import masked_percentile, rejection_by_advantage

# Three sequences, five positions; column 0 is the prompt. Row 2 is an empty completion.
MASK = jnp.array([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)
RHO = np.array([[1.0, 1.0, 2.0, 0.8, 1.0], [1.0, 1e-5, 1.2, 1.0, 1.0], [1.0] * 5])
OLD = jnp.log(jnp.full((3, 5), 0.3))
SAMPLER = OLD - jnp.log(jnp.asarray(RHO, jnp.float32))
VALID_RHO = np.array([1.0, 2.0, 0.8, 1e-5, 1.2])


def test_sparse_rl_defaults_hand_computed():
    out = sparse_rl_weights(OLD, SAMPLER, MASK)
    # Row 1 vetoed (rho = 1e-5 < 1e-4); in row 0 the token with rho = 2.0 is outside [0.5, 1.5].
    np.testing.assert_array_equal(
        out.loss_mask_bt, [[0, 1, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    )
    # w = min(rho, 1.5) divided by its mean over all 5 valid tokens (rejected ones included).
    mean_w = (1.0 + 1.5 + 0.8 + 1e-5 + 1.2) / 5
    want_w = np.array([[0, 1.0, 1.5, 0.8, 0], [0, 1e-5, 1.2, 0, 0], [0] * 5]) / mean_w
    np.testing.assert_allclose(out.weights_bt, want_w, rtol=1e-6)
    m = out.metrics
    assert float(m.rejected_seq_fraction) == pytest.approx(0.5)  # 1 of 2 non-empty sequences
    assert float(m.vetoed_seq_fraction) == pytest.approx(0.5)
    assert float(m.masked_token_fraction) == pytest.approx(3 / 5)
    assert float(m.rho_min) == pytest.approx(1e-5, rel=1e-5)
    assert float(m.rho_max) == pytest.approx(2.0, rel=1e-6)
    assert float(m.rho_mean) == pytest.approx(VALID_RHO.mean(), rel=1e-6)
    # Sorted valid ratios: 1e-5, 0.8, 1.0, 1.2, 2.0 (N = 5). p5: h = 0.05 * 4 = 0.2, between
    # the two smallest; p1: h = 0.04.
    assert float(m.rho_p5) == pytest.approx(1e-5 + 0.2 * (0.8 - 1e-5), rel=1e-5)
    assert float(m.rho_p1) == pytest.approx(1e-5 + 0.04 * (0.8 - 1e-5), rel=1e-5)
    want_kl = np.mean(VALID_RHO - 1 - np.log(VALID_RHO))  # k3 of KL(mu || pi_old)
    assert float(m.mismatch_kl) == pytest.approx(want_kl, rel=1e-5)
    want_ess = VALID_RHO.sum() ** 2 / (5 * (VALID_RHO**2).sum())
    assert float(m.ess) == pytest.approx(want_ess, rel=1e-6)


def test_naive_and_tis_only_configs():
    naive = sparse_rl_weights(OLD, SAMPLER, MASK, SparseRLCorrectionConfig.naive())
    np.testing.assert_array_equal(naive.loss_mask_bt, MASK)
    np.testing.assert_array_equal(naive.weights_bt, MASK)
    assert float(naive.metrics.masked_token_fraction) == 0.0
    assert float(naive.metrics.rejected_seq_fraction) == 0.0
    # Metrics still describe the mismatch when nothing corrects it.
    assert float(naive.metrics.rho_max) == pytest.approx(2.0, rel=1e-6)

    tis = sparse_rl_weights(OLD, SAMPLER, MASK, SparseRLCorrectionConfig.tis_only())
    np.testing.assert_array_equal(tis.loss_mask_bt, MASK)
    np.testing.assert_allclose(
        tis.weights_bt, [[0, 1.0, 1.5, 0.8, 0], [0, 1e-5, 1.2, 0, 0], [0] * 5], rtol=1e-5
    )
    tis2 = sparse_rl_weights(OLD, SAMPLER, MASK, SparseRLCorrectionConfig.tis_only(upper=2.0))
    assert float(tis2.weights_bt[0, 2]) == pytest.approx(2.0, rel=1e-6)


def test_each_part_switches_alone():
    veto_only = SparseRLCorrectionConfig(reject=False, reweight=False, batch_normalize=False)
    out = sparse_rl_weights(OLD, SAMPLER, MASK, veto_only)
    np.testing.assert_array_equal(out.loss_mask_bt, [[0, 1, 1, 1, 0], [0] * 5, [0] * 5])
    np.testing.assert_array_equal(out.weights_bt, MASK)
    reject_only = SparseRLCorrectionConfig(veto=False, reweight=False, batch_normalize=False)
    out = sparse_rl_weights(OLD, SAMPLER, MASK, reject_only)
    np.testing.assert_array_equal(out.loss_mask_bt, [[0, 1, 0, 1, 0], [0, 0, 1, 0, 0], [0] * 5])
    assert float(out.metrics.rejected_seq_fraction) == 0.0
    assert float(out.metrics.vetoed_seq_fraction) == 0.0
    assert float(out.metrics.masked_token_fraction) == pytest.approx(2 / 5)


def test_sequence_and_geometric_levels():
    # Row 0: product 1 * 2 * 0.8 = 1.6 (outside [0.5, 1.5]); geometric mean 1.6^(1/3) = 1.17.
    # Row 1: product 1.2e-5, geometric mean sqrt(1.2e-5) = 3.5e-3: rejected at both levels.
    seq = SparseRLCorrectionConfig(
        veto=False, reject_level="sequence", reweight_level="sequence", batch_normalize=False
    )
    out = sparse_rl_weights(OLD, SAMPLER, MASK, seq)
    np.testing.assert_array_equal(out.loss_mask_bt, np.zeros((3, 5)))
    np.testing.assert_allclose(
        out.weights_bt, [[0, 1.5, 1.5, 1.5, 0], [0, 1.2e-5, 1.2e-5, 0, 0], [0] * 5], rtol=1e-5
    )
    assert float(out.metrics.rejected_seq_fraction) == 1.0
    geo = SparseRLCorrectionConfig(
        veto=False, reject_level="geometric", reweight_level="geometric", batch_normalize=False
    )
    out = sparse_rl_weights(OLD, SAMPLER, MASK, geo)
    np.testing.assert_array_equal(out.loss_mask_bt, [[0, 1, 1, 1, 0], [0] * 5, [0] * 5])
    g0, g1 = 1.6 ** (1 / 3), math.sqrt(1.2e-5)
    np.testing.assert_allclose(
        out.weights_bt, [[0, g0, g0, g0, 0], [0, g1, g1, 0, 0], [0] * 5], rtol=1e-5
    )


def test_every_token_masked():
    sampler = OLD - math.log(3.0)  # rho = 3 everywhere: every token outside [0.5, 1.5]
    out = sparse_rl_weights(OLD, sampler, MASK)
    np.testing.assert_array_equal(out.loss_mask_bt, np.zeros((3, 5)))
    assert float(out.metrics.masked_token_fraction) == 1.0
    assert float(out.metrics.rejected_seq_fraction) == 1.0
    assert float(out.metrics.vetoed_seq_fraction) == 0.0
    # All weights 1.5 / mean(1.5) = 1 on valid tokens.
    np.testing.assert_allclose(out.weights_bt, MASK.astype(np.float32), rtol=1e-6)
    loss = jnp.ones((3, 5))
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert float(aggregate_loss(loss * out.weights_bt, out.loss_mask_bt, mode=mode)) == 0.0


def test_rejected_tokens_leave_numerator_and_denominator():
    out = sparse_rl_weights(OLD, SAMPLER, MASK, SparseRLCorrectionConfig(veto=False))
    loss = jnp.asarray([[9.0, 2.0, 100.0, 4.0, 9.0], [9.0, 100.0, 6.0, 9, 9], [9.0] * 5])
    # Row 0 keeps tokens 1 and 3; row 1 keeps token 2; the empty row still counts in B = 3.
    got = aggregate_loss(loss, out.loss_mask_bt, mode="seq_mean_token_mean")
    assert float(got) == pytest.approx(((2 + 4) / 2 + 6 / 1 + 0) / 3)


def test_log_ratio_clamped_and_padding_ignored():
    old = jnp.array([[0.0, -1.0, -60.0]])
    sampler = jnp.array([[-jnp.inf, -61.0, -1.0]])  # token 1: log rho = +60; token 2: -59
    mask = jnp.array([[False, True, True]])
    out = sparse_rl_weights(old, sampler, mask, SparseRLCorrectionConfig.naive())
    assert np.all(np.isfinite(np.asarray(out.weights_bt)))
    assert float(out.metrics.rho_max) == pytest.approx(math.exp(20.0), rel=1e-5)
    assert float(out.metrics.rho_min) == pytest.approx(math.exp(-20.0), rel=1e-5)
    for value in out.metrics:
        assert np.isfinite(float(value))
    vetoed = sparse_rl_weights(old, sampler, mask)
    assert float(vetoed.metrics.vetoed_seq_fraction) == 1.0


def test_no_valid_tokens_at_all():
    mask = jnp.zeros((2, 3), bool)
    out = sparse_rl_weights(jnp.zeros((2, 3)), jnp.full((2, 3), -5.0), mask)
    np.testing.assert_array_equal(out.weights_bt, 0.0)
    np.testing.assert_array_equal(out.loss_mask_bt, 0.0)
    assert float(out.metrics.rejected_seq_fraction) == 0.0
    assert float(out.metrics.ess) == 1.0
    assert float(out.metrics.rho_mean) == 1.0
    assert float(out.metrics.rho_p5) == float(out.metrics.rho_p1) == 1.0


def test_percentile_single_token_and_exact_index():
    # One valid token: every percentile is that token.
    mask = jnp.array([[False, True, False]])
    out = sparse_rl_weights(
        jnp.log(jnp.full((1, 3), 0.3)), jnp.log(jnp.array([[0.1, 0.6, 0.1]])), mask
    )
    assert float(out.metrics.rho_p5) == pytest.approx(0.5, rel=1e-6)
    assert float(out.metrics.rho_p1) == pytest.approx(0.5, rel=1e-6)
    # 101 valid values 0..100: p5 is exactly the value 5, p1 the value 1 (integer index).
    x = jnp.arange(101, dtype=jnp.float32)[::-1].reshape(1, 101)
    valid = jnp.ones((1, 101), bool)
    assert float(masked_percentile(x, valid, 5)) == 5.0
    assert float(masked_percentile(x, valid, 1)) == 1.0
    with pytest.raises(ValueError, match="percentile"):
        masked_percentile(x, valid, 5.0)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 5, 50, 100]))
def test_percentile_matches_numpy(seed, q):
    rng = np.random.default_rng(seed)
    x = rng.lognormal(0.0, 1.0, (3, 7)).astype(np.float32)
    valid = rng.random((3, 7)) < 0.6
    got = float(jax.jit(masked_percentile, static_argnums=2)(x, valid, q))
    if not valid.any():
        assert got == 1.0
    else:
        assert got == pytest.approx(float(np.percentile(x[valid], q)), rel=1e-5)


def test_weights_are_stop_gradient():
    def total(old):
        out = sparse_rl_weights(old, SAMPLER, MASK)
        return jnp.sum(out.weights_bt) + jnp.sum(out.loss_mask_bt)

    np.testing.assert_array_equal(jax.grad(total)(OLD), 0.0)


def test_jit_and_config_validation():
    jitted = jax.jit(sparse_rl_weights, static_argnums=3)
    out = jitted(OLD, SAMPLER, MASK, SparseRLCorrectionConfig())
    np.testing.assert_array_equal(out.loss_mask_bt, sparse_rl_weights(OLD, SAMPLER, MASK)[0])
    with pytest.raises(ValueError, match="'median'"):
        SparseRLCorrectionConfig(reject_level="median")
    with pytest.raises(ValueError, match=r"\[1.5, 0.5\]"):
        SparseRLCorrectionConfig(reject_lower=1.5, reject_upper=0.5)
    with pytest.raises(ValueError, match="veto_threshold"):
        SparseRLCorrectionConfig(veto_threshold=2.0)


def numpy_reference(old, sampler, mask, cfg):
    """The authors' per-sequence loop (slime `mis.py` + Sparse-RL's batch normalisation)."""
    b, _ = old.shape
    keep, weights = np.zeros_like(old), np.zeros_like(old)
    for i in range(b):
        m = mask[i].astype(np.float64)
        raw = np.where(mask[i], old[i] - sampler[i], 0.0)
        tok = np.clip(raw, -20, 20)

        def level(name, raw=raw, m=m, tok=tok):
            if name == "token":
                return tok
            s = (raw * m).sum() / (max(m.sum(), 1) if name == "geometric" else 1)
            return np.full_like(raw, np.clip(s, -20, 20))

        k = m.copy()
        if cfg.veto and np.any(mask[i] & (np.exp(tok) < cfg.veto_threshold)):
            k[:] = 0
        if cfg.reject:
            rho = np.exp(level(cfg.reject_level))
            k *= (rho >= cfg.reject_lower) & (rho <= cfg.reject_upper)
        w = np.minimum(np.exp(level(cfg.reweight_level)), cfg.reweight_upper)
        keep[i], weights[i] = k, (w if cfg.reweight else np.ones_like(w)) * m
    if cfg.batch_normalize and mask.sum() and weights.sum():
        weights = weights / (weights.sum() / mask.sum())
    return keep, weights


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(["token", "sequence", "geometric"]),
    st.sampled_from(["token", "sequence", "geometric"]),
    st.booleans(),
    st.booleans(),
)
def test_matches_per_sequence_reference(seed, reject_level, reweight_level, veto, normalize):
    rng = np.random.default_rng(seed)
    old = rng.normal(-2.0, 1.0, (4, 6))
    sampler = old - rng.normal(0.0, 0.5, (4, 6)) * rng.integers(0, 2, (4, 6))
    sampler[rng.random((4, 6)) < 0.05] += 12.0  # occasional veto-level mismatch
    mask = rng.random((4, 6)) < 0.7
    cfg = SparseRLCorrectionConfig(
        veto=veto,
        reject_level=reject_level,
        reweight_level=reweight_level,
        batch_normalize=normalize,
    )
    out = sparse_rl_weights(
        jnp.asarray(old, jnp.float32), jnp.asarray(sampler, jnp.float32), jnp.asarray(mask), cfg
    )
    want_keep, want_w = numpy_reference(old, sampler, mask, cfg)
    # Continuous random ratios never sit on a bound, so the masks must agree exactly.
    np.testing.assert_array_equal(out.loss_mask_bt, want_keep)
    np.testing.assert_allclose(out.weights_bt, want_w, rtol=2e-5, atol=1e-7)


def test_percentiles_run_over_the_tokens_after_the_first_eviction():
    # rho = 1, 1, 0.5, 0.2 on one row; the sampler evicted before its last two tokens.
    old = jnp.log(jnp.array([[0.4, 0.4, 0.2, 0.1]]))
    sampler = jnp.log(jnp.array([[0.4, 0.4, 0.4, 0.5]]))
    mask = jnp.ones((1, 4), bool)
    after = jnp.array([[False, False, True, True]])
    tail = sparse_rl_weights(old, sampler, mask, None, after)
    whole = sparse_rl_weights(old, sampler, mask)
    # p5 of {0.2, 0.5}: 0.2 + 0.05 * 0.3; of all four: 0.2 + 0.15 * 0.3.
    assert float(tail.metrics.rho_p5) == pytest.approx(0.215, rel=1e-5)
    assert float(whole.metrics.rho_p5) == pytest.approx(0.245, rel=1e-5)
    # Nothing else depends on it.
    rest = ({**m.metrics._asdict(), "rho_p1": 0, "rho_p5": 0} for m in (tail, whole))
    assert {k: float(v) for k, v in next(rest).items()} == {
        k: float(v) for k, v in next(rest).items()
    }
    np.testing.assert_array_equal(tail.weights_bt, whole.weights_bt)
    # No token after an eviction: no eviction mismatch to measure.
    none = sparse_rl_weights(old, sampler, mask, None, jnp.zeros((1, 4), bool))
    assert float(none.metrics.rho_p5) == float(none.metrics.rho_p1) == 1.0


def test_rejection_by_advantage_hand_computed():
    """Which sequences the correction removed, by the sign of their advantage."""
    mask = jnp.array([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [0, 0]], bool)
    keep = jnp.array([[0, 0], [1, 0], [0, 0], [1, 1], [0, 0], [0, 0]], jnp.float32)
    adv = jnp.array([1.0, 0.5, -1.0, -0.5, 0.0, 2.0])  # row 5 is empty: counts nowhere
    out = rejection_by_advantage(keep, mask, adv)
    # Rows 0 (adv > 0), 2 (adv < 0), 4 (adv 0) are rejected; 1 and 3 kept (one token is enough).
    assert float(out["rejected_pos_adv_fraction"]) == pytest.approx(1 / 2)
    assert float(out["rejected_neg_adv_fraction"]) == pytest.approx(1 / 2)
    assert float(out["kept_advantage_mean"]) == pytest.approx((0.5 - 0.5) / 2)
    # The veto of the defaults on the shared example: row 1 vetoed.
    corr = sparse_rl_weights(OLD, SAMPLER, MASK)
    out = rejection_by_advantage(corr.loss_mask_bt, MASK, jnp.array([-1.0, -2.0, 5.0]))
    assert float(out["rejected_neg_adv_fraction"]) == pytest.approx(1 / 2)
    assert float(out["rejected_pos_adv_fraction"]) == 0.0  # no valid positive row
    assert float(out["kept_advantage_mean"]) == pytest.approx(-1.0)
    # Nothing kept at all: the mean is 0, not NaN.
    none = rejection_by_advantage(jnp.zeros((6, 2)), mask, adv)
    assert float(none["kept_advantage_mean"]) == 0.0
    assert float(none["rejected_pos_adv_fraction"]) == 1.0
