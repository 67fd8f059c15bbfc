"""DataConfig validation: each bad value is refused with a message naming it."""

import dataclasses
import typing

import pytest

from sparserl_jax.data import ArithmeticConfig, CountdownConfig, DataConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": "poetry"}, "data.task 'poetry' unknown; expected one of"),
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"num_epochs": 0}, "num_epochs must be >= 1 or null"),
        ({"file_format": "csv"}, "file_format 'csv' unknown"),
        ({"task": "gsm8k"}, "set data.path"),
        ({"question_field": ""}, "must be non-empty"),
        ({"prompt_template": "Q:"}, "must contain '{question}'"),
        ({"prompt_template": "{question} {other}"}, "not a valid template"),
        ({"reward_fn": "mod.func"}, "must look like 'package.module:function', got 'mod.func'"),
        ({"format_reward": 1.0}, "format_reward must be in \\[0, 1\\), got 1.0"),
        ({"format_reward": float("nan")}, "format_reward must be in"),
        ({"num_threads": -1}, "num_threads must be >= 0"),
    ],
)
def test_data_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (ArithmeticConfig, {"min_digits": 3, "max_digits": 2}, "min_digits=3, max_digits=2"),
        (ArithmeticConfig, {"min_digits": 0}, "min_digits=0"),
        (ArithmeticConfig, {"operators": ("+", "%")}, "operator '%' unknown"),
        (ArithmeticConfig, {"operators": ()}, "operators is empty"),
        (ArithmeticConfig, {"operators": ("+", "+")}, "repeats"),
        (ArithmeticConfig, {"num_examples": 0}, "num_examples must be >= 1"),
        (CountdownConfig, {"min_numbers": 5, "max_numbers": 4}, "min_numbers=5, max_numbers=4"),
        (CountdownConfig, {"max_number": 1}, "max_number must be >= 2"),
        (CountdownConfig, {"max_target": 10}, "max_target \\(10\\) must be >= max_number \\(50\\)"),
    ],
)
def test_task_configs_reject(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_frozen_and_keyword_only():
    cfg = DataConfig(task="countdown", prompt_template="Q: {question}\nA:")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 3
    with pytest.raises(TypeError):
        DataConfig("arithmetic")
    assert dataclasses.replace(cfg, batch_size=3).batch_size == 3
    assert (
        DataConfig(prompt_template="{{literal}} {question}").prompt_template.format(question="x")
        == "{literal} x"
    )


def test_type_hints_resolve_without_this_module_namespace():
    # The top-level config resolves field types in its own namespace: annotations must be real
    # objects, not strings (no `from __future__ import annotations` in data/config.py).
    for cls in (DataConfig, ArithmeticConfig, CountdownConfig):
        hints = typing.get_type_hints(cls, globalns={})
        assert set(hints) == {f.name for f in dataclasses.fields(cls)}
