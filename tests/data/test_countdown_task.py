"""Countdown: the safe parser, exact evaluation, the reward table, generated problems."""

from fractions import Fraction as F

import pytest

from sparserl_jax.data import (
    CountdownConfig,
    ExpressionError,
    countdown_reward,
    evaluate_expression,
    make_countdown_example,
    parse_expression,
)
from sparserl_jax.data.countdown import literals
from sparserl_jax.models import CharTokenizer


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1+2*3", F(7)),
        ("(1+2)*3", F(9)),
        ("10-2-3", F(5)),  # left associative
        ("12/2/3", F(2)),
        ("8/3", F(8, 3)),  # exact, no float
        ("2*(3+4)", F(14)),
        (" 25 + 50 ", F(75)),
        ("((7))", F(7)),
        ("6/(1-3/4)", F(24)),
    ],
)
def test_parse_and_evaluate(text, value):
    assert evaluate_expression(parse_expression(text)) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "1+",
        "(1+2",
        "1+2)",
        "-1+2",  # no unary minus
        "1 2",
        "2**3",
        "2^3",
        "abc",
        "__import__('os').system('true')",
        "1.5+2",
        "(" * 40 + "1" + ")" * 40,  # too deep
        "+".join(["1"] * 200),  # too long
    ],
)
def test_parse_rejects(text):
    with pytest.raises(ExpressionError):
        parse_expression(text)


def test_division_by_zero_is_an_expression_error():
    with pytest.raises(ExpressionError, match="zero"):
        evaluate_expression(parse_expression("5/(3-3)"))


def test_literals_in_order():
    assert literals(parse_expression("(25+50)*3-7")) == [25, 50, 3, 7]


NUMS = (3, 7, 25, 50)


@pytest.mark.parametrize(
    ("completion", "numbers", "target", "expected"),
    [
        ("\nanswer: 25+50", NUMS, 75, 1.0),
        ("\nanswer: (25+50)=75", NUMS, 75, 1.0),  # trailing `=target` is ignored
        ("\nanswer: (25+50)=99", NUMS, 75, 1.0),  # ... whatever it claims
        ("\nanswer: 3*25", NUMS, 75, 1.0),
        ("\nthinking 1+1\nanswer: 50+25\n", NUMS, 75, 1.0),
        ("\nanswer: 25+25+25", NUMS, 75, 0.1),  # 25 used three times
        ("\nanswer: 75", NUMS, 75, 0.1),  # 75 is not offered
        ("\nanswer: 50+7+3", NUMS, 75, 0.1),  # valid but 60
        ("\nanswer: 50/(7-7)", NUMS, 75, 0.1),  # 7 reused
        ("\nanswer: 50/(3-3)", (3, 3, 50), 75, 0.1),  # division by zero
        ("\nanswer: 2*2+3", (2, 2, 3), 7, 1.0),  # a number given twice may be used twice
        ("\nanswer: 2*2*2", (2, 2, 3), 8, 0.1),
        ("\nanswer: 6/(1-3/4)", (1, 3, 4, 6), 24, 1.0),  # rational intermediate
        ("\nanswer: (25+50", NUMS, 75, 0.0),  # does not parse
        ("\nanswer: -3+78", NUMS, 75, 0.0),
        ("\nanswer: 25 + fifty", NUMS, 75, 0.0),
        ("25+50", NUMS, 75, 0.0),  # no answer line
        ("", NUMS, 75, 0.0),
    ],
)
def test_countdown_reward_table(completion, numbers, target, expected):
    assert countdown_reward(completion, numbers, target, format_reward=0.1) == expected
    assert countdown_reward(completion, numbers, target) == (1.0 if expected == 1.0 else 0.0)


def test_generated_problems_are_solvable_and_in_range():
    cfg = CountdownConfig(min_numbers=3, max_numbers=5, max_number=20, max_target=200)
    tok = CharTokenizer()
    sizes = set()
    for i in range(150):
        ex = make_countdown_example(cfg, seed=3, split="train", index=i)
        sizes.add(len(ex.numbers))
        assert 3 <= len(ex.numbers) <= 5
        assert all(1 <= n <= 20 for n in ex.numbers)
        assert 1 <= int(ex.answer) <= 200
        assert ex.prompt == f"Use {' '.join(map(str, ex.numbers))} to make {ex.answer}."
        assert countdown_reward(ex.completion, ex.numbers, int(ex.answer)) == 1.0
        for text in (ex.prompt, ex.completion):
            assert tok.unk_id not in tok.encode(text), text
    assert sizes == {3, 4, 5}


def test_generated_problems_are_deterministic():
    cfg = CountdownConfig()
    a = [make_countdown_example(cfg, seed=0, split="train", index=i) for i in range(20)]
    b = [make_countdown_example(cfg, seed=0, split="train", index=i) for i in range(20)]
    c = [make_countdown_example(cfg, seed=1, split="train", index=i) for i in range(20)]
    assert a == b
    assert [e.numbers for e in a] != [e.numbers for e in c]
