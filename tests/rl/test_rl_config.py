"""Learner configs: schedules, weight-decay mask, presets and validation messages."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparserl_jax.config import from_dict
from sparserl_jax.rl import LearnerConfig, LossConfig, OptimizerConfig


@pytest.mark.parametrize(
    ("kw", "points"),
    [
        (dict(schedule="constant"), {0: 1e-3, 100: 1e-3}),
        (dict(schedule="constant", warmup_steps=10), {0: 0.0, 5: 5e-4, 10: 1e-3, 50: 1e-3}),
        (dict(schedule="linear", total_steps=100, end_lr_ratio=0.1), {0: 1e-3, 50: 5.5e-4}),
        (dict(schedule="cosine", warmup_steps=10, total_steps=110), {10: 1e-3, 60: 5e-4}),
    ],
)
def test_schedules_hand_computed(kw, points):
    sched = OptimizerConfig(learning_rate=1e-3, **kw).lr_schedule()
    for step, want in points.items():
        np.testing.assert_allclose(float(sched(step)), want, rtol=1e-5, atol=1e-12)


def test_weight_decay_skips_vectors():
    tx = OptimizerConfig(learning_rate=0.1, weight_decay=0.5).build()
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
    zeros = optax.tree.zeros_like(params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["w"], 1 - 0.1 * 0.5)  # decoupled decay: p - lr * wd * p
    np.testing.assert_array_equal(new["b"], 1.0)


def test_presets():
    assert LossConfig.dapo().eps_high == 0.28 and LossConfig.dapo().aggregation == "token_mean"
    assert LossConfig.dr_grpo().aggregation == "seq_mean_token_sum_norm"
    assert LossConfig.grpo(eps_high=0.3).eps_high == 0.3


def test_validation_names_bad_values():
    with pytest.raises(ValueError, match="'sum'"):
        LossConfig(aggregation="sum")
    with pytest.raises(ValueError, match="'k4'"):
        LossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="'step'"):
        OptimizerConfig(schedule="step")
    with pytest.raises(ValueError, match="warmup_steps < total_steps, got 10, 10"):
        OptimizerConfig(warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1, got 0"):
        LearnerConfig(num_micro_batches=0)


def test_yaml_style_dict_builds_nested_config():
    cfg = from_dict(
        LearnerConfig,
        {
            "loss": {"aggregation": "token_mean", "eps_high": 0.28},
            "correction": {"reject_level": "geometric", "veto": False},
            "gating": {"tau": 0.5, "window": 8},
            "optimizer": {"schedule": "cosine", "learning_rate": "1e-6"},
            "num_micro_batches": 4,
        },
    )
    assert cfg.correction.reject_level == "geometric" and not cfg.correction.veto
    assert cfg.gating.window == 8 and cfg.optimizer.learning_rate == 1e-6
