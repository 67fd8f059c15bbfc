"""grain pipelines: resume equals uninterrupted, determinism, epochs, shards, SFT batches."""

import collections
import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax.data import (
    ArithmeticConfig,
    CountdownConfig,
    DataConfig,
    DataError,
    PromptBatch,
    encode_prompts,
    eval_examples,
    pipeline,
    prompt_iterator,
    sft_batch,
    sft_pairs,
)
from sparserl_jax.data.arithmetic import longest_arithmetic_prompt, make_arithmetic_example
from sparserl_jax.data.countdown import longest_countdown_prompt, make_countdown_example
from sparserl_jax.data.pipeline import PromptLimit
from sparserl_jax.models import CharTokenizer


def _take(it, n):
    return [next(it) for _ in range(n)]


def _gsm_file(tmp_path, n):
    path = tmp_path / "rows.jsonl"
    rows = [json.dumps({"question": f"q{i}?", "answer": f"#### {i}"}) for i in range(n)]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.mark.parametrize("task", ["arithmetic", "countdown", "gsm8k"])
def test_resume_equals_uninterrupted(tmp_path, task):
    path = _gsm_file(tmp_path, 7) if task == "gsm8k" else None
    # 7 rows in batches of 3 cross epoch boundaries within the window below.
    cfg = DataConfig(task=task, batch_size=3, seed=11, path=path, num_threads=2)
    k, more = 3, 5
    uninterrupted = _take(prompt_iterator(cfg), k + more)

    it = prompt_iterator(cfg)
    head = _take(it, k)
    state = json.loads(json.dumps(it.get_state()))  # the state survives a JSON round trip
    after_save = _take(it, more)
    resumed = _take(prompt_iterator(cfg, state=state), more)

    assert head == uninterrupted[:k]
    assert after_save == uninterrupted[k:]
    assert resumed == uninterrupted[k:]
    # set_state on an iterator that has already moved on rewinds it exactly too
    it.set_state(state)
    assert _take(it, more) == uninterrupted[k:]


def test_batches_are_prompt_batches_with_verification_data():
    cfg = DataConfig(batch_size=4, seed=0)
    batch = next(prompt_iterator(cfg))
    assert isinstance(batch, PromptBatch) and len(batch) == 4
    assert batch.prompts == [e.prompt for e in batch.examples]
    assert batch.answers == [e.answer for e in batch.examples]
    for e in batch.examples:
        a, op, b = e.prompt[:-1].partition("+" if "+" in e.prompt else "-")
        assert int(e.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_seed_determinism_and_thread_independence():
    base = DataConfig(batch_size=5, seed=3)
    a = _take(prompt_iterator(base), 4)
    b = _take(prompt_iterator(DataConfig(batch_size=5, seed=3, num_threads=0)), 4)
    c = _take(prompt_iterator(DataConfig(batch_size=5, seed=4)), 4)
    assert a == b
    assert [x.prompts for x in a] != [x.prompts for x in c]


def test_epochs_reshuffle_and_end(tmp_path):
    path = _gsm_file(tmp_path, 5)
    cfg = DataConfig(task="gsm8k", path=path, batch_size=2, num_epochs=2, drop_remainder=False)
    batches = list(prompt_iterator(cfg))
    indices = [i for batch in batches for i in batch.indices]
    assert [len(batch) for batch in batches] == [2, 2, 2, 2, 2]
    assert sorted(indices[:5]) == sorted(indices[5:]) == [0, 1, 2, 3, 4]  # each epoch is a perm
    assert indices[:5] != indices[5:]  # ... reshuffled
    no_shuffle = DataConfig(
        task="gsm8k", path=path, batch_size=2, num_epochs=1, shuffle=False, drop_remainder=True
    )
    assert [b.indices for b in prompt_iterator(no_shuffle)] == [[0, 1], [2, 3]]


def test_too_few_rows_for_one_batch(tmp_path):
    path = _gsm_file(tmp_path, 2)
    cfg = DataConfig(task="gsm8k", path=path, batch_size=3, num_epochs=1)
    with pytest.raises(DataError, match="fewer rows"):
        prompt_iterator(cfg)


def test_shards_are_disjoint_and_cover(tmp_path):
    path = _gsm_file(tmp_path, 9)
    cfg = DataConfig(task="gsm8k", path=path, batch_size=1, num_epochs=1, seed=2)
    seen = [
        [i for b in prompt_iterator(cfg, shard_index=s, shard_count=3) for i in b.indices]
        for s in range(3)
    ]
    assert all(len(s) == 3 for s in seen)
    assert sorted(sum(seen, [])) == list(range(9))
    with pytest.raises(ValueError, match="shard_index"):
        prompt_iterator(cfg, shard_index=3, shard_count=3)


def test_eval_split(tmp_path):
    cfg = DataConfig(arithmetic=ArithmeticConfig(max_digits=4))
    held_out = eval_examples(cfg, 16)
    assert held_out == eval_examples(cfg, 16)
    assert [e.source for e in held_out[:2]] == ["arithmetic/eval#0", "arithmetic/eval#1"]
    train = {e.prompt for b in _take(prompt_iterator(cfg), 4) for e in b.examples}
    assert {e.prompt for e in held_out} != train
    path = _gsm_file(tmp_path, 3)
    with pytest.raises(DataError, match="eval_path"):
        eval_examples(DataConfig(task="gsm8k", path=path))
    assert len(eval_examples(DataConfig(task="gsm8k", path=path, eval_path=path))) == 3


def test_sft_pairs_and_batch():
    tok = CharTokenizer()
    cfg = DataConfig(arithmetic=ArithmeticConfig(max_digits=2))
    pairs = sft_pairs(cfg, 3)
    assert len(pairs) == 3 and all(c.endswith("answer: " + str(eval_free(p))) for p, c in pairs)

    batch = sft_batch([("1+2=", "\nanswer: 3"), ("9-9=", "\nanswer: 0")], tok, max_len=20)
    prompt = [tok.bos_id] + tok.encode("1+2=")
    completion = tok.encode("\nanswer: 3") + [tok.eos_id]
    expected = np.full(20, tok.pad_id, np.int32)
    expected[: len(prompt) + len(completion)] = prompt + completion
    np.testing.assert_array_equal(batch.tokens_bt[0], expected)
    mask = np.zeros(20, bool)
    mask[len(prompt) : len(prompt) + len(completion)] = True
    np.testing.assert_array_equal(batch.loss_mask_bt[0], mask)
    np.testing.assert_array_equal(batch.lengths_b, [16, 16])
    assert batch.tokens_bt.dtype == np.int32 and batch.tokens_bt.shape == (2, 20)

    with pytest.raises(ValueError, match="16 tokens, more than max_len=10"):
        sft_batch([("1+2=", "\nanswer: 3")], tok, max_len=10)
    cut = sft_batch([("1+2=", "\nanswer: 3")], tok, max_len=10, truncate=True)
    np.testing.assert_array_equal(cut.tokens_bt[0], (prompt + completion)[:10])
    assert cut.loss_mask_bt[0].sum() == 10 - len(prompt)


def test_encode_prompts():
    tok = CharTokenizer()
    batch = next(prompt_iterator(DataConfig(batch_size=2)))
    ids = encode_prompts(batch, tok)
    assert ids == [[tok.bos_id] + tok.encode(p) for p in batch.prompts]
    assert encode_prompts(batch.examples, tok, add_bos=False) == [
        tok.encode(p) for p in batch.prompts
    ]


def eval_free(prompt: str) -> int:
    a, op, b = prompt[:-1].partition("+" if "+" in prompt else "-")
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_prompt_batches_hold_every_row_once_per_epoch(tmp_path):
    path = _gsm_file(tmp_path, 6)
    cfg = DataConfig(task="gsm8k", path=path, batch_size=3, num_epochs=3, seed=9)
    counts = collections.Counter(i for b in prompt_iterator(cfg) for i in b.indices)
    assert counts == {i: 3 for i in range(6)}


# -- the longest possible prompt of a generated task ---------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    min_digits=st.integers(1, 4),
    extra=st.integers(0, 3),
    operators=st.sets(st.sampled_from("+-*/"), min_size=1).map(lambda s: "".join(sorted(s))),
    seed=st.integers(0, 2**16),
)
def test_longest_arithmetic_prompt_bounds_every_prompt(min_digits, extra, operators, seed):
    cfg = ArithmeticConfig(
        min_digits=min_digits, max_digits=min_digits + extra, operators=tuple(operators)
    )
    bound = longest_arithmetic_prompt(cfg)
    lengths = [
        len(make_arithmetic_example(cfg, seed=seed, split="train", index=i).prompt)
        for i in range(200)
    ]
    assert max(lengths) <= bound


@settings(max_examples=25, deadline=None)
@given(
    min_numbers=st.integers(2, 5),
    extra=st.integers(0, 3),
    max_number=st.integers(2, 300),
    target_extra=st.integers(0, 5000),
    seed=st.integers(0, 2**16),
)
def test_longest_countdown_prompt_bounds_every_prompt(
    min_numbers, extra, max_number, target_extra, seed
):
    cfg = CountdownConfig(
        min_numbers=min_numbers,
        max_numbers=min_numbers + extra,
        max_number=max_number,
        max_target=max_number + target_extra,
    )
    bound = longest_countdown_prompt(cfg)
    lengths = [
        len(make_countdown_example(cfg, seed=seed, split="train", index=i).prompt)
        for i in range(60)
    ]
    assert max(lengths) <= bound


def test_bounds_are_reached():
    """Tight where the draws can reach them: all-9 operands, a full set of large numbers."""
    cfg = ArithmeticConfig(min_digits=1, max_digits=1, operators=("+", "/"))
    longest = max(
        len(make_arithmetic_example(cfg, seed=0, split="train", index=i).prompt) for i in range(400)
    )
    assert longest == longest_arithmetic_prompt(cfg) == len("81/9=")
    cfg = CountdownConfig(min_numbers=2, max_numbers=2, max_number=9, max_target=9)
    longest = max(
        len(make_countdown_example(cfg, seed=0, split="train", index=i).prompt) for i in range(100)
    )
    assert longest == longest_countdown_prompt(cfg) == len("Use 9 9 to make 9.")


def test_prompt_pass_skipped_only_when_the_bound_fits(monkeypatch):
    """A generated task whose longest possible prompt fits is not read at start-up (the
    character tokenizer's bound: one token per character), and its batches are the unfiltered
    ones; one whose bound does not fit, or a tokenizer without a bound, is read prompt by
    prompt as before."""
    calls = collections.Counter()
    real = pipeline._fitting

    def counting(*args, **kwargs):
        calls["pass"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_fitting", counting)
    cfg = DataConfig(task="arithmetic", batch_size=4, arithmetic=ArithmeticConfig(max_digits=2))
    tok = CharTokenizer()
    bound = longest_arithmetic_prompt(cfg.arithmetic) + 1  # with the BOS
    assert not PromptLimit(tok, bound - 1).fits(bound - 1) and PromptLimit(tok, bound).fits(
        bound - 1
    )
    plain = _take(prompt_iterator(cfg), 3)

    got = _take(prompt_iterator(cfg, limit=PromptLimit(tok, bound)), 3)
    assert calls["pass"] == 0 and [b.answers for b in got] == [b.answers for b in plain]

    # One short of the bound: every prompt is read, and those of the longest kind are left out.
    got = _take(prompt_iterator(cfg, limit=PromptLimit(tok, bound - 1)), 3)
    assert calls["pass"] == 1
    assert all(len(tok.encode(p, add_bos=True)) <= bound - 1 for b in got for p in b.prompts)

    class NoBound:  # a tokenizer that claims no bound (as HFTokenizer)
        def encode(self, text, *, add_bos=False):
            return tok.encode(text, add_bos=add_bos)

        def max_tokens(self, num_chars):
            return None

    got = _take(prompt_iterator(cfg, limit=PromptLimit(NoBound(), 64)), 3)
    assert calls["pass"] == 2 and [b.answers for b in got] == [b.answers for b in plain]
    # Too short for some prompts: the pass finds and names them, as for a file.
    with pytest.raises(
        DataError, match=r"train prompt arithmetic/train#0 .* is 7 tokens, more than"
    ):
        prompt_iterator(dataclasses.replace(cfg, long_prompts="error"), limit=PromptLimit(tok, 4))
    assert calls["pass"] == 3
