"""Data configuration: which task, where its rows come from, how they are batched and rewarded.

Self-contained (no imports from the rest of the package) so `sparserl_jax/config.py` can nest
`DataConfig` as its `data:` section. Every class is a frozen keyword-only dataclass that
validates itself in `__post_init__`; errors name the field, the bad value and what is allowed.
"""

import dataclasses
import math
from typing import Literal

Task = Literal["arithmetic", "countdown", "gsm8k"]
TASKS: tuple[str, ...] = ("arithmetic", "countdown", "gsm8k")
FileFormat = Literal["auto", "jsonl", "parquet"]
FILE_FORMATS: tuple[str, ...] = ("auto", "jsonl", "parquet")
OPERATORS: tuple[str, ...] = ("+", "-", "*", "/")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """Synthetic `a op b=` problems whose ideal completion is a column-by-column scratchpad.

    Attributes:
      min_digits, max_digits: each operand has a digit count drawn uniformly from this range
        (for `/` the divisor and the quotient do, so the dividend is exact and about twice as long).
      operators: drawn uniformly per problem, a subset of `+ - * /`.
      scratchpad: `columns` (a line per column), `running` (`+` only: every line restates
        the remaining operands, the carry and the sum so far) or `repeat` (`*` only: `a*b` as
        b additions of a, one short line per addition; see `data/arithmetic.py`).
      min_repeats, max_repeats: with `repeat`, the multiplier b is drawn from this range (so the
        completion has b + 1 lines); a has min..max_digits digits as usual.
      tags, tag_copy: with `repeat`, `tags` letters in place of each line's `: `, each a copy
        of its counterpart ten lines above with probability `tag_copy`, else uniform over
        `wxyz` (0: none); tokens the answer never needs, whose distribution depends on
        context far back (see `data/arithmetic.py`).
      num_examples: size of one epoch of distinct problem indices (problems are a pure function of
        `(seed, split, index)`, so this costs no memory).
    """

    min_digits: int = 1
    max_digits: int = 3
    operators: tuple[str, ...] = ("+", "-")
    scratchpad: Literal["columns", "running", "repeat"] = "columns"
    min_repeats: int = 40
    max_repeats: int = 70
    tags: int = 0
    tag_copy: float = 0.75
    num_examples: int = 100_000

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits <= 18:
            raise ValueError(
                "arithmetic digits need 1 <= min_digits <= max_digits <= 18, got "
                f"min_digits={self.min_digits}, max_digits={self.max_digits}"
            )
        if not self.operators:
            raise ValueError(f"arithmetic.operators is empty; choose from {OPERATORS}")
        for op in self.operators:
            if op not in OPERATORS:
                raise ValueError(f"arithmetic operator {op!r} unknown; expected one of {OPERATORS}")
        if len(set(self.operators)) != len(self.operators):
            raise ValueError(f"arithmetic.operators has repeats: {self.operators}")
        if self.num_examples < 1:
            raise ValueError(f"arithmetic.num_examples must be >= 1, got {self.num_examples}")
        if self.scratchpad not in ("columns", "running", "repeat"):
            raise ValueError(
                f"arithmetic.scratchpad {self.scratchpad!r} unknown; expected columns, running "
                "or repeat"
            )
        if self.scratchpad == "repeat" and self.operators != ("*",):
            raise ValueError(
                f"arithmetic.scratchpad=repeat is for '*' only, got operators={self.operators}"
            )
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise ValueError(
                "arithmetic repeats need 1 <= min_repeats <= max_repeats, got "
                f"min_repeats={self.min_repeats}, max_repeats={self.max_repeats}"
            )
        if self.tags < 0 or (self.tags and self.scratchpad != "repeat"):
            raise ValueError(
                f"arithmetic.tags must be >= 0 and is for scratchpad=repeat only, got "
                f"tags={self.tags} with scratchpad={self.scratchpad}"
            )
        if not 0.0 <= self.tag_copy <= 1.0:
            raise ValueError(f"arithmetic.tag_copy must be in [0, 1], got {self.tag_copy}")
        if self.scratchpad == "running" and self.operators != ("+",):
            raise ValueError(
                f"arithmetic.scratchpad=running is for '+' only, got operators={self.operators}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownConfig:
    """Countdown: reach `target` with `+ - * /` and parentheses, each given number at most once.

    Targets are built from a random expression over a random subset of the numbers, so every
    problem has a solution (kept as the SFT reference completion).

    Attributes:
      min_numbers, max_numbers: how many numbers a problem offers.
      max_number: numbers are drawn from `[1, max_number]`.
      max_target: a target outside `[1, max_target]` (or non-integer) is redrawn; must be
        >= max_number.
      num_examples: size of one epoch of distinct problem indices.
    """

    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 50
    max_target: int = 1000
    num_examples: int = 100_000

    def __post_init__(self):
        if not 2 <= self.min_numbers <= self.max_numbers <= 8:
            raise ValueError(
                "countdown needs 2 <= min_numbers <= max_numbers <= 8, got "
                f"min_numbers={self.min_numbers}, max_numbers={self.max_numbers}"
            )
        if self.max_number < 2:
            raise ValueError(f"countdown.max_number must be >= 2, got {self.max_number}")
        if self.max_target < self.max_number:
            # A problem with no reachable target falls back to its smallest number as the target.
            raise ValueError(
                f"countdown.max_target ({self.max_target}) must be >= max_number "
                f"({self.max_number})"
            )
        if self.num_examples < 1:
            raise ValueError(f"countdown.num_examples must be >= 1, got {self.num_examples}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts for RL (and pairs for an SFT warm start).

    Attributes:
      task: `arithmetic` and `countdown` are generated; `gsm8k` reads question/answer rows from
        `path` (JSONL or Parquet; any file with a question and a numeric answer fits).
      batch_size: prompts per batch (the rollout repeats each one for its GRPO group).
      seed: drives generation and shuffling; the same seed gives the same batches.
      shuffle: reshuffle the order of rows (every epoch differently).
      num_epochs: passes over the rows; None repeats forever.
      drop_remainder: drop the last incomplete batch of a finite run.
      path, eval_path: data files for `gsm8k` (a file or a glob such as `data/train-*.parquet`).
      file_format: `auto` picks by extension (`.jsonl`/`.json` or `.parquet`).
      question_field, answer_field: column names; the answer is `#### 42`-style text or a number.
      prompt_template: the prompt text; `{question}` is replaced by the question.
      strict: a malformed row (bad JSON, missing field, non-numeric answer) raises an error
        naming file and line instead of being counted and skipped.
      long_prompts: a prompt longer than `rollout.max_prompt_len` tokens, found when the data is
        read at start-up: `skip` counts it, logs one line naming the first ones (file and line)
        and leaves it out of every batch and of the held-out set; `error` refuses the data then,
        naming the first one.
      reward_fn: `package.module:function` replacing the task's reward; called as
        `fn(prompt: str, completion: str, answer: str) -> float`.
      format_reward: reward of a well-formed but wrong answer (correct answers score 1.0).
      num_threads: grain read threads (results do not depend on it).
    """

    task: Task = "arithmetic"
    batch_size: int = 8
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    drop_remainder: bool = True
    path: str | None = None
    eval_path: str | None = None
    file_format: FileFormat = "auto"
    question_field: str = "question"
    answer_field: str = "answer"
    prompt_template: str = "{question}"
    strict: bool = False
    long_prompts: Literal["skip", "error"] = "skip"
    reward_fn: str | None = None
    format_reward: float = 0.0
    num_threads: int = 1
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    countdown: CountdownConfig = CountdownConfig()

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"data.task {self.task!r} unknown; expected one of {TASKS}")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(
                f"data.num_epochs must be >= 1 or null (forever), got {self.num_epochs}"
            )
        if self.long_prompts not in ("skip", "error"):
            raise ValueError(
                f"data.long_prompts {self.long_prompts!r} unknown; expected 'skip' or 'error'"
            )
        if self.file_format not in FILE_FORMATS:
            raise ValueError(
                f"data.file_format {self.file_format!r} unknown; expected one of {FILE_FORMATS}"
            )
        if self.task == "gsm8k" and not self.path:
            raise ValueError("data.task 'gsm8k' reads files: set data.path (a file or a glob)")
        if not self.question_field or not self.answer_field:
            raise ValueError(
                "data.question_field and data.answer_field must be non-empty, got "
                f"{self.question_field!r}, {self.answer_field!r}"
            )
        if "{question}" not in self.prompt_template:
            raise ValueError(
                f"data.prompt_template must contain '{{question}}', got {self.prompt_template!r}"
            )
        try:
            self.prompt_template.format(question="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"data.prompt_template {self.prompt_template!r} is not a valid template with the "
                f"single field {{question}} (literal braces are written {{{{ }}}}): {e!r}"
            ) from None
        if self.reward_fn is not None:
            module, sep, name = self.reward_fn.partition(":")
            if not sep or not module or not name:
                raise ValueError(
                    "data.reward_fn must look like 'package.module:function', got "
                    f"{self.reward_fn!r}"
                )
        if not (math.isfinite(self.format_reward) and 0.0 <= self.format_reward < 1.0):
            raise ValueError(f"data.format_reward must be in [0, 1), got {self.format_reward}")
        if self.num_threads < 0:
            raise ValueError(f"data.num_threads must be >= 0, got {self.num_threads}")
