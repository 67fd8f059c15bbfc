"""Synthetic arithmetic with a scratchpad: `23+58=` -> column-by-column working, then `answer: 81`.

The scratchpad makes completions long (a line per column, per partial product, per long-division
step), which is what makes KV compression matter during rollouts. Every character is in
`CharTokenizer.DEFAULT_ALPHABET` (digits, `+-*/=<`, comma, colon, space, newline, letters).

Ideal completions (after the prompt `a op b=`), one working line per step:

    23+58=                        345-78=                        23*45=
    3+8+0=11, write 1 carry 1     5-8-0=-3, -3+10=7, write 7...  23*5=115
    2+5+1=8, write 8 carry 0      4-7-1=-4, -4+10=6, write 6...  23*40=920
    answer: 81                    3-0-1=2, write 2 borrow 0      115+920=1035
                                  answer: 267                    answer: 1035

`scratchpad: running` (addition only) restates the whole state on every line instead, so each
line depends on the line above alone: the column's digit sum, then the operands' remaining
digits, the carry and the sum so far. `4567+1234=` -> `7+4+0=11, 456+123 c1 s1`,
`6+3+1=10, 45+12 c1 s01`, `5+2+1=8, 4+1 c0 s801`, `4+1+0=5, 0+0 c0 s5801`, `answer: 5801`.
Evicting older lines from the KV cache loses nothing the next token needs (the redundant-trace
regime of R-KV and Sparse-RL), where the column scratchpad's answer line needs a digit from
every line.

`scratchpad: repeat` (multiplication only) computes `a*b` as b additions of a, one line each:
the count so far and the running sum, `7*40=` -> `1: 7`, `2: 14`, ..., `40: 280`,
`answer: 280`. Completions are long (b + 1 lines for b in `[min_repeats, max_repeats]`) while
what the next line needs is small: the prompt (a, and b to know when to stop) and the line
above, so a KV budget of a few lines holds the whole working set.

`tags: n` (with `repeat`) writes n letters in place of each line's `: `, `7*40=` -> `1wz7`,
`2yx14`, ...: letter i of line k copies letter i of line k - 10 (the last line whose count ends in
the same digit, about 80 tokens back) with probability `tag_copy`, else it is drawn uniformly
from `wxyz` (the first ten lines draw all theirs). The answer never needs them; they are tokens
whose distribution depends on context far behind the working set, which a KV budget can evict:
the per-token entropy of free choices (what a language model's reasoning has and a pure
computation lacks) for the sparse-vs-dense mismatch to show in.

Subtraction with `a < b` first writes `a<b, so compute b-a and negate`. Division is exact (the
dividend is drawn as divisor * quotient) and runs long division: `cur/b=q rem r` per dividend digit.

Reward (`arithmetic_reward`): the last line `answer: <int>` of the completion is read; 1.0 when it
equals the exact result, `format_reward` when the line is present and an integer but wrong, 0.0
otherwise (no answer line, or a non-integer in it).
"""

from __future__ import annotations

import re

import numpy as np

from sparserl_jax.data.config import ArithmeticConfig
from sparserl_jax.data.extract import last_answer_line
from sparserl_jax.data.records import Example

_INT_RE = re.compile(r"^-?\d+$")
_SPLIT_IDS = {"train": 0, "eval": 1}


def split_id(split: str) -> int:
    if split not in _SPLIT_IDS:
        raise ValueError(f"split {split!r} unknown; expected one of {tuple(_SPLIT_IDS)}")
    return _SPLIT_IDS[split]


def _draw(rng: np.random.Generator, digits: int, *, positive: bool = False) -> int:
    low = 10 ** (digits - 1) if digits > 1 else (1 if positive else 0)
    return int(rng.integers(low, 10**digits))


def _digits_lsb(n: int, width: int) -> list[int]:
    return [(n // 10**i) % 10 for i in range(width)]


def _add_lines(a: int, b: int) -> list[str]:
    width = max(len(str(a)), len(str(b)))
    lines, carry = [], 0
    for da, db in zip(_digits_lsb(a, width), _digits_lsb(b, width), strict=True):
        s = da + db + carry
        lines.append(f"{da}+{db}+{carry}={s}, write {s % 10} carry {s // 10}")
        carry = s // 10
    if carry:
        lines.append(f"write {carry}")
    return lines


def _sub_lines(a: int, b: int) -> list[str]:
    if a < b:
        return [f"{a}<{b}, so compute {b}-{a} and negate", *_sub_lines(b, a)]
    width = len(str(a))
    lines, borrow = [], 0
    for da, db in zip(_digits_lsb(a, width), _digits_lsb(b, width), strict=True):
        x = da - db - borrow
        if x < 0:
            lines.append(f"{da}-{db}-{borrow}={x}, {x}+10={x + 10}, write {x + 10} borrow 1")
            borrow = 1
        else:
            lines.append(f"{da}-{db}-{borrow}={x}, write {x} borrow 0")
            borrow = 0
    return lines


def _mul_lines(a: int, b: int) -> list[str]:
    lines, partials = [], []
    for k, d in enumerate(_digits_lsb(b, len(str(b)))):
        p = a * d * 10**k
        lines.append(f"{a}*{d}{'0' * k}={p}")
        partials.append(p)
    total = partials[0]
    for p in partials[1:]:
        lines.append(f"{total}+{p}={total + p}")
        total += p
    return lines


def _div_lines(a: int, b: int) -> list[str]:
    lines, rem = [], 0
    for ch in str(a):
        cur = rem * 10 + int(ch)
        q, rem = divmod(cur, b)
        lines.append(f"{cur}/{b}={q} rem {rem}")
    return lines


def _running_add_lines(a: int, b: int) -> list[str]:
    lines, carry, total = [], 0, ""
    while True:
        t = a % 10 + b % 10 + carry
        head = f"{a % 10}+{b % 10}+{carry}={t}"
        a, b, carry, total = a // 10, b // 10, t // 10, f"{t % 10}{total}"
        lines.append(f"{head}, {a}+{b} c{carry} s{total}")
        if a == b == carry == 0:
            return lines


TAG_LETTERS, TAG_LAG = "wxyz", 10


def _repeat_lines(a: int, b: int, tags: int, tag_copy: float, rng) -> list[str]:
    if not tags:
        return [f"{k}: {a * k}" for k in range(1, b + 1)]
    drawn: list[str] = []
    for k in range(b):
        fresh = rng.integers(len(TAG_LETTERS), size=tags)
        copy = rng.random(tags) < tag_copy if k >= TAG_LAG else np.zeros(tags, bool)
        above = drawn[k - TAG_LAG] if k >= TAG_LAG else ""
        drawn.append(
            "".join(above[i] if copy[i] else TAG_LETTERS[int(fresh[i])] for i in range(tags))
        )
    return [f"{k}{tag}{a * k}" for k, tag in enumerate(drawn, start=1)]


def solve(
    a: int,
    op: str,
    b: int,
    *,
    scratchpad: str = "columns",
    tags: int = 0,
    tag_copy: float = 0.0,
    rng: np.random.Generator | None = None,
) -> tuple[int, str]:
    """The exact result of `a op b` and its ideal completion (scratchpad + answer line).

    Division must be exact (`a % b == 0`); operands are non-negative integers. `scratchpad`:
    `columns` (every operator), `running` (`+` only) or `repeat` (`*` only, b >= 1); the
    module docstring shows them. `tags` > 0 (`repeat` only) draws the lines' tag letters
    from `rng`.
    """
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a}, {b}")
    if tags and scratchpad != "repeat":
        raise ValueError(f"tags are for the repeat scratchpad, got scratchpad={scratchpad!r}")
    if tags and rng is None:
        raise ValueError("tags are drawn at random: pass rng (a numpy Generator)")
    if scratchpad == "running":
        if op != "+":
            raise ValueError(f"the running scratchpad is for '+' only, got {op!r}")
        result, lines = a + b, _running_add_lines(a, b)
    elif scratchpad == "repeat":
        if op != "*" or b < 1:
            raise ValueError(f"the repeat scratchpad is for a*b with b >= 1, got {a}{op}{b}")
        result, lines = a * b, _repeat_lines(a, b, tags, tag_copy, rng)
    elif scratchpad != "columns":
        raise ValueError(f"scratchpad {scratchpad!r} unknown; expected columns, running or repeat")
    elif op == "+":
        result, lines = a + b, _add_lines(a, b)
    elif op == "-":
        result, lines = a - b, _sub_lines(a, b)
    elif op == "*":
        result, lines = a * b, _mul_lines(a, b)
    elif op == "/":
        if b == 0 or a % b:
            raise ValueError(f"division must be exact and by a non-zero divisor, got {a}/{b}")
        result, lines = a // b, _div_lines(a, b)
    else:
        raise ValueError(f"operator {op!r} unknown; expected one of + - * /")
    return result, "\n" + "\n".join([*lines, f"answer: {result}"])


def longest_arithmetic_prompt(cfg: ArithmeticConfig) -> int:
    """An upper bound on the characters of any prompt `a<op>b=` of `cfg`: `b` has at most
    `max_digits` digits, `a` too except for `/`, where `a = b * q` has up to twice as many."""
    a_digits = cfg.max_digits * (2 if "/" in cfg.operators else 1)
    b_digits = len(str(cfg.max_repeats)) if cfg.scratchpad == "repeat" else cfg.max_digits
    return a_digits + 1 + b_digits + 1


def make_arithmetic_example(cfg: ArithmeticConfig, *, seed: int, split: str, index: int) -> Example:
    """Problem `index` of `split`: a pure function of `(seed, split, index)`."""
    rng = np.random.default_rng([seed, split_id(split), index])
    op = cfg.operators[int(rng.integers(len(cfg.operators)))]
    n_a = int(rng.integers(cfg.min_digits, cfg.max_digits + 1))
    n_b = int(rng.integers(cfg.min_digits, cfg.max_digits + 1))
    if cfg.scratchpad == "repeat":
        a = _draw(rng, n_a, positive=True)
        b = int(rng.integers(cfg.min_repeats, cfg.max_repeats + 1))
    elif op == "/":
        b = _draw(rng, n_b, positive=True)
        a = b * _draw(rng, n_a)
    else:
        a, b = _draw(rng, n_a), _draw(rng, n_b)
    result, completion = solve(
        a, op, b, scratchpad=cfg.scratchpad, tags=cfg.tags, tag_copy=cfg.tag_copy, rng=rng
    )
    return Example(
        prompt=f"{a}{op}{b}=",
        answer=str(result),
        task="arithmetic",
        source=f"arithmetic/{split}#{index}",
        index=index,
        completion=completion,
    )


def arithmetic_reward(completion: str, answer: str, *, format_reward: float = 0.0) -> float:
    """1.0 if the last `answer: <int>` line equals `answer`, `format_reward` if such a line holds
    a different integer, else 0.0."""
    content = last_answer_line(completion)
    if content is None or not _INT_RE.match(content):
        return 0.0
    if len(content) > 64:  # int() refuses > 4300 digits; no answer here is that long anyway
        return format_reward
    return 1.0 if int(content) == int(answer) else format_reward
