"""Arithmetic with a scratchpad: hand-written completions, rewards, determinism, tokenizer cover."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax.data import (
    ArithmeticConfig,
    arithmetic_reward,
    make_arithmetic_example,
    solve,
)
from sparserl_jax.data.arithmetic import TAG_LETTERS, longest_arithmetic_prompt
from sparserl_jax.models import CharTokenizer


@pytest.mark.parametrize(
    ("a", "op", "b", "result", "completion"),
    [
        (
            23, "+", 58, 81,
            "\n3+8+0=11, write 1 carry 1\n2+5+1=8, write 8 carry 0\nanswer: 81",
        ),
        (
            95, "+", 7, 102,
            "\n5+7+0=12, write 2 carry 1\n9+0+1=10, write 0 carry 1\nwrite 1\nanswer: 102",
        ),
        (
            345, "-", 78, 267,
            "\n5-8-0=-3, -3+10=7, write 7 borrow 1\n4-7-1=-4, -4+10=6, write 6 borrow 1"
            "\n3-0-1=2, write 2 borrow 0\nanswer: 267",
        ),
        (
            23, "-", 58, -35,
            "\n23<58, so compute 58-23 and negate\n8-3-0=5, write 5 borrow 0"
            "\n5-2-0=3, write 3 borrow 0\nanswer: -35",
        ),
        (23, "*", 45, 1035, "\n23*5=115\n23*40=920\n115+920=1035\nanswer: 1035"),
        (7, "*", 0, 0, "\n7*0=0\nanswer: 0"),
        (144, "/", 12, 12, "\n1/12=0 rem 1\n14/12=1 rem 2\n24/12=2 rem 0\nanswer: 12"),
    ],
)  # fmt: skip
def test_solve_hand_written(a, op, b, result, completion):
    assert solve(a, op, b) == (result, completion)


def test_solve_rejects_inexact_division_and_bad_operator():
    with pytest.raises(ValueError, match="exact"):
        solve(7, "/", 2)
    with pytest.raises(ValueError, match="exact"):
        solve(7, "/", 0)
    with pytest.raises(ValueError, match="operator"):
        solve(7, "%", 2)


@settings(max_examples=50, deadline=None)
@given(
    a=st.integers(0, 10**6),
    b=st.integers(1, 10**4),
    op=st.sampled_from(["+", "-", "*", "/"]),
)
def test_solve_answer_line_is_exact_result(a, b, op):
    if op == "/":
        a = a * b
    expected = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    result, completion = solve(a, op, b)
    assert result == expected
    assert completion.endswith(f"\nanswer: {expected}")
    assert arithmetic_reward(completion, str(expected)) == 1.0


@pytest.mark.parametrize(
    ("completion", "fmt", "expected"),
    [
        ("\nanswer: 81", 0.0, 1.0),
        ("\nsteps\nanswer: 81", 0.1, 1.0),  # correct scores 1.0, not 1.0 + format
        ("\nanswer: 80", 0.0, 0.0),
        ("\nanswer: 80", 0.1, 0.1),
        ("\nanswer: 80\nanswer: 81", 0.1, 1.0),  # the last answer line counts
        ("\nanswer: 81\nanswer: 80", 0.1, 0.1),
        ("\nanswer: 081", 0.0, 1.0),
        ("\nanswer: 81.0", 0.1, 0.0),  # not an integer: malformed
        ("\nanswer: 8 1", 0.1, 0.0),
        ("\nthe result is 81", 0.1, 0.0),
        ("81", 0.1, 0.0),
        ("", 0.1, 0.0),
    ],
)
def test_arithmetic_reward_table(completion, fmt, expected):
    assert arithmetic_reward(completion, "81", format_reward=fmt) == expected


def test_arithmetic_reward_negative_answer():
    assert arithmetic_reward("\nanswer: -35", "-35") == 1.0
    assert arithmetic_reward("\nanswer: 35", "-35") == 0.0


def test_examples_respect_difficulty_and_are_encodable():
    tok = CharTokenizer()
    cfg = ArithmeticConfig(min_digits=2, max_digits=4, operators=("+", "-", "*", "/"))
    ops_seen = set()
    for i in range(200):
        ex = make_arithmetic_example(cfg, seed=5, split="train", index=i)
        a, op, b = ex.prompt[:-1].partition(next(c for c in "+-*/" if c in ex.prompt[1:]))
        ops_seen.add(op)
        assert ex.prompt.endswith("=")
        if op == "/":
            assert 2 <= len(b) <= 4 and int(a) % int(b) == 0
        else:
            assert 2 <= len(a) <= 4 and 2 <= len(b) <= 4
        assert arithmetic_reward(ex.completion, ex.answer) == 1.0
        assert ex.completion.endswith(f"answer: {ex.answer}")
        for text in (ex.prompt, ex.completion):
            assert tok.unk_id not in tok.encode(text), text
            assert tok.decode(tok.encode(text)) == text
    assert ops_seen == {"+", "-", "*", "/"}


def test_operator_subset_and_long_completions():
    cfg = ArithmeticConfig(min_digits=3, max_digits=3, operators=("*",))
    for i in range(20):
        ex = make_arithmetic_example(cfg, seed=0, split="train", index=i)
        assert "*" in ex.prompt
        # 3 partial products + 2 sums + answer: the scratchpad is long next to the prompt
        assert ex.completion.count("\n") == 6
        assert len(ex.completion) > 3 * len(ex.prompt)


def test_examples_are_a_pure_function_of_seed_split_index():
    cfg = ArithmeticConfig(max_digits=4, operators=("+", "-", "*"))
    one = [make_arithmetic_example(cfg, seed=1, split="train", index=i) for i in range(30)]
    two = [make_arithmetic_example(cfg, seed=1, split="train", index=i) for i in range(30)]
    assert one == two
    other_seed = [make_arithmetic_example(cfg, seed=2, split="train", index=i) for i in range(30)]
    eval_split = [make_arithmetic_example(cfg, seed=1, split="eval", index=i) for i in range(30)]
    assert [e.prompt for e in one] != [e.prompt for e in other_seed]
    assert [e.prompt for e in one] != [e.prompt for e in eval_split]
    assert one[3].source == "arithmetic/train#3" and one[3].index == 3
    with pytest.raises(ValueError, match="split"):
        make_arithmetic_example(cfg, seed=1, split="test", index=0)


def test_arithmetic_reward_survives_huge_integers():
    assert arithmetic_reward("\nanswer: " + "9" * 5000, "81", format_reward=0.1) == 0.1


@pytest.mark.parametrize(
    ("a", "b", "completion"),
    [
        (
            45678, 12345,
            "\n8+5+0=13, 4567+1234 c1 s3\n7+4+1=12, 456+123 c1 s23\n6+3+1=10, 45+12 c1 s023"
            "\n5+2+1=8, 4+1 c0 s8023\n4+1+0=5, 0+0 c0 s58023\nanswer: 58023",
        ),
        (95, 7, "\n5+7+0=12, 9+0 c1 s2\n9+0+1=10, 0+0 c1 s02\n0+0+1=1, 0+0 c0 s102\nanswer: 102"),
        (0, 0, "\n0+0+0=0, 0+0 c0 s0\nanswer: 0"),
    ],
)  # fmt: skip
def test_running_scratchpad_hand_written(a, b, completion):
    assert solve(a, "+", b, scratchpad="running") == (a + b, completion)


@settings(max_examples=50, deadline=None)
@given(a=st.integers(0, 10**9), b=st.integers(0, 10**9))
def test_running_scratchpad_lines_depend_on_the_line_above_only(a, b):
    # Each line `x+y+c=t, A+B cC sS` is a function of the line above (the prompt for the first): the
    # state the answer needs is restated every line, so eviction of older lines loses nothing.
    result, completion = solve(a, "+", b, scratchpad="running")
    lines = completion.strip("\n").split("\n")
    state = (a, b, 0, "")
    for line in lines[:-1]:
        x, y, c, s = state
        t = x % 10 + y % 10 + c
        state = (x // 10, y // 10, t // 10, f"{t % 10}{s}")
        assert line == f"{x % 10}+{y % 10}+{c}={t}, {state[0]}+{state[1]} c{state[2]} s{state[3]}"
    assert lines[-1] == f"answer: {int(state[3])}" and int(state[3]) == result == a + b
    assert arithmetic_reward(completion, str(a + b)) == 1.0


def test_running_scratchpad_is_addition_only():
    with pytest.raises(ValueError, match="running"):
        solve(5, "-", 3, scratchpad="running")
    with pytest.raises(ValueError, match="scratchpad"):
        ArithmeticConfig(operators=("+", "*"), scratchpad="running")


def test_repeat_scratchpad_hand_written_and_config():
    assert solve(7, "*", 3, scratchpad="repeat") == (21, "\n1: 7\n2: 14\n3: 21\nanswer: 21")
    with pytest.raises(ValueError, match="repeat"):
        solve(7, "+", 3, scratchpad="repeat")
    with pytest.raises(ValueError, match="b >= 1"):
        solve(7, "*", 0, scratchpad="repeat")
    with pytest.raises(ValueError, match="'\\*' only"):
        ArithmeticConfig(operators=("+",), scratchpad="repeat")
    with pytest.raises(ValueError, match="min_repeats"):
        ArithmeticConfig(operators=("*",), scratchpad="repeat", min_repeats=5, max_repeats=4)


def test_repeat_examples_are_long_with_short_lines():
    cfg = ArithmeticConfig(
        operators=("*",), scratchpad="repeat", min_digits=1, max_digits=2, min_repeats=40
    )
    for i in range(20):
        ex = make_arithmetic_example(cfg, seed=0, split="train", index=i)
        a, b = map(int, ex.prompt[:-1].split("*"))
        assert 1 <= a <= 99 and 40 <= b <= 70 and ex.answer == str(a * b)
        lines = ex.completion.strip("\n").split("\n")
        assert len(lines) == b + 1 and max(map(len, lines)) <= len("answer: 6930")
        assert len(ex.prompt) <= longest_arithmetic_prompt(cfg)
        assert arithmetic_reward(ex.completion, ex.answer) == 1.0


def _tagged_lines(ex):
    """(count, tag, sum) of each scratchpad line of a tagged repeat example."""
    out = []
    for line in ex.completion.strip("\n").split("\n")[:-1]:
        count = line[: len(line) - len(line.lstrip("0123456789"))]
        rest = line[len(count) :]
        tag = rest[: len(rest) - len(rest.lstrip(TAG_LETTERS))]
        out.append((int(count), tag, int(rest[len(tag) :])))
    return out


def test_tagged_repeat_lines_copy_ten_above_at_the_configured_rate():
    cfg = ArithmeticConfig(
        operators=("*",),
        scratchpad="repeat",
        max_digits=1,
        min_repeats=40,
        max_repeats=60,
        tags=2,
        tag_copy=0.75,
    )
    copies = n = 0
    for i in range(200):
        ex = make_arithmetic_example(cfg, seed=0, split="train", index=i)
        assert ex == make_arithmetic_example(cfg, seed=0, split="train", index=i)
        a, b = map(int, ex.prompt[:-1].split("*"))
        lines = _tagged_lines(ex)
        assert [(k, s) for k, _, s in lines] == [(k, a * k) for k in range(1, b + 1)]
        assert all(len(t) == 2 for _, t, _ in lines)
        assert arithmetic_reward(ex.completion, ex.answer) == 1.0
        for k in range(10, b):
            for j in range(2):
                copies += lines[k][1][j] == lines[k - 10][1][j]
                n += 1
    # P(same letter) = tag_copy + (1 - tag_copy) / 4 = 0.8125; n is about 16,000.
    assert abs(copies / n - 0.8125) < 0.015


def test_tags_always_copy_at_rate_one_and_are_checked():
    cfg = ArithmeticConfig(operators=("*",), scratchpad="repeat", tags=1, tag_copy=1.0)
    lines = _tagged_lines(make_arithmetic_example(cfg, seed=3, split="eval", index=7))
    assert all(lines[k][1] == lines[k % 10][1] for k in range(len(lines)))
    with pytest.raises(ValueError, match="tags"):
        ArithmeticConfig(operators=("+",), tags=1)
    with pytest.raises(ValueError, match="tag_copy"):
        ArithmeticConfig(operators=("*",), scratchpad="repeat", tags=1, tag_copy=1.5)
    with pytest.raises(ValueError, match="rng"):
        solve(7, "*", 3, scratchpad="repeat", tags=1)
