"""Countdown: combine the given numbers with `+ - * /` and parentheses to reach a target.

Prompt `Use 3 7 25 50 to make 75.`; the completion ends with a line `answer: <expression>`
(e.g. `answer: (25+50)`; a trailing `=75` is allowed and ignored). The reward is 1.0 when the
expression uses each given number at most once (as a multiset: a number given twice may be used
twice) and evaluates exactly (rational arithmetic) to the target; `format_reward` when it parses but
breaks a rule or misses the target; 0.0 when there is no answer line or it does not parse.

The expression is parsed by a small recursive-descent parser, never `eval()`:

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := INTEGER | '(' expr ')'

No unary minus (countdown has no negative numbers to offer), at most 256 characters and 32 levels
of parentheses; division by zero makes the expression invalid. Numbers are checked against the
offered multiset before anything is evaluated, so huge literals never get multiplied.
"""

from __future__ import annotations

import collections
import re
from fractions import Fraction

import numpy as np

from sparserl_jax.data.arithmetic import split_id
from sparserl_jax.data.config import CountdownConfig
from sparserl_jax.data.extract import last_answer_line
from sparserl_jax.data.records import Example

MAX_EXPRESSION_CHARS = 256
MAX_DEPTH = 32
_TOKEN_RE = re.compile(r"\s*(?:(\d+)|([-+*/()]))")


class ExpressionError(ValueError):
    """An expression that does not parse or cannot be evaluated."""


def tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            raise ExpressionError(f"unexpected character {text[pos]!r} at {pos} in {text!r}")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    return tokens


def parse(text: str) -> tuple:
    """An AST: `('num', int)` or `(op, left, right)`. Raises `ExpressionError`."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = tokenize(text)
    if not tokens:
        raise ExpressionError("empty expression")
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expr(depth: int) -> tuple:
        node = term(depth)
        while peek() in ("+", "-"):
            node = (take(), node, term(depth))
        return node

    def term(depth: int) -> tuple:
        node = factor(depth)
        while peek() in ("*", "/"):
            node = (take(), node, factor(depth))
        return node

    def factor(depth: int) -> tuple:
        tok = peek()
        if tok is None:
            raise ExpressionError(f"expression {text!r} ends early")
        if tok == "(":
            if depth >= MAX_DEPTH:
                raise ExpressionError(f"more than {MAX_DEPTH} nested parentheses")
            take()
            node = expr(depth + 1)
            if peek() != ")":
                raise ExpressionError(f"missing ')' in {text!r}")
            take()
            return node
        if tok.isdigit():
            take()
            return ("num", int(tok))
        raise ExpressionError(f"unexpected {tok!r} in {text!r}")

    node = expr(0)
    if pos != len(tokens):
        raise ExpressionError(f"unexpected {tokens[pos]!r} after a complete expression in {text!r}")
    return node


def literals(node: tuple) -> list[int]:
    if node[0] == "num":
        return [node[1]]
    return literals(node[1]) + literals(node[2])


def evaluate(node: tuple) -> Fraction:
    """Exact value of an AST; raises `ExpressionError` on division by zero."""
    if node[0] == "num":
        return Fraction(node[1])
    left, right = evaluate(node[1]), evaluate(node[2])
    op = node[0]
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    if right == 0:
        raise ExpressionError("division by zero")
    return left / right


def uses_allowed_numbers(used: list[int], numbers: tuple[int, ...]) -> bool:
    """Whether every used literal is offered, counting multiplicity."""
    need, have = collections.Counter(used), collections.Counter(numbers)
    return all(have[n] >= c for n, c in need.items())


def countdown_reward(
    completion: str, numbers: tuple[int, ...], target: int, *, format_reward: float = 0.0
) -> float:
    """1.0 / `format_reward` / 0.0 as described in the module docstring."""
    content = last_answer_line(completion)
    if content is None:
        return 0.0
    expression = content.split("=", 1)[0]
    try:
        node = parse(expression)
    except ExpressionError:
        return 0.0
    if not uses_allowed_numbers(literals(node), numbers):
        return format_reward
    try:
        value = evaluate(node)
    except ExpressionError:
        return format_reward
    return 1.0 if value == target else format_reward


def _random_solution(
    rng: np.random.Generator, numbers: list[int], max_target: int
) -> tuple[int, str] | None:
    """Combine a random subset of `numbers` into a positive integer target <= max_target."""
    k = int(rng.integers(2, len(numbers) + 1))
    pool = [(Fraction(n), str(n)) for n in rng.permutation(numbers)[:k].tolist()]
    while len(pool) > 1:
        i, j = rng.choice(len(pool), size=2, replace=False).tolist()
        (a, ea), (b, eb) = pool[i], pool[j]
        op = "+-*/"[int(rng.integers(4))]
        if op == "-" and a <= b:
            a, b, ea, eb = b, a, eb, ea
        if op == "-" and a == b:
            op = "+"
        if op == "/" and (b == 0 or a % b):
            op = "*"
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
        pool = [p for t, p in enumerate(pool) if t not in (i, j)] + [(value, f"({ea}{op}{eb})")]
    value, expr = pool[0]
    if value.denominator != 1 or not 1 <= value <= max_target:
        return None
    return int(value), expr


def longest_countdown_prompt(cfg: CountdownConfig) -> int:
    """An upper bound on the characters of any prompt `Use <numbers> to make <target>.` of
    `cfg`: at most `max_numbers` numbers of at most `max_number`, a target of at most
    `max_target` (the fallback target, a given number, is no longer)."""
    numbers = cfg.max_numbers * len(str(cfg.max_number)) + cfg.max_numbers - 1
    return len("Use ") + numbers + len(" to make ") + len(str(cfg.max_target)) + len(".")


def make_countdown_example(cfg: CountdownConfig, *, seed: int, split: str, index: int) -> Example:
    """Problem `index` of `split`: a pure function of `(seed, split, index)`."""
    rng = np.random.default_rng([seed, split_id(split), index])
    n = int(rng.integers(cfg.min_numbers, cfg.max_numbers + 1))
    numbers = rng.integers(1, cfg.max_number + 1, size=n).tolist()
    solution = None
    for _ in range(64):
        solution = _random_solution(rng, numbers, cfg.max_target)
        if solution is not None:
            break
    if solution is None:  # rare; a single number is a valid answer, and <= max_target (validated)
        smallest = min(numbers)
        solution = (smallest, str(smallest))
    target, expr = solution
    # Drop the outermost parentheses when they enclose the whole expression: `(1+2)*(3+4)` keeps
    # its own, `((1+2)*3)` becomes `(1+2)*3`.
    if expr.startswith("(") and _balanced(expr[1:-1]):
        expr = expr[1:-1]
    return Example(
        prompt=f"Use {' '.join(map(str, numbers))} to make {target}.",
        answer=str(target),
        task="countdown",
        source=f"countdown/{split}#{index}",
        index=index,
        numbers=tuple(numbers),
        completion=f"\nanswer: {expr}",
    )


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            return False
    return depth == 0
