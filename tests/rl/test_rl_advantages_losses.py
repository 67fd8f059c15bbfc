"""Advantages, PPO-clip, aggregation, KL estimators and entropy against hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax.rl import (
    aggregate_loss,
    aggregation_weights,
    compute_advantages,
    dapo_advantages,
    dapo_overlong_penalty,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    entropy_from_logits,
    grpo_advantages,
    kept_group_advantages,
    kl_penalty,
    ppo_clip_fraction,
    ppo_clip_loss,
    shifted_token_logprobs,
    token_logprobs,
)

REWARDS = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])


def test_grpo_hand_computed():
    # Group 1: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5. Group 2: identical rewards -> 0.
    adv = grpo_advantages(REWARDS, group_size=4)
    want = np.array([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / np.array([0.5 + 1e-6] * 4 + [1] * 4)
    np.testing.assert_allclose(adv, want, rtol=1e-6)
    # Population std: rewards [2, 0] have mean 1 and std 1.
    np.testing.assert_allclose(
        grpo_advantages(jnp.array([2.0, 0.0]), group_size=2, std_ddof=0),
        np.array([1.0, -1.0]) / (1.0 + 1e-6),
        rtol=1e-6,
    )


def test_identical_rewards_and_singleton_groups_give_zero():
    np.testing.assert_array_equal(grpo_advantages(jnp.full((6,), 0.7), group_size=3), 0.0)
    np.testing.assert_array_equal(grpo_advantages(jnp.array([1.0, 0.0, 3.0]), group_size=1), 0.0)
    np.testing.assert_array_equal(dr_grpo_advantages(jnp.full((4,), 2.0), group_size=2), 0.0)


def test_dr_grpo_and_dapo():
    np.testing.assert_allclose(
        dr_grpo_advantages(jnp.array([1.0, 0.0, 0.0, 0.0, 3.0, 1.0]), group_size=2),
        [0.5, -0.5, 0.0, 0.0, 1.0, -1.0],
    )
    np.testing.assert_allclose(
        dr_grpo_advantages(REWARDS, group_size=4)[:4], [0.75, -0.25, -0.25, -0.25]
    )
    np.testing.assert_array_equal(
        dapo_advantages(REWARDS, group_size=4), grpo_advantages(REWARDS, group_size=4)
    )
    np.testing.assert_array_equal(
        dynamic_sampling_mask(REWARDS, group_size=4), [True] * 4 + [False] * 4
    )
    pen = dapo_overlong_penalty(jnp.array([5, 6, 8, 10, 11]), max_len=10, cache_len=4)
    np.testing.assert_allclose(pen, [0.0, 0.0, -0.5, -1.0, -1.0])
    for name, fn in [("grpo", grpo_advantages), ("dr_grpo", dr_grpo_advantages)]:
        np.testing.assert_array_equal(
            compute_advantages(REWARDS, group_size=4, estimator=name), fn(REWARDS, group_size=4)
        )


def test_advantage_errors_name_the_values():
    with pytest.raises(ValueError, match="group_size=3"):
        grpo_advantages(REWARDS, group_size=3)
    with pytest.raises(ValueError, match="'ppo'"):
        compute_advantages(REWARDS, group_size=4, estimator="ppo")


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=6, max_size=6),
    st.floats(0.1, 10.0),
    st.floats(-5.0, 5.0),
)
def test_grpo_invariant_to_affine_rewards(ints, scale, shift):
    r = jnp.array(ints, jnp.float32)
    a = grpo_advantages(r, group_size=3, eps=0.0)
    b = grpo_advantages(r * scale + shift, group_size=3, eps=0.0)
    finite = np.isfinite(np.asarray(a))
    np.testing.assert_allclose(np.asarray(b)[finite], np.asarray(a)[finite], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        np.asarray(a).reshape(2, 3)[np.isfinite(np.asarray(a)).reshape(2, 3).all(1)].sum(1),
        0.0,
        atol=1e-5,
    )


def test_kept_group_advantages_hand_computed():
    """The group statistics over the kept samples only; a dropped sample gets 0."""
    r = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    kept = jnp.array([True, True, False, False, True, False, True, False])
    # Group 1 keeps [1, 0]: mean 0.5, unbiased std sqrt(0.5). Group 2 keeps [1, 1]: all equal.
    want = np.array([0.5, -0.5, 0, 0, 0, 0, 0, 0]) / (math.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(kept_group_advantages(r, kept, group_size=4), want, rtol=1e-6)
    np.testing.assert_allclose(
        kept_group_advantages(r, kept, group_size=4, estimator="dr_grpo"),
        [0.5, -0.5, 0, 0, 0, 0, 0, 0],
    )
    # RLOO: each kept sample's baseline is the mean of its kept siblings (one here).
    r3 = jnp.array([3.0, 1.0, 2.0, 5.0, 0.0, 0.0])
    k3 = jnp.array([True, True, True, True, False, False])
    np.testing.assert_allclose(
        kept_group_advantages(r3, k3, group_size=3, estimator="rloo"),
        [3.0 - 1.5, 1.0 - 2.5, 2.0 - 2.0, 0, 0, 0],
    )
    # One kept sample has no sibling: 0, whatever its reward.
    one = jnp.array([True, False, False, False, False, False])
    np.testing.assert_array_equal(kept_group_advantages(r3, one, group_size=3), 0.0)
    with pytest.raises(ValueError, match="reinforce_pp"):
        kept_group_advantages(r, kept, group_size=4, estimator="reinforce_pp")
    with pytest.raises(ValueError, match="kept"):
        kept_group_advantages(r, kept[:4], group_size=4)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=8, max_size=8),
    st.lists(st.booleans(), min_size=8, max_size=8),
    st.sampled_from(["grpo", "dr_grpo", "dapo", "rloo"]),
)
def test_kept_group_advantages_match_the_estimator_on_the_kept_rows(ints, kept, estimator):
    """Every kept row equals the estimator run on its group's kept rows alone; all kept: the
    estimator itself, bit for bit."""
    r, k = jnp.array(ints, jnp.float32), np.array(kept)
    got = np.asarray(kept_group_advantages(r, jnp.array(k), group_size=4, estimator=estimator))
    for g in range(2):
        rows = np.flatnonzero(k[4 * g : 4 * g + 4]) + 4 * g
        want = np.zeros(len(rows))
        if len(rows) >= 2:
            want = compute_advantages(r[rows], group_size=len(rows), estimator=estimator)
        np.testing.assert_allclose(got[rows], want, rtol=1e-5, atol=1e-6)
    assert not got[~k].any()
    np.testing.assert_array_equal(
        kept_group_advantages(r, jnp.ones(8, bool), group_size=4, estimator=estimator),
        compute_advantages(r, group_size=4, estimator=estimator),
    )


# Ratios 0.5, 0.9, 1.1, 1.5 against pi_old = 0.5, clip-higher (0.2, 0.28).
RATIOS = jnp.array([[0.5, 0.9, 1.1, 1.5]])
OLD = jnp.full((1, 4), math.log(0.5))
NEW = OLD + jnp.log(RATIOS)


def test_ppo_clip_asymmetric_hand_computed():
    pos = ppo_clip_loss(NEW, OLD, jnp.array([1.0]), eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(pos, [[-0.5, -0.9, -1.1, -1.28]], rtol=1e-6)
    neg = ppo_clip_loss(NEW, OLD, jnp.array([-1.0]), eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(neg, [[0.8, 0.9, 1.1, 1.5]], rtol=1e-6)
    dual = ppo_clip_loss(NEW, OLD, jnp.array([-1.0]), eps_low=0.2, eps_high=0.28, dual_clip=1.4)
    np.testing.assert_allclose(dual, [[0.8, 0.9, 1.1, 1.4]], rtol=1e-6)
    per_token_adv = jnp.array([[2.0, 2.0, -1.0, -1.0]])
    np.testing.assert_allclose(
        ppo_clip_loss(NEW, OLD, per_token_adv, eps_low=0.2, eps_high=0.28),
        [[-1.0, -1.8, 1.1, 1.5]],
        rtol=1e-6,
    )
    np.testing.assert_array_equal(
        ppo_clip_fraction(NEW, OLD, jnp.array([1.0]), eps_low=0.2, eps_high=0.28), [[0, 0, 0, 1]]
    )
    np.testing.assert_array_equal(
        ppo_clip_fraction(NEW, OLD, jnp.array([-1.0]), eps_low=0.2, eps_high=0.28), [[1, 0, 0, 0]]
    )


def test_ppo_clip_gradient_vanishes_only_on_clipped_side():
    grad = jax.grad(lambda lp: jnp.sum(ppo_clip_loss(lp, OLD, jnp.array([1.0]), eps_high=0.28)))
    # d(-r)/dlogp = -r where unclipped; 0 past 1 + eps_high.
    np.testing.assert_allclose(grad(NEW), [[-0.5, -0.9, -1.1, 0.0]], rtol=1e-6)


LOSS = jnp.array([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
MASK = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)


def test_aggregations_hand_computed():
    assert float(aggregate_loss(LOSS, MASK, mode="token_mean")) == pytest.approx(2.5)
    # (mean(1,2,3) + 4 + 0 for the empty row) / 3
    assert float(aggregate_loss(LOSS, MASK, mode="seq_mean_token_mean")) == pytest.approx(2.0)
    assert float(
        aggregate_loss(LOSS, MASK, mode="seq_mean_token_sum_norm", max_len=4)
    ) == pytest.approx((6 / 4 + 4 / 4) / 3)
    assert float(
        aggregate_loss(LOSS, MASK, mode="seq_mean_token_sum_norm", max_len=8)
    ) == pytest.approx((6 / 8 + 4 / 8) / 3)
    empty = jnp.zeros_like(MASK)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert float(aggregate_loss(LOSS, empty, mode=mode)) == 0.0
    with pytest.raises(ValueError, match="'sum'"):
        aggregate_loss(LOSS, MASK, mode="sum")


def test_aggregation_weights_split_over_micro_batches():
    # Summing micro-batch terms with the full batch's denominator gives the full-batch loss.
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        w, z = aggregation_weights(MASK, mode=mode)
        parts = sum(float(jnp.sum(w[i : i + 1] * LOSS[i : i + 1]) / z) for i in range(3))
        assert parts == pytest.approx(float(aggregate_loss(LOSS, MASK, mode=mode)), rel=1e-6)


def test_kl_estimators_hand_computed():
    lp, ref = jnp.log(jnp.array([[0.5, 0.25]])), jnp.log(jnp.array([[0.25, 0.5]]))
    ln2 = math.log(2.0)
    np.testing.assert_allclose(kl_penalty(lp, ref, estimator="k1"), [[ln2, -ln2]], rtol=1e-6)
    np.testing.assert_allclose(
        kl_penalty(lp, ref, estimator="k2"), [[ln2**2 / 2, ln2**2 / 2]], rtol=1e-6
    )
    np.testing.assert_allclose(
        kl_penalty(lp, ref, estimator="k3"), [[0.5 - 1 + ln2, 2 - 1 - ln2]], rtol=1e-6
    )
    far = kl_penalty(jnp.array([[-15.0]]), jnp.array([[0.0]]), estimator="k3")
    np.testing.assert_allclose(far, [[10.0]])  # exp(15) - 16, clamped as low_var_kl does
    unclamped = kl_penalty(jnp.array([[-3.0]]), jnp.array([[0.0]]), estimator="k3", k3_clamp=None)
    np.testing.assert_allclose(unclamped, [[math.exp(3) - 4]], rtol=1e-6)


def test_entropy_and_logprobs_hand_computed():
    logits = jnp.array([[[0.0, math.log(3.0)]]])
    want_h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    np.testing.assert_allclose(entropy_from_logits(logits), [[want_h]], rtol=1e-6)
    np.testing.assert_allclose(
        entropy_from_logits(2 * logits, temperature=2.0), [[want_h]], rtol=1e-6
    )
    np.testing.assert_allclose(
        entropy_from_logits(jnp.zeros((1, 1, 5))), [[math.log(5)]], rtol=1e-6
    )
    np.testing.assert_allclose(
        token_logprobs(logits, jnp.array([[1]])), [[math.log(0.75)]], rtol=1e-6
    )


def test_shifted_logprobs_align_with_tokens():
    logits = jax.random.normal(jax.random.key(0), (2, 4, 7))
    tokens = jnp.array([[1, 2, 3, 4], [6, 5, 0, 1]])
    got = np.asarray(shifted_token_logprobs(logits, tokens, temperature=0.7))
    lsm = np.asarray(jax.nn.log_softmax(logits / 0.7, axis=-1))
    assert np.all(got[:, 0] == 0)
    for b in range(2):
        for t in range(1, 4):
            np.testing.assert_allclose(got[b, t], lsm[b, t - 1, tokens[b, t]], rtol=1e-6)
