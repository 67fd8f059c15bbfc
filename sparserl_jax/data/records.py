"""The records the pipelines produce: one `Example` per prompt, a `PromptBatch` per step.

An `Example` carries everything a reward needs (the gold answer, countdown's numbers), so rewards
are pure functions of `(example, completion)` and a batch can be rewarded anywhere.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence


class DataError(ValueError):
    """Bad data: a malformed row in strict mode (the message names file and line), an empty
    data set, or a reward function that cannot be loaded."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example:
    """One prompt and its verification data.

    Attributes:
      prompt: the text the policy continues.
      answer: the gold answer as text (an integer for arithmetic and countdown's target, the
        numeric answer of a GSM8K row as written after `####`).
      task: the task that made it (`arithmetic`, `countdown`, `gsm8k`).
      source: where it comes from: `arithmetic/train#17`, `data/train.jsonl:42`, ...
      index: its position in the underlying data set (before shuffling).
      numbers: countdown's numbers (each usable at most once); empty for other tasks.
      completion: the ideal completion for SFT when the task knows one (scratchpad + answer line).
    """

    prompt: str
    answer: str
    task: str
    source: str
    index: int
    numbers: tuple[int, ...] = ()
    completion: str | None = None


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """`B` examples in pipeline order."""

    examples: tuple[Example, ...]

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def prompts(self) -> list[str]:
        return [e.prompt for e in self.examples]

    @property
    def answers(self) -> list[str]:
        return [e.answer for e in self.examples]

    @property
    def indices(self) -> list[int]:
        return [e.index for e in self.examples]


def make_batch(examples: Sequence[Example]) -> PromptBatch:
    """grain `batch_fn`: a sequence of examples -> `PromptBatch`."""
    return PromptBatch(tuple(examples))


@dataclasses.dataclass
class LoadReport:
    """What loading a data file kept and what it skipped.

    Attributes:
      rows: rows read (blank JSONL lines are not rows).
      kept: rows turned into examples.
      malformed: skipped rows by reason (`bad_json`, `missing_field`, `non_numeric_answer`, ...).
      first_errors: `file:line: reason` of the first few skipped rows, for the log.
    """

    rows: int = 0
    kept: int = 0
    malformed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    first_errors: list[str] = dataclasses.field(default_factory=list)

    MAX_LISTED = 10

    @property
    def num_malformed(self) -> int:
        return sum(self.malformed.values())

    def add_error(self, reason: str, where: str, detail: str) -> None:
        self.malformed[reason] += 1
        if len(self.first_errors) < self.MAX_LISTED:
            self.first_errors.append(f"{where}: {reason}: {detail}")

    def merge(self, other: LoadReport) -> None:
        self.rows += other.rows
        self.kept += other.kept
        self.malformed.update(other.malformed)
        room = self.MAX_LISTED - len(self.first_errors)
        self.first_errors.extend(other.first_errors[: max(room, 0)])

    def summary(self) -> str:
        text = f"{self.kept}/{self.rows} rows kept"
        if self.num_malformed:
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.malformed.items()))
            text += f"; {self.num_malformed} malformed ({reasons}); first: " + "; ".join(
                self.first_errors[:3]
            )
        return text
