"""IcePop weights, K1/K2/K3 divergence rejection at every level (chained), and bypass mode,
against hand-computed values and a numpy re-statement of verl's K1 rule."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.config import load_config
from sparserl_jax.rl import (
    REJECTION_CRITERIA,
    SparseRLCorrectionConfig,
    divergence_rejection_mask,
    parse_rejection,
    sparse_rl_weights,
)
from sparserl_jax.rl.config import LearnerConfig
from sparserl_jax.rl.learner import Learner
from sparserl_jax.testing import tiny_model
from sparserl_jax.testing.learner import make_batch
from sparserl_jax.train import check_config

# Row 0: log rho = [0.1, -0.5, 0.3] on three tokens; row 1: one token, log rho = 2.0;
# row 2: an all-masked (empty) response.
LOG_RHO = np.array([[0.1, -0.5, 0.3, 0.0], [2.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
MASK = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
OLD = jnp.full((3, 4), -1.0)
SAMPLER = OLD - jnp.asarray(LOG_RHO, jnp.float32)


def k2(x):
    return 0.5 * np.square(x)


def k3(x):
    return np.exp(x) - 1 - x


@pytest.mark.parametrize(
    "spec, want",
    [
        # K1 is verl's -log rho: [-0.1, 0.5, -0.3] | -2.0, kept in [log L, log U], i.e. rho kept
        # in [1/U, 1/L]. 0.7_1.7 keeps rho in [0.588, 1.429]: exp(-0.5) = 0.61 stays (it would
        # not in [0.7, 1.7]); exp(2) = 7.4 is out.
        ("token_k1=0.7_1.7", [[1, 1, 1, 0], [0, 0, 0, 0]]),
        # rho in [0.833, 10]: exp(-0.5) is out, exp(2) = 7.4 stays (it would not in [0.1, 1.2]).
        ("token_k1=0.1_1.2", [[1, 0, 1, 0], [1, 0, 0, 0]]),
        # One number U: lower 1/U (verl), so rho in [1/1.7, 1.7].
        ("token_k1=1.7", [[1, 1, 1, 0], [0, 0, 0, 0]]),
        ("token_k2=0.1", [[1, 0, 1, 0], [0, 0, 0, 0]]),  # k2: 0.005, 0.125, 0.045 | 2
        ("token_k3=0.1", [[1, 0, 1, 0], [0, 0, 0, 0]]),  # k3: 0.0052, 0.1065, 0.0499
        # Sequence sum of K1: 0.1 (product of ratios 0.905) | -2.0. 0.9_1.1 bounds it by
        # [-0.105, 0.095]: row 0 is out (the product 0.905 is outside [1/1.1, 1/0.9] =
        # [0.909, 1.111], though inside [0.9, 1.1]).
        ("seq_sum_k1=0.9_1.1", [[0, 0, 0, 0], [0, 0, 0, 0]]),
        ("seq_sum_k1=0.85_1.2", [[1, 1, 1, 0], [0, 0, 0, 0]]),  # [-0.163, 0.182]
        ("seq_sum_k1=0.1_1.2", [[1, 1, 1, 0], [1, 0, 0, 0]]),  # [-2.303, 0.182]
        # Row 0 sums: k2 0.175, k3 0.1616; row 1: k2 2, k3 4.389.
        ("seq_sum_k2=0.2", [[1, 1, 1, 0], [0, 0, 0, 0]]),
        ("seq_sum_k3=0.16", [[0, 0, 0, 0], [0, 0, 0, 0]]),
        # Means: k1 0.0333 (geometric-mean ratio 0.967) | -2.0; k2 0.0583; k3 0.0539.
        ("seq_mean_k1=0.96_8.0", [[1, 1, 1, 0], [0, 0, 0, 0]]),  # [-0.041, 2.079]
        ("seq_mean_k1=0.12_1.03", [[0, 0, 0, 0], [1, 0, 0, 0]]),  # [-2.120, 0.0296]
        ("seq_mean_k2=0.06", [[1, 1, 1, 0], [0, 0, 0, 0]]),
        ("seq_mean_k3=0.05", [[0, 0, 0, 0], [0, 0, 0, 0]]),
        # Max: k2 0.125 | 2; k3 0.1065 | 4.389.
        ("seq_max_k2=0.13", [[1, 1, 1, 0], [0, 0, 0, 0]]),
        ("seq_max_k3=0.1", [[0, 0, 0, 0], [0, 0, 0, 0]]),
    ],
)
def test_each_criterion_hand_computed(spec, want):
    got = divergence_rejection_mask(OLD, SAMPLER, MASK, (spec,))
    np.testing.assert_array_equal(got, np.array(want + [[0, 0, 0, 0]], np.float32))


def test_hand_computed_statistics_agree_with_the_table():
    row0 = LOG_RHO[0, :3]
    np.testing.assert_allclose([-row0.sum(), -row0.mean()], [0.1, 0.0333], atol=1e-4)
    np.testing.assert_allclose(
        np.log([0.9, 1.1, 0.85, 1.2]), [-0.105, 0.0953, -0.163, 0.182], atol=1e-3
    )
    np.testing.assert_allclose(np.log([0.96, 0.12, 1.03]), [-0.0408, -2.120, 0.0296], atol=1e-3)
    np.testing.assert_allclose([k2(row0).sum(), k3(row0).sum()], [0.175, 0.1616], atol=1e-4)
    np.testing.assert_allclose([k2(row0).mean(), k3(row0).mean()], [0.0583, 0.0539], atol=1e-4)
    assert set(REJECTION_CRITERIA) >= {"token_k1", "seq_max_k3"}


def test_criteria_chain_and_feed_the_loss_mask():
    chained = divergence_rejection_mask(OLD, SAMPLER, MASK, ("token_k2=0.1", "seq_sum_k1=0.85_1.2"))
    np.testing.assert_array_equal(chained, [[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    cfg = SparseRLCorrectionConfig(
        veto=False, reject=False, reweight=False, rejection=("token_k2=0.1",)
    )
    out = sparse_rl_weights(OLD, SAMPLER, MASK, cfg)
    np.testing.assert_array_equal(out.loss_mask_bt, [[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert float(out.metrics.rejected_seq_fraction) == pytest.approx(0.5)  # row 1 emptied


def test_parse_errors_are_clear():
    assert parse_rejection("token_k1=0.5_2").lower == 0.5
    # verl: a single K1 number is the upper bound and its reciprocal the lower one.
    assert parse_rejection("seq_mean_k1=4").lower == 0.25
    with pytest.raises(ValueError, match="LOWER_UPPER"):
        parse_rejection("seq_mean_k1=0.5")  # lower 2 > upper 0.5
    with pytest.raises(ValueError, match="0 < LOWER < UPPER"):
        parse_rejection("token_k1=0_2.0")  # verl: bounds must be positive
    with pytest.raises(ValueError, match="0 < LOWER < UPPER"):
        parse_rejection("token_k1=2.0_0.5")
    with pytest.raises(ValueError, match="one of"):
        parse_rejection("seq_max_k1=1.0")
    with pytest.raises(ValueError, match="not a number"):
        parse_rejection("token_k3=abc")
    with pytest.raises(ValueError, match="one positive upper bound"):
        SparseRLCorrectionConfig(rejection=("seq_mean_k3=0.1_0.2",))


def verl_rejection_keep(log_ratio, mask, option, threshold):
    """A numpy re-statement of verl's rule for one K1 option: verl
    `verl/trainer/ppo/rollout_corr_helper.py`, `_parse_rollout_rs_thresholds` and
    `compute_rollout_rejection_mask` (volcengine/verl @ b178a3cd, 2026-01-29).

    `log_ratio = old_log_prob - rollout_log_prob`, clamped to +-20; `token_k1 = -log_ratio`;
    the sequence sum / mean are masked (`masked_mean` divides by `mask.sum() + 1e-8`); a token
    or sequence is kept where `log(lower) <= stat <= log(upper)`; the result is
    `response_mask * keep`."""
    lower_str, upper_str = threshold.split("_", 1)
    lower_log, upper_log = math.log(float(lower_str)), math.log(float(upper_str))
    token_k1 = -np.clip(log_ratio, -20.0, 20.0)
    m = mask.astype(np.float64)
    if option == "token_k1":
        stat = token_k1
    else:
        seq = (token_k1 * m).sum(-1)
        if option == "seq_mean_k1":
            seq = seq / (m.sum(-1) + 1e-8)
        stat = np.broadcast_to(seq[:, None], token_k1.shape)
    return m * ((stat >= lower_log) & (stat <= upper_log))


@pytest.mark.parametrize("option", ["token_k1", "seq_sum_k1", "seq_mean_k1"])
@pytest.mark.parametrize("seed", range(8))
def test_non_reciprocal_k1_keeps_exactly_what_verl_keeps(option, seed):
    rng = np.random.default_rng(seed)
    b, t = 16, 12
    old = rng.normal(-2.0, 1.0, (b, t)).astype(np.float32)
    # Log-ratios with a per-row offset, so that token values, sequence sums and sequence means
    # all spread over [-1, 1], where the asymmetric bounds matter; a few far tokens exercise
    # the +-20 clamp.
    offset = rng.uniform(-1.0, 1.0, (b, 1)) / (t if option == "seq_sum_k1" else 1)
    noise = rng.normal(0.0, 0.2 if option == "seq_sum_k1" else 0.3, (b, t))
    sampler = (old - offset - noise).astype(np.float32)
    sampler[rng.random((b, t)) < 0.02] -= 30.0
    mask = rng.random((b, t)) < 0.8
    mask[0] = False  # an empty response
    log_ratio = (old - sampler).astype(np.float64)
    spec = "0.5_1.5"
    got = np.asarray(
        divergence_rejection_mask(
            jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), (f"{option}={spec}",)
        )
    )
    want = verl_rejection_keep(log_ratio, mask, option, spec)
    # Continuous random ratios never sit on a bound, so the masks must agree exactly.
    np.testing.assert_array_equal(got, want)
    # The inputs tell the two readings apart: "rho in [0.5, 1.5]" keeps other tokens.
    m = mask.astype(np.float64)
    lr = np.clip(log_ratio, -20, 20) * m
    level = {"token_k1": lr, "seq_sum_k1": lr.sum(-1, keepdims=True)}.get(
        option, lr.sum(-1, keepdims=True) / np.maximum(m.sum(-1, keepdims=True), 1)
    )
    ratio_reading = m * ((np.exp(level) >= 0.5) & (np.exp(level) <= 1.5))
    assert np.any(ratio_reading != want)
    assert 0 < want.sum() < m.sum()


@pytest.mark.parametrize(
    "option, level",
    [("token_k1", "token"), ("seq_sum_k1", "sequence"), ("seq_mean_k1", "geometric")],
)
def test_k1_is_the_ratio_rejection_with_reciprocal_bounds(option, level):
    """A bound [L, U] on the ratio itself is the Sparse-RL rejection (`reject_lower`,
    `reject_upper`); as a verl K1 criterion it is written (1/U)_(1/L)."""
    rng = np.random.default_rng(7)
    old = rng.normal(-2.0, 1.0, (16, 10)).astype(np.float32)
    offset = rng.uniform(-1.0, 1.0, (16, 1)) / (10 if level == "sequence" else 1)
    sampler = (old - offset - rng.normal(0.0, 0.3, (16, 10))).astype(np.float32)
    mask = jnp.asarray(rng.random((16, 10)) < 0.8)
    ratio = SparseRLCorrectionConfig(
        veto=False,
        reweight=False,
        reject_level=level,
        reject_lower=0.5,
        reject_upper=1.5,
    )
    k1 = SparseRLCorrectionConfig(
        veto=False, reject=False, reweight=False, rejection=(f"{option}={1 / 1.5}_{1 / 0.5}",)
    )
    by_ratio = sparse_rl_weights(jnp.asarray(old), jnp.asarray(sampler), mask, ratio)
    by_k1 = sparse_rl_weights(jnp.asarray(old), jnp.asarray(sampler), mask, k1)
    np.testing.assert_array_equal(by_k1.loss_mask_bt, by_ratio.loss_mask_bt)
    assert 0 < float(by_k1.metrics.masked_token_fraction) < 1


def test_icepop_zeroes_weights_outside_but_keeps_tokens():
    cfg = SparseRLCorrectionConfig.icepop(lower=0.7, upper=5.0)
    out = sparse_rl_weights(OLD, SAMPLER, MASK, cfg)
    np.testing.assert_array_equal(out.loss_mask_bt, MASK)  # still in the denominator
    want = np.where(np.asarray(MASK), np.exp(LOG_RHO), 0.0)
    want[0, 1] = 0.0  # exp(-0.5) = 0.61 < 0.7
    want[1, 0] = 0.0  # exp(2) = 7.4 > 5
    np.testing.assert_allclose(out.weights_bt, want, rtol=1e-6)
    with pytest.raises(ValueError, match="reweight_lower < reweight_upper"):
        SparseRLCorrectionConfig(reweight_mode="icepop", reweight_lower=2.0, reweight_upper=1.5)


def test_bypass_config_and_learner_use_sampler_logprobs():
    with pytest.raises(ValueError, match="could never fire"):
        SparseRLCorrectionConfig(bypass=True, rejection=("seq_mean_k3=0.01",))
    cfg = SparseRLCorrectionConfig.bypass_mode()
    # With pi_old := mu the correction is the identity.
    out = sparse_rl_weights(SAMPLER, SAMPLER, MASK, cfg)
    np.testing.assert_array_equal(out.loss_mask_bt, MASK)
    np.testing.assert_array_equal(out.weights_bt, MASK)
    model = tiny_model(seed=5, num_layers=1)
    learner = Learner(model, LearnerConfig(correction=cfg, num_micro_batches=2))
    state = learner.init(model)
    state, history = learner.train_on_batch(state, make_batch())
    # Pass 1: pi_theta differs from mu (random sampler logprobs): the ratio is not 1, but
    # pi_old was never recomputed, so approx_kl measures pi_theta against mu.
    assert float(history[0]["approx_kl"]) > 0.01
    assert float(history[0]["correction/masked_token_fraction"]) == 0.0


def test_cli_overrides_and_bypass_with_sparse_rollouts_is_an_error():
    cfg = load_config(
        "configs/demo.yaml",
        [
            "learner.correction.rejection=[seq_mean_k3=0.01,token_k1=0.5_2.0]",
            "learner.correction.reweight_mode=icepop",
            "learner.loss.policy_loss=gspo",
            "train.advantage_estimator=reinforce_pp_baseline",
        ],
    )
    assert cfg.learner.correction.rejection == ("seq_mean_k3=0.01", "token_k1=0.5_2.0")
    assert cfg.learner.loss.eps_high == 4e-4
    with pytest.raises(ValueError, match="seq_mean_token_mean"):
        load_config(
            "configs/demo.yaml",
            ["learner.loss.policy_loss=gspo", "learner.loss.aggregation=token_mean"],
        )
    bypass = ["learner.correction.bypass=true", "learner.correction.reject=false"]
    with pytest.raises(ValueError, match="rollout.kv.policy='rkv'"):
        check_config(load_config("configs/demo.yaml", bypass))
    check_config(load_config("configs/demo.yaml", [*bypass, "rollout.kv.policy=none"]))
