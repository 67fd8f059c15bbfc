"""Answer extraction: numbers from gold answers and from model output, and the answer line.

Numbers are compared as exact `Fraction`s, so `42`, `42.0`, `42.00` and `1,234`/`1234` agree and
no float rounding decides a reward.

Model output (`extract_predicted_number`), in order of precedence:
  1. the last `\\boxed{...}` (braces matched; `\\frac{a}{b}` / `\\dfrac{a}{b}` inside are read as
     fractions, otherwise the last number inside);
  2. the first number after the last `####` (GSM8K's own format);
  3. the last number in the text.
A number is `-?digits` with optional thousands commas (`1,234,567`) and decimals (`3.25`); a `-`
right after a letter, digit or `.` is an operator, not a sign (`5-3` ends in `3`, not `-3`).
A number longer than `MAX_NUMBER_CHARS` characters is not read (None).
"""

from __future__ import annotations

import re
from fractions import Fraction

NUMBER_RE = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])")
_STRICT_NUMBER_RE = re.compile(r"^([+-]?)\$?((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)$")
_FRAC_RE = re.compile(r"^(-?)\\d?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}$")
_ANSWER_LINE_RE = re.compile(r"^answer: *(\S(?:.*\S)?) *$", re.MULTILINE)
# Longer digit runs are not answers, and Python refuses int() of > 4300 digits: a model that
# babbles digits must get a reward of 0, not crash the reward function.
MAX_NUMBER_CHARS = 64


def _fraction(text: str) -> Fraction | None:
    text = text.replace(",", "")
    return Fraction(text) if len(text) <= MAX_NUMBER_CHARS else None


def parse_number(text: str) -> Fraction | None:
    """The exact value of a string that is one number (`-1,234.5`, `+7`, `$12`); else None."""
    m = _STRICT_NUMBER_RE.match(text.strip())
    if m is None:
        return None
    value = _fraction(m.group(2))
    if value is None:
        return None
    return -value if m.group(1) == "-" else value


def last_number(text: str) -> Fraction | None:
    """The last number in free text (see the module docstring for what a number is)."""
    matches = NUMBER_RE.findall(text)
    if not matches:
        return None
    return _fraction(matches[-1])


def first_number(text: str) -> Fraction | None:
    m = NUMBER_RE.search(text)
    return None if m is None else _fraction(m.group(0))


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` with balanced braces; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unclosed: the model was cut off mid-answer


def _boxed_number(content: str) -> Fraction | None:
    m = _FRAC_RE.match(content.strip())
    if m is not None:
        if len(m.group(0)) > 2 * MAX_NUMBER_CHARS:
            return None
        num, den = int(m.group(2)), int(m.group(3))
        if den == 0:
            return None
        value = Fraction(num, den)
        return -value if m.group(1) else value
    return last_number(content)


def extract_predicted_number(text: str) -> Fraction | None:
    """The numeric answer of a model output; None when it contains no number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return _boxed_number(boxed)
    marker = text.rfind("####")
    if marker >= 0:
        value = first_number(text[marker + 4 :])
        if value is not None:
            return value
    return last_number(text)


def extract_gold_number(value: object) -> Fraction | None:
    """The gold answer of a data row: a number, `'... #### 42'`, or a string that is a number.

    Booleans and non-finite floats are not numbers. Returns None when nothing numeric is found.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        # Through repr so 0.1 reads as 1/10, the number the file wrote, not its binary neighbour.
        return Fraction(repr(value))
    if not isinstance(value, str):
        return None
    marker = value.rfind("####")
    if marker >= 0:
        tail = value[marker + 4 :].strip()
        exact = parse_number(tail)
        return exact if exact is not None else first_number(tail)
    return parse_number(value)


def format_number(value: Fraction) -> str:
    """Canonical text of a number: `42`, `-3.25`, or `1/3` when no finite decimal exists."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    # A fraction has a finite decimal expansion iff its reduced denominator is 2^a 5^b.
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value) * 10**places
    digits = str(scaled.numerator).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def parse_canonical(text: str) -> Fraction | None:
    """Inverse of `format_number` (also accepts anything `parse_number` does)."""
    if "/" in text:
        num, _, den = text.partition("/")
        if len(text) > 2 * MAX_NUMBER_CHARS:
            return None
        try:
            n, d = int(num), int(den)
        except ValueError:
            return None
        return Fraction(n, d) if d else None
    return parse_number(text)


def last_answer_line(text: str) -> str | None:
    """The content of the last line of the form `answer: <content>`; None if there is none.

    The synthetic tasks end their completions with such a line; only a whole line counts, so
    `the answer: 5 apples` inside a sentence does not.
    """
    matches = _ANSWER_LINE_RE.findall(text)
    return matches[-1] if matches else None
