"""IcePop weights, K1/K2/K3 divergence rejection at every level (chained), and bypass mode,
against hand-computed values."""

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
        # Token K1: ratio in [0.7, 1.5]: exp(-0.5) = 0.61 and exp(2) are out.
        ("token_k1=0.7_1.5", [[1, 0, 1, 0], [0, 0, 0, 0]]),
        ("token_k2=0.1", [[1, 0, 1, 0], [0, 0, 0, 0]]),  # k2: 0.005, 0.125, 0.045 | 2
        ("token_k3=0.1", [[1, 0, 1, 0], [0, 0, 0, 0]]),  # k3: 0.0052, 0.1065, 0.0499
        # Sequence sum of log rho: -0.1 (ratio 0.905) | 2.0.
        ("seq_sum_k1=0.9_1.1", [[1, 1, 1, 0], [0, 0, 0, 0]]),
        ("seq_sum_k1=0.95_1.1", [[0, 0, 0, 0], [0, 0, 0, 0]]),
        # Row 0 sums: k2 0.175, k3 0.1616; row 1: k2 2, k3 4.389.
        ("seq_sum_k2=0.2", [[1, 1, 1, 0], [0, 0, 0, 0]]),
        ("seq_sum_k3=0.16", [[0, 0, 0, 0], [0, 0, 0, 0]]),
        # Means: k1 -0.0333 (ratio 0.967); k2 0.0583; k3 0.0539.
        ("seq_mean_k1=0.96_8.0", [[1, 1, 1, 0], [1, 0, 0, 0]]),
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
    np.testing.assert_allclose([k2(row0).sum(), k3(row0).sum()], [0.175, 0.1616], atol=1e-4)
    np.testing.assert_allclose([k2(row0).mean(), k3(row0).mean()], [0.0583, 0.0539], atol=1e-4)
    assert set(REJECTION_CRITERIA) >= {"token_k1", "seq_max_k3"}


def test_criteria_chain_and_feed_the_loss_mask():
    chained = divergence_rejection_mask(OLD, SAMPLER, MASK, ("token_k2=0.1", "seq_sum_k1=0.9_1.1"))
    np.testing.assert_array_equal(chained, [[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    cfg = SparseRLCorrectionConfig(
        veto=False, reject=False, reweight=False, rejection=("token_k2=0.1",)
    )
    out = sparse_rl_weights(OLD, SAMPLER, MASK, cfg)
    np.testing.assert_array_equal(out.loss_mask_bt, [[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert float(out.metrics.rejected_seq_fraction) == pytest.approx(0.5)  # row 1 emptied


def test_parse_errors_are_clear():
    assert parse_rejection("token_k1=0.5_2").lower == 0.5
    with pytest.raises(ValueError, match="LOWER_UPPER"):
        parse_rejection("seq_mean_k1=0.5")
    with pytest.raises(ValueError, match="one of"):
        parse_rejection("seq_max_k1=1.0")
    with pytest.raises(ValueError, match="not a number"):
        parse_rejection("token_k3=abc")
    with pytest.raises(ValueError, match="one positive upper bound"):
        SparseRLCorrectionConfig(rejection=("seq_mean_k3=0.1_0.2",))


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
