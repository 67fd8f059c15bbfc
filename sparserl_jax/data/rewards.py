"""Verifiable rewards: the built-in ones per task, a user function by import path, batch scoring.

A reward function here is `reward(example, completion) -> float`; `make_reward_fn(cfg)` returns
the task's own (arithmetic, countdown, GSM8K numeric match) or, when `cfg.reward_fn` is set, the
user's function, which is called as `fn(prompt, completion, answer) -> float` (all strings) and
must return a finite real number.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from jaxtyping import Float

from sparserl_jax.data.arithmetic import arithmetic_reward
from sparserl_jax.data.config import DataConfig
from sparserl_jax.data.countdown import countdown_reward
from sparserl_jax.data.extract import extract_predicted_number, parse_canonical
from sparserl_jax.data.records import DataError, Example, PromptBatch

RewardFn = Callable[[Example, str], float]


class RewardError(RuntimeError):
    """A reward function raised while scoring a batch; the original is its `__cause__`."""


def gsm8k_reward(completion: str, answer: str, *, format_reward: float = 0.0) -> float:
    """1.0 when the number extracted from `completion` (`extract.extract_predicted_number`)
    equals the gold `answer` exactly; `format_reward` when a number was found but differs; else 0.
    """
    gold = parse_canonical(answer)
    if gold is None:
        raise DataError(f"gold answer {answer!r} is not a number")
    predicted = extract_predicted_number(completion)
    if predicted is None:
        return 0.0
    return 1.0 if predicted == gold else format_reward


def task_reward(example: Example, completion: str, *, format_reward: float = 0.0) -> float:
    """The built-in reward of `example.task`."""
    if example.task == "arithmetic":
        return arithmetic_reward(completion, example.answer, format_reward=format_reward)
    if example.task == "countdown":
        return countdown_reward(
            completion, example.numbers, int(example.answer), format_reward=format_reward
        )
    if example.task == "gsm8k":
        return gsm8k_reward(completion, example.answer, format_reward=format_reward)
    raise ValueError(
        f"no built-in reward for task {example.task!r}; expected arithmetic, countdown or gsm8k"
    )


def load_reward_fn(spec: str) -> Callable[..., object]:
    """Import `package.module:function` (the name may be dotted: `module:Class.method`).

    Raises `DataError` naming the spec when the module cannot be imported, the attribute does not
    exist, it is not callable, or its signature cannot take `(prompt, completion, answer)`.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DataError(f"reward_fn must look like 'package.module:function', got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise DataError(
            f"reward_fn {spec!r}: cannot import module {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise DataError(
                f"reward_fn {spec!r}: {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise DataError(f"reward_fn {spec!r} is a {type(obj).__name__}, not a callable")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj  # a builtin without a signature: nothing to check
    try:
        signature.bind("prompt", "completion", "answer")
    except TypeError as e:
        raise DataError(
            f"reward_fn {spec!r} cannot be called as fn(prompt, completion, answer): {e}"
        ) from None
    return obj


def _user_reward(fn: Callable[..., object], spec: str, example: Example, completion: str) -> float:
    value = fn(example.prompt, completion, example.answer)
    try:
        reward = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        reward = math.nan
    if isinstance(value, bool) or not math.isfinite(reward):
        raise DataError(
            f"reward_fn {spec!r} returned {value!r} for {example.source}; expected a finite float"
        )
    return reward


def make_reward_fn(cfg: DataConfig) -> RewardFn:
    """`reward(example, completion) -> float` for this config (the user's function if set)."""
    if cfg.reward_fn is not None:
        fn = load_reward_fn(cfg.reward_fn)
        return functools.partial(_user_reward, fn, cfg.reward_fn)
    return functools.partial(task_reward, format_reward=cfg.format_reward)


def try_reward_fn(cfg: DataConfig, batches: Iterable[PromptBatch]) -> None:
    """Call the user's `data.reward_fn` once on a real example (the first of `batches`), with
    its demonstration, or else its answer, as the completion: before the model is built, a
    function that fails on the data is a `DataError` naming it, the example and the error.
    Nothing is done without `data.reward_fn` (the built-in rewards are the library's own)."""
    if cfg.reward_fn is None:
        return
    example = next(iter(batches)).examples[0]
    completion = example.completion or example.answer
    reward = make_reward_fn(cfg)
    try:
        reward(example, completion)
    except DataError:
        raise  # a return value that is no finite float, named by `_user_reward`
    except Exception as e:
        error = " ".join(f"{type(e).__name__}: {e}".split())
        raise DataError(
            f"data.reward_fn {cfg.reward_fn!r} failed on example {example.source} (prompt "
            f"{example.prompt[:40]!r}, completion {completion[:40]!r}): {error}"
        ) from e


def compute_rewards(
    reward_fn: RewardFn,
    examples: Sequence[Example],
    completions: Sequence[str],
    *,
    group_size: int = 1,
    step: int | None = None,
) -> Float[np.ndarray, " BG"]:
    """Rewards of `B * G` completions, prompt-major: completion `j` answers `examples[j // G]`.

    This is the order of a rollout that repeats each prompt `G` times in a row (GRPO groups).
    An exception from `reward_fn` is re-raised as a `RewardError` naming the step (when given),
    the example's index and source and the prompt's first characters, chained to the original.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if len(completions) != len(examples) * group_size:
        raise ValueError(
            f"{len(completions)} completions for {len(examples)} examples x group_size "
            f"{group_size}; expected {len(examples) * group_size}"
        )
    out = np.empty(len(completions), np.float32)
    for j, completion in enumerate(completions):
        example = examples[j // group_size]
        try:
            out[j] = reward_fn(example, completion)
        except Exception as e:
            where = "" if step is None else f"step {step}, "
            raise RewardError(
                f"reward function failed ({where}example {j // group_size} of the batch, "
                f"completion {j}, {example.source}, prompt {example.prompt[:40]!r}): "
                f"{type(e).__name__}: {e}"
            ) from e
    return out
