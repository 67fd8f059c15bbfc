"""The jaxtyping shape annotations of the public functions hold on real calls."""

import inspect
import typing

import jax
import jax.numpy as jnp
import jaxtyping
import pytest

from sparserl_jax import rl

B, T, V, D = 3, 5, 7, 4
KEYS = jax.random.split(jax.random.key(0), 4)
LOGP = -jnp.abs(jax.random.normal(KEYS[0], (B, T)))
LOGITS = jax.random.normal(KEYS[1], (B, T, V))
TOKENS = jax.random.randint(KEYS[2], (B, T), 0, V)
MASK = jnp.arange(T)[None, :] >= jnp.array([[1], [2], [5]])
REWARDS = jnp.array([1.0, 0.0, 1.0])

CALLS = [
    (rl.grpo_advantages, (REWARDS,), dict(group_size=3)),
    (rl.dr_grpo_advantages, (REWARDS,), dict(group_size=1)),
    (rl.dapo_overlong_penalty, (jnp.array([1, 4, 9]),), dict(max_len=8, cache_len=2)),
    (rl.dynamic_sampling_mask, (REWARDS,), dict(group_size=3)),
    (rl.token_logprobs, (LOGITS, TOKENS), {}),
    (rl.shifted_token_logprobs, (LOGITS, TOKENS), {}),
    (rl.entropy_from_logits, (LOGITS,), {}),
    (rl.ppo_clip_loss, (LOGP, LOGP - 0.1, REWARDS), {}),
    (rl.ppo_clip_loss, (LOGP, LOGP - 0.1, LOGP), {}),
    (rl.aggregate_loss, (LOGP, MASK), {}),
    (rl.kl_penalty, (LOGP, LOGP - 0.2), {}),
    (rl.masked_mean, (LOGP, MASK), {}),
    (rl.lm_head_grad_energy_gram, (jax.random.normal(KEYS[3], (B, T, D)), LOGITS), {}),
]


def check(fn, args, kwargs):
    hints = typing.get_type_hints(fn)
    with jaxtyping.jaxtyped("context"):
        bound = inspect.signature(fn).bind(*args, **kwargs)
        for name, value in bound.arguments.items():
            if name in hints and isinstance(value, jax.Array):
                assert isinstance(value, hints[name]), f"{fn.__name__}({name}): {value.shape}"
        out = fn(*args, **kwargs)
        assert isinstance(out, hints["return"]), f"{fn.__name__} returned {out}"
        if isinstance(out, tuple) and hasattr(out, "_fields"):
            field_hints = typing.get_type_hints(type(out))
            for name in out._fields:
                value = getattr(out, name)
                if isinstance(value, jax.Array):
                    assert isinstance(value, field_hints[name]), f"{name}: {value.shape}"


@pytest.mark.parametrize(("fn", "args", "kwargs"), CALLS, ids=lambda x: getattr(x, "__name__", ""))
def test_annotations_hold(fn, args, kwargs):
    check(fn, args, kwargs)


def test_correction_annotations_hold():
    check(rl.sparse_rl_weights, (LOGP, LOGP - 0.1, MASK), {})
    out = rl.sparse_rl_weights(LOGP, LOGP - 0.1, MASK)
    hints = typing.get_type_hints(rl.CorrectionMetrics)
    for name in out.metrics._fields:
        assert isinstance(getattr(out.metrics, name), hints[name]), name


def test_mismatched_shapes_are_caught():
    with jaxtyping.jaxtyped("context"):
        hints = typing.get_type_hints(rl.ppo_clip_loss)
        assert isinstance(LOGP, hints["logp_bt"])
        assert not isinstance(LOGP[:, :3], hints["old_logp_bt"])
