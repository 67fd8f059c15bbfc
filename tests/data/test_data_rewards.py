"""Reward dispatch, a user reward by import path, and batch scoring in GRPO-group order."""

import textwrap

import numpy as np
import pytest

from sparserl_jax.data import (
    DataConfig,
    DataError,
    Example,
    compute_rewards,
    load_reward_fn,
    make_reward_fn,
    task_reward,
)

ARITH = Example(prompt="23+58=", answer="81", task="arithmetic", source="t", index=0)
COUNT = Example(
    prompt="Use 3 7 25 50 to make 75.", answer="75", task="countdown", source="t", index=1,
    numbers=(3, 7, 25, 50),
)  # fmt: skip
GSM = Example(prompt="Q", answer="72", task="gsm8k", source="t", index=2)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            def exact(prompt, completion, answer):
                return 1.0 if completion.strip() == answer else 0.0

            def length_penalty(prompt, completion, answer):
                return -0.5 * len(completion) + len(prompt)

            def returns_text(prompt, completion, answer):
                return "high"

            def returns_nan(prompt, completion, answer):
                return float("nan")

            class Scorer:
                @staticmethod
                def score(prompt, completion, answer):
                    return 2.0

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_mod"


def test_task_reward_dispatch():
    assert task_reward(ARITH, "\nanswer: 81") == 1.0
    assert task_reward(ARITH, "\nanswer: 82", format_reward=0.2) == 0.2
    assert task_reward(COUNT, "\nanswer: 3*25") == 1.0
    assert task_reward(GSM, r"\boxed{72}") == 1.0
    with pytest.raises(ValueError, match="no built-in reward for task 'poetry'"):
        task_reward(Example(prompt="", answer="", task="poetry", source="", index=0), "x")


def test_make_reward_fn_uses_format_reward():
    fn = make_reward_fn(DataConfig(task="arithmetic", format_reward=0.25))
    assert fn(ARITH, "\nanswer: 81") == 1.0
    assert fn(ARITH, "\nanswer: 80") == 0.25
    assert fn(ARITH, "80") == 0.0


def test_user_reward_by_import_path(user_module):
    fn = make_reward_fn(DataConfig(task="arithmetic", reward_fn=f"{user_module}:exact"))
    assert fn(ARITH, " 81 ") == 1.0
    assert fn(ARITH, "\nanswer: 81") == 0.0  # the user's function replaces the built-in one
    fn = make_reward_fn(
        DataConfig(task="gsm8k", path="x", reward_fn=f"{user_module}:length_penalty")
    )
    assert fn(GSM, "abcd") == -0.5 * 4 + 1
    fn = make_reward_fn(DataConfig(reward_fn=f"{user_module}:Scorer.score"))
    assert fn(ARITH, "") == 2.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("my_rewards_mod:missing", "'my_rewards_mod' has no attribute 'missing'"),
        ("my_rewards_mod:NOT_CALLABLE", "is a int, not a callable"),
        ("my_rewards_mod", "must look like 'package.module:function'"),
        ("my_rewards_mod:", "must look like"),
    ],
)
def test_load_reward_fn_errors(user_module, spec, message):
    with pytest.raises(DataError, match=message):
        load_reward_fn(spec)


@pytest.mark.parametrize("name", ["returns_text", "returns_nan"])
def test_user_reward_must_return_a_finite_float(user_module, name):
    fn = make_reward_fn(DataConfig(reward_fn=f"{user_module}:{name}"))
    with pytest.raises(DataError, match=f"{name}.*returned .* for t; expected a finite float"):
        fn(ARITH, "x")


def test_compute_rewards_is_prompt_major():
    examples = [ARITH, COUNT]
    completions = [
        "\nanswer: 81", "\nanswer: 1", "nothing",  # group of ARITH
        "\nanswer: 50+25", "\nanswer: 75", "\nanswer: (",  # group of COUNT
    ]  # fmt: skip
    fn = make_reward_fn(DataConfig(format_reward=0.1))
    r = compute_rewards(fn, examples, completions, group_size=3)
    np.testing.assert_array_equal(r, np.array([1.0, 0.1, 0.0, 1.0, 0.1, 0.0], np.float32))
    assert r.dtype == np.float32
    with pytest.raises(ValueError, match="5 completions for 2 examples x group_size 3"):
        compute_rewards(fn, examples, completions[:5], group_size=3)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        compute_rewards(fn, examples, completions, group_size=0)
