"""The SFT warm start: its loss against a hand computation, answer corruption, and training."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.data import ArithmeticConfig, DataConfig
from sparserl_jax.models.tokenizer import CharTokenizer
from sparserl_jax.sft import SFTConfig, corrupt_answer, sft_loss, sft_warm_start
from sparserl_jax.testing import tiny_model


def test_sft_loss_hand_computed():
    # One row, T = 3, V = 2: logits[:, t] predicts tokens[:, t + 1]; only t + 1 = 2 is masked in.
    logits = jnp.asarray([[[0.0, 0.0], [2.0, 0.0], [5.0, 5.0]]])
    tokens = jnp.asarray([[0, 1, 0]])
    mask = jnp.asarray([[False, False, True]])
    want = -np.log(np.exp(2.0) / (np.exp(2.0) + 1.0))  # position 1 predicts token 0
    np.testing.assert_allclose(sft_loss(logits, tokens, mask), want, rtol=1e-6)
    both = jnp.asarray([[False, True, True]])
    np.testing.assert_allclose(sft_loss(logits, tokens, both), (want + np.log(2.0)) / 2, rtol=1e-6)
    assert float(sft_loss(logits, tokens, jnp.zeros_like(mask))) == 0.0


def test_corrupt_answer_changes_only_the_last_integer():
    rng = np.random.default_rng(0)
    text = "\n8+3+0=11, write 1 carry 1\nwrite 1\nanswer: 111"
    for _ in range(20):
        out = corrupt_answer(text, rng)
        head, _, answer = out.rpartition("answer: ")
        assert head == text.rpartition("answer: ")[0]
        assert int(answer) != 111 and 1 <= abs(int(answer) - 111) <= 10
    assert corrupt_answer("answer: -5", rng) != "answer: -5"
    assert corrupt_answer("no digits", rng) == "no digits"


def test_corrupt_offset_is_systematic():
    rng = np.random.default_rng(0)
    text = "\n8+3+0=11, write 1 carry 1\nwrite 1\nanswer: 111"
    assert {corrupt_answer(text, rng, 1) for _ in range(5)} == {text[:-3] + "112"}
    assert corrupt_answer("answer: -5", rng, -10) == "answer: -15"


def test_sft_config_errors_name_the_value():
    with pytest.raises(ValueError, match="corrupt_answers"):
        SFTConfig(corrupt_answers=1.0)
    with pytest.raises(ValueError, match="batch_size"):
        SFTConfig(batch_size=8, num_examples=4)


def test_warm_start_lowers_the_loss_and_is_deterministic():
    data = DataConfig(arithmetic=ArithmeticConfig(max_digits=1, operators=("+",)))
    cfg = SFTConfig(steps=12, batch_size=8, num_examples=32, max_len=64, learning_rate=1e-2)
    tok = CharTokenizer()
    a, b = (
        tiny_model(seed=1, vocab_size=tok.vocab_size),
        tiny_model(seed=1, vocab_size=tok.vocab_size),
    )
    losses = sft_warm_start(a, cfg, data, tok)
    assert len(losses) == 12 and np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3])
    assert sft_warm_start(b, cfg, data, tok) == losses
