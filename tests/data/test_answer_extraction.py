"""Numeric extraction and the answer line: hand-written tables."""

from fractions import Fraction as F

import pytest

from sparserl_jax.data import (
    extract_gold_number,
    extract_predicted_number,
    format_number,
    last_answer_line,
    last_boxed,
    last_number,
    parse_number,
)
from sparserl_jax.data.extract import parse_canonical


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", F(42)),
        ("  42 ", F(42)),
        ("-3.5", F(-7, 2)),
        ("+7", F(7)),
        ("1,234", F(1234)),
        ("1,234,567.25", F(123456725, 100)),
        ("$12", F(12)),
        ("-$12", F(-12)),
        ("12.50", F(25, 2)),
        ("0", F(0)),
        ("1,23", None),  # not a thousands separator
        ("12,3456", None),
        ("4 2", None),
        ("abc", None),
        ("", None),
        ("42 apples", None),
        ("1e5", None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", F(42)),
        ("5-3", F(3)),  # a minus after a digit is an operator
        ("x = -3", F(-3)),
        ("2-(-4)", F(-4)),
        ("-0.5", F(-1, 2)),
        ("1,234,567 apples", F(1234567)),
        ("cost $1,000.50 in total", F(100050, 100)),
        ("abc123", F(123)),
        ("pi is 3.14.", F(314, 100)),
        ("1,2345", F(2345)),  # not a thousands group: two numbers 1 and 2345
        ("3, 4 and 5", F(5)),
        ("first 10 then 20\nfinally 30 items", F(30)),
        ("a-5", F(5)),  # `a-5`: operator after a letter
        ("no numbers here", None),
        ("", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{42} and then 7", F(42)),
        (r"\boxed{1,234}", F(1234)),
        (r"\boxed{-3.5}", F(-7, 2)),
        (r"\boxed{\frac{1}{2}}", F(1, 2)),
        (r"\boxed{\dfrac{3}{4}}", F(3, 4)),
        (r"\boxed{-\frac{3}{4}}", F(-3, 4)),
        (r"\boxed{\frac{3}{0}}", None),
        (r"\boxed{5} then \boxed{6}", F(6)),
        (r"\boxed{\$18 \text{ dollars}}", F(18)),
        (r"\boxed{x}", None),  # a box without a number: no fallback to text outside it
        (r"7 and \boxed{4", F(4)),  # unclosed box: falls back to the last number
        ("reasoning 3 4\n#### 42\nthen 7", F(42)),
        ("#### -5", F(-5)),
        ("#### 1,234.5", F(12345, 10)),
        ("#### none\n9", F(9)),
        ("The total is 18 dollars.", F(18)),
        ("nothing", None),
    ],
)
def test_extract_predicted_number(text, expected):
    assert extract_predicted_number(text) == expected


def test_last_boxed_matches_nested_braces():
    assert last_boxed(r"a \boxed{\frac{1}{2}} b") == r"\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{1") is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (42, F(42)),
        (-7, F(-7)),
        (3.5, F(7, 2)),
        (0.1, F(1, 10)),  # the decimal written in the file, not the nearest binary float
        (True, None),
        (float("nan"), None),
        (float("inf"), None),
        (None, None),
        ([1], None),
        ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", F(72)),
        ("#### 1,234", F(1234)),
        ("#### $18", F(18)),
        ("#### 18 dollars", F(18)),
        ("####", None),
        ("42", F(42)),
        ("-2.50", F(-5, 2)),
        ("forty-two", None),
        ("about 42", None),  # no `####`: the string must be one number
    ],
)
def test_extract_gold_number(value, expected):
    assert extract_gold_number(value) == expected


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (F(42), "42"),
        (F(-7), "-7"),
        (F(-7, 2), "-3.5"),
        (F(1, 8), "0.125"),
        (F(-1, 20), "-0.05"),
        (F(1001, 100), "10.01"),
        (F(1, 3), "1/3"),
        (F(-2, 3), "-2/3"),
    ],
)
def test_format_number_roundtrip(value, text):
    assert format_number(value) == text
    assert parse_canonical(text) == value


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("work\nanswer: 81", "81"),
        ("answer: 1\nmore\nanswer: 2\n", "2"),
        ("answer:   7  ", "7"),
        ("x\nanswer: (25+50)=75", "(25+50)=75"),
        ("the answer: 5 apples", None),  # only a whole line counts
        ("Answer: 5", None),
        ("answer:", None),
        ("answer:   ", None),
        ("", None),
    ],
)
def test_last_answer_line(text, expected):
    assert last_answer_line(text) == expected


def test_babbled_digit_runs_read_as_no_number():
    # int() refuses more than 4300 digits: a degenerate completion must not crash a reward.
    run = "9" * 5000
    assert last_number(f"so {run}") is None
    assert extract_predicted_number(rf"\boxed{{{run}}}") is None
    assert extract_predicted_number(f"#### {run}") is None
    assert parse_number(run) is None
    assert extract_gold_number(f"#### {run}") is None
    assert last_number("1" * 64) == F(int("1" * 64))  # the limit itself still reads
