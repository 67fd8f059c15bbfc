"""RLOO, REINFORCE++(-baseline), GSPO, GSPO-token, CISPO and REINFORCE + IS (sequence and token
weights, the sequence one also against verl's `bypass_pg_is`) against hand-computed values and
edge cases (empty and one-token responses, all-masked rows, groups of two)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.rl import (
    ADVANTAGE_ESTIMATORS,
    aggregate_loss,
    cispo_loss,
    compute_advantages,
    compute_policy_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    reinforce_is_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_token_is_loss,
    rloo_advantages,
    sequence_log_ratio,
    shifted_token_logprobs,
    sparse_rl_weights,
)
from sparserl_jax.rl.config import LearnerConfig, LossConfig, OptimizerConfig
from sparserl_jax.rl.learner import Learner
from sparserl_jax.testing import tiny_model
from sparserl_jax.testing.learner import host, make_batch, with_old

# --- advantages --------------------------------------------------------------------------------


def test_rloo_leave_one_out_baseline():
    got = rloo_advantages(jnp.array([1.0, 0.0, 0.0, 1.0, 3.0, 1.0]), group_size=2)
    np.testing.assert_allclose(got, [1, -1, -1, 1, 2, -2])  # groups of two: R_i - R_j
    got = rloo_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), group_size=4)
    np.testing.assert_allclose(got, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_array_equal(rloo_advantages(jnp.array([1.0, 5.0]), group_size=1), [0, 0])


def test_reinforce_pp_batch_normalised():
    r = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    # mean 2/3; unbiased variance (4 * 1/9 + 2 * 4/9) / 5 = 4/15.
    want = (r - 2 / 3) / (np.sqrt(4 / 15) + 1e-6)
    np.testing.assert_allclose(reinforce_pp_advantages(jnp.asarray(r), group_size=2), want, 1e-6)
    np.testing.assert_array_equal(
        reinforce_pp_advantages(jnp.full((4,), 0.7), group_size=2), np.zeros(4)
    )


def test_reinforce_pp_baseline_group_mean_then_batch_norm():
    got = reinforce_pp_baseline_advantages(jnp.array([1.0, 0.0, 2.0, 2.0]), group_size=2)
    # centred [0.5, -0.5, 0, 0]: mean 0, unbiased std sqrt(0.5 / 3).
    s = np.sqrt(0.5 / 3) + 1e-6
    np.testing.assert_allclose(got, [0.5 / s, -0.5 / s, 0.0, 0.0], rtol=1e-6)
    assert got[2] == 0.0 and got[3] == 0.0


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_all_equal_group_is_exactly_zero(estimator):
    # 123.456 is not a float32: the group mean is off by an ulp, and `/ (std + eps)` would
    # turn that into |A| ~ 1 without the forced zero.
    same = [123.456] * 8
    mixed = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    got = np.asarray(compute_advantages(jnp.array(same + mixed), group_size=8, estimator=estimator))
    if estimator == "reinforce_pp":  # no groups: only an all-equal batch is zero
        got = np.asarray(compute_advantages(jnp.array(same), group_size=8, estimator=estimator))
        np.testing.assert_array_equal(got, np.zeros(8))
        return
    np.testing.assert_array_equal(got[:8], np.zeros(8))
    assert np.all(np.abs(got[8:]) > 0.1)


# --- policy losses ------------------------------------------------------------------------------

OLD = jnp.zeros((3, 3))
# Row 0: two tokens, log-ratios 0.1, 0.3 (mean 0.2); row 1: one token; row 2: all masked.
NEW = jnp.array([[0.1, 0.3, -jnp.inf], [0.5, 0.0, 0.0], [7.0, 7.0, 7.0]])
MASK = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)


def test_sequence_log_ratio_is_masked_mean():
    np.testing.assert_allclose(sequence_log_ratio(NEW, OLD, MASK), [0.2, 0.5, 0.0], rtol=1e-6)


def test_gspo_sequence_clip():
    adv = jnp.array([1.0, -1.0, 2.0])
    got = gspo_loss(NEW, OLD, adv, MASK, eps_low=0.2, eps_high=0.2)
    s1 = np.exp(0.5)
    # A > 0, s0 = 1.221 > 1.2: clipped to -1.2 A. A < 0: max(s1, 1.2) = s1. Empty row: s = 1.
    want = np.array([-1.2, s1, -2.0])[:, None] * np.ones((1, 3))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.all(np.isfinite(got))
    # A one-token response is PPO-clip on that token.
    np.testing.assert_allclose(got[1, 0], ppo_clip_loss(NEW[1:2, :1], OLD[1:2, :1], adv[1:2])[0, 0])


def test_gspo_token_equals_gspo_in_value_and_gradient():
    adv = jnp.array([1.0, -1.0, 2.0])
    kw = dict(eps_low=0.3, eps_high=0.3)  # nothing clipped: gradients flow
    new = jnp.where(MASK, NEW, 0.0)

    def total(fn, lp):
        return aggregate_loss(fn(lp, OLD, adv, MASK, **kw), MASK, mode="seq_mean_token_mean")

    np.testing.assert_allclose(total(gspo_token_loss, new), total(gspo_loss, new), rtol=1e-6)
    g_seq = jax.grad(functools.partial(total, gspo_loss))(new)
    g_tok = jax.grad(functools.partial(total, gspo_token_loss))(new)
    np.testing.assert_allclose(g_tok, g_seq, rtol=1e-6, atol=1e-7)
    # d/dlogp_t of -A s / |y| averaged over B = 3 rows: row 0 has 2 tokens.
    np.testing.assert_allclose(g_seq[0, :2], -np.exp(0.2) / 2 / 3, rtol=1e-6)
    assert np.all(np.isfinite(jax.grad(functools.partial(total, gspo_token_loss))(NEW)))


def test_cispo_and_reinforce_weights():
    logp = jnp.array([[0.5, -1.0, 1.0]])
    adv = jnp.array([2.0])
    got = cispo_loss(logp, OLD[:1], adv, eps_low=1.0, eps_high=0.28)
    w = np.array([1.28, np.exp(-1.0), 1.28])  # clipped above only
    np.testing.assert_allclose(got, [-2.0 * w * np.array([0.5, -1.0, 1.0])], rtol=1e-6)
    grad = jax.grad(lambda lp: jnp.sum(cispo_loss(lp, OLD[:1], adv)))(logp)
    np.testing.assert_allclose(grad, [-2.0 * w], rtol=1e-6)  # never zeroed, only weighted
    got = reinforce_token_is_loss(logp, OLD[:1], adv, upper=2.0)
    w = np.array([np.exp(0.5), np.exp(-1.0), 2.0])
    np.testing.assert_allclose(got, [-2.0 * w * np.array([0.5, -1.0, 1.0])], rtol=1e-6)


def test_reinforce_weight_is_one_truncated_sequence_ratio():
    # verl `bypass_pg_is`: w_i = min(prod_t r_t, 2) over the row's tokens, the same for all of
    # them. Row 0: exp(0.1 + 0.3) = 1.49; row 1: exp(0.5) = 1.65 -> 1.5 with upper 1.5; row 2
    # (empty): exp(0) = 1.
    adv = jnp.array([1.0, -2.0, 3.0])
    logp = jnp.where(MASK, NEW, -1.0)  # padding may hold anything, even -inf (NEW row 0)
    got = reinforce_is_loss(NEW, OLD, adv, MASK, upper=1.5)
    assert np.all(np.isfinite(np.asarray(got)[np.asarray(MASK)]))
    got = reinforce_is_loss(logp, OLD, adv, MASK, upper=1.5)
    w = np.array([np.exp(0.4), 1.5, 1.0])[:, None]
    np.testing.assert_allclose(got, -w * np.asarray(adv)[:, None] * np.asarray(logp), rtol=1e-6)
    grad = jax.grad(lambda lp: jnp.sum(reinforce_is_loss(lp, OLD, adv, MASK, upper=1.5)))(logp)
    np.testing.assert_allclose(grad, -w * np.asarray(adv)[:, None] * np.ones((3, 3)), rtol=1e-6)
    _, clipped = compute_policy_loss(
        logp,
        OLD,
        jnp.broadcast_to(adv[:, None], (3, 3)),
        MASK,
        loss="reinforce",
        eps_low=1.0,
        eps_high=0.5,
    )
    np.testing.assert_array_equal(clipped, [[0] * 3, [1] * 3, [0] * 3])


def verl_bypass_pg_is_loss(log_prob, rollout_log_prob, advantages, response_mask, threshold):
    """numpy re-statement of verl's `bypass_pg_is` per-token loss (before `agg_loss`): verl
    `verl/trainer/ppo/core_algos.py` `compute_policy_loss_bypass_mode` ->
    `compute_policy_loss_reinforce`, weights from `verl/trainer/ppo/rollout_corr_helper.py`
    `compute_rollout_correction_weights` with `rollout_is="sequence"` (volcengine/verl @
    b178a3cd, 2026-01-29): `w = min(exp(clamp(sum_t mask * (log_prob - rollout_log_prob),
    -20, 20)), threshold) * mask`, `pg_losses = -A * log_prob * w`."""
    log_ratio_sum = ((log_prob - rollout_log_prob) * response_mask).sum(-1, keepdims=True)
    w = np.exp(np.clip(log_ratio_sum, -20.0, 20.0)) * response_mask
    w = np.minimum(w, threshold)
    return -advantages * log_prob * w


def test_reinforce_matches_verl_bypass_pg_is_on_random_inputs():
    rng = np.random.default_rng(0)
    b, t = 12, 9
    rollout = rng.normal(-2.0, 1.0, (b, t))
    logp = rollout + rng.uniform(-0.3, 0.3, (b, 1)) + rng.normal(0.0, 0.2, (b, t))
    logp[3, 2] += 25.0  # one token past the +-20 bound: verl clamps the sum, not the token
    mask = (rng.random((b, t)) < 0.8).astype(np.float64)
    adv = rng.normal(0.0, 1.0, (b, 1)) * np.ones((1, t))
    cfg = LossConfig(policy_loss="reinforce")
    got, _ = compute_policy_loss(
        jnp.asarray(logp, jnp.float32),
        jnp.asarray(rollout, jnp.float32),
        jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask, jnp.float32),
        loss=cfg.policy_loss,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
    )
    want = verl_bypass_pg_is_loss(logp, rollout, adv, mask, threshold=2.0)
    np.testing.assert_allclose(np.asarray(got) * mask, want, rtol=1e-5, atol=1e-6)
    w_seq = np.exp(np.clip(((logp - rollout) * mask).sum(-1), -20, 20))
    assert np.any(w_seq > 2.0) and np.any(w_seq < 1.0)  # both truncated and untruncated rows


# --- config and the learner --------------------------------------------------------------------


def test_loss_config_defaults_and_errors():
    assert (LossConfig().eps_low, LossConfig().eps_high) == (0.2, 0.2)
    assert (LossConfig.gspo().eps_low, LossConfig.gspo().eps_high) == (3e-4, 4e-4)
    assert LossConfig(policy_loss="cispo").eps_low == 1.0
    for name in ("reinforce", "reinforce_token"):  # no floor, cap 2 (verl's threshold)
        cfg = LossConfig(policy_loss=name)
        assert (cfg.eps_low, cfg.eps_high) == (1.0, 1.0)
    assert LossConfig(policy_loss="gspo", eps_high=0.01).eps_high == 0.01
    with pytest.raises(ValueError, match="'gspo2'"):
        LossConfig(policy_loss="gspo2")
    with pytest.raises(ValueError, match="seq_mean_token_mean"):
        LossConfig(policy_loss="gspo", aggregation="token_mean")
    with pytest.raises(ValueError, match="dual_clip applies to policy_loss='ppo' only"):
        LossConfig(policy_loss="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match="eps_low < 1"):
        LossConfig(eps_low=1.0)


def _reference_loss(params, graphdef, batch, loss_cfg):
    logp = shifted_token_logprobs(nnx.merge(graphdef, params)(batch.tokens_bt), batch.tokens_bt)
    corr = sparse_rl_weights(batch.old_logp_bt, batch.sampler_logp_bt, batch.mask_bt)
    kw = dict(eps_low=loss_cfg.eps_low, eps_high=loss_cfg.eps_high)
    if loss_cfg.policy_loss in ("gspo", "gspo_token"):
        fn = gspo_loss if loss_cfg.policy_loss == "gspo" else gspo_token_loss
        pg = fn(logp, batch.old_logp_bt, batch.advantages_b, corr.loss_mask_bt, **kw)
    elif loss_cfg.policy_loss == "reinforce":
        # The sequence weight runs over the response mask before rejection (as verl's).
        pg = reinforce_is_loss(
            logp,
            batch.old_logp_bt,
            batch.advantages_b,
            batch.mask_bt,
            upper=1.0 + loss_cfg.eps_high,
            lower=1.0 - loss_cfg.eps_low,
        )
    else:
        pg = cispo_loss(logp, batch.old_logp_bt, batch.advantages_b, **kw)
    return aggregate_loss(pg * corr.weights_bt, corr.loss_mask_bt, mode=loss_cfg.aggregation)


@pytest.mark.parametrize(
    "loss_cfg",
    [
        LossConfig(policy_loss="gspo", eps_low=0.05, eps_high=0.05),
        LossConfig(policy_loss="gspo_token", eps_low=0.05, eps_high=0.05, aggregation="token_mean"),
        LossConfig.cispo(),
        # Cap 1.21: some rows are truncated, and row 0's weight is not (1.208) only because
        # it runs over the mask before rejection (1.47 over the kept tokens).
        LossConfig(policy_loss="reinforce", eps_high=0.21),
        LossConfig(policy_loss="reinforce_token", aggregation="token_mean"),
    ],
    ids=["gspo", "gspo_token", "cispo", "reinforce", "reinforce_token"],
)
def test_learner_micro_batches_match_full_batch_reference(loss_cfg):
    model = tiny_model(seed=5, num_layers=1)
    cfg = LearnerConfig(
        loss=loss_cfg, optimizer=OptimizerConfig(learning_rate=1e-3), num_micro_batches=2
    )
    learner = Learner(model, cfg)
    state = learner.init(model)
    batch = with_old(learner, state, make_batch())
    # Move pi_old off pi_theta so that sequence ratios differ from 1 and some clip.
    shift = 0.1 * jax.random.normal(jax.random.key(3), batch.old_logp_bt.shape)
    batch = batch._replace(old_logp_bt=batch.old_logp_bt + shift)
    params0 = host(state.params)
    want, grads = jax.value_and_grad(_reference_loss)(params0, learner.graphdef, batch, loss_cfg)
    _, m = learner.step(state, batch, pass_index=1)
    np.testing.assert_allclose(m["loss"], want, rtol=1e-5, atol=1e-7)
    want_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(m["grad_norm"], want_norm, rtol=1e-5)
