"""The SFT warm start: its loss against a hand computation, answer corruption, and training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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
    lines = []  # progress after every tenth of the steps (12 // 10 = every step), not the last
    assert sft_warm_start(b, cfg, data, tok, log=lines.append) == losses
    assert len(lines) == 11 and lines[4].startswith(f"SFT step 5/12: loss {losses[4]:.3f}, ")


def test_streaming_view_evict_pos_by_hand():
    from sparserl_jax.kvcache.evictions import NEVER
    from sparserl_jax.sft import streaming_evict_pos

    got = streaming_evict_pos(7, window=3, sinks=2)
    np.testing.assert_array_equal(got, [NEVER, NEVER, 5, 6, 7, 8, 9])
    with pytest.raises(ValueError, match="sft.window must be >= 1"):
        SFTConfig(window_fraction=0.5)
    with pytest.raises(ValueError, match="window_fraction"):
        SFTConfig(window_fraction=1.5, window=4)


def test_a_windowed_row_sees_only_its_sinks_and_window():
    """Through the view, a token's logits do not depend on a token beyond the window's reach
    (a window per layer: each layer's keys at a position were computed from that position's
    own window, as a StreamingLLM cache holds them) and do on one within it; a sink is seen
    from everywhere; with a window as long as the row the view is full context."""
    from sparserl_jax.sft import streaming_evict_pos

    model = tiny_model(seed=2)
    layers = model.cfg.num_layers
    t, window, sinks = 24, 4, 2
    ev = jnp.asarray(streaming_evict_pos(t, window, sinks))[None, None, None, :]
    tokens = np.arange(3, 3 + t)[None, :]

    def logits(tok, ev_bykt):
        h = model.hidden_states(jnp.asarray(tok), evict_pos_bykt=ev_bykt)
        return np.asarray(model.logits(h))

    base = logits(tokens, ev)
    changed = tokens.copy()
    changed[0, 4] = 40
    reach = 4 + layers * (window - 1)  # the last query position token 4 can reach
    assert reach + 1 < t
    other = logits(changed, ev)
    np.testing.assert_array_equal(other[0, reach + 1 :], base[0, reach + 1 :])
    assert np.abs(other[0, 4 : reach + 1] - base[0, 4 : reach + 1]).max() > 1e-4
    sink = tokens.copy()
    sink[0, 1] = 40
    assert np.abs(logits(sink, ev)[0, t - 1] - base[0, t - 1]).max() > 1e-4
    full = jnp.asarray(streaming_evict_pos(t, t, 0))[None, None, None, :]
    want = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(logits(tokens, full), want, atol=1e-5)


def test_warm_start_with_a_windowed_view_learns_and_differs():
    data = DataConfig(arithmetic=ArithmeticConfig(max_digits=1, operators=("+",)))
    kw = dict(steps=12, batch_size=8, num_examples=32, max_len=64, learning_rate=1e-2)
    tok = CharTokenizer()
    plain = sft_warm_start(
        tiny_model(seed=1, vocab_size=tok.vocab_size), SFTConfig(**kw), data, tok
    )
    cfg = SFTConfig(**kw, window_fraction=0.5, window=6, window_sinks=4)
    a = sft_warm_start(tiny_model(seed=1, vocab_size=tok.vocab_size), cfg, data, tok)
    assert np.mean(a[-3:]) < 0.7 * np.mean(a[:3]) and a != plain
    assert sft_warm_start(tiny_model(seed=1, vocab_size=tok.vocab_size), cfg, data, tok) == a


def test_warm_start_resumes_bit_for_bit_from_its_progress(tmp_path):
    """Cut off after step 7 (its last save at step 6), the warm start called again resumes from
    step 6 and ends with the parameters and losses of an uninterrupted one; a progress
    directory of another SFT config is refused in one line."""
    data = DataConfig(arithmetic=ArithmeticConfig(max_digits=1, operators=("+",)))
    cfg = SFTConfig(
        steps=12,
        batch_size=8,
        num_examples=20,
        max_len=64,
        learning_rate=1e-2,
        window_fraction=0.5,
        window=6,
        window_sinks=4,
    )
    tok = CharTokenizer()
    whole = tiny_model(seed=1, vocab_size=tok.vocab_size)
    want = sft_warm_start(whole, cfg, data, tok)

    def stop_at_7(i, _):
        if i == 7:
            raise KeyboardInterrupt

    cut = tiny_model(seed=1, vocab_size=tok.vocab_size)
    with pytest.raises(KeyboardInterrupt):
        sft_warm_start(cut, cfg, data, tok, on_step=stop_at_7, checkpoint_dir=tmp_path)
    lines = []
    resumed = tiny_model(seed=1, vocab_size=tok.vocab_size)
    got = sft_warm_start(resumed, cfg, data, tok, log=lines.append, checkpoint_dir=tmp_path)
    assert lines[0] == f"SFT resumed from {tmp_path / 'checkpoints'} at step 6/12"
    assert got == want
    leaves = (jax.tree.leaves(nnx.state(m)) for m in (resumed, whole))
    for x, y in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    other = dataclasses.replace(cfg, learning_rate=2e-2)
    with pytest.raises(ValueError, match=r"another config \(differs in learning_rate\)"):
        sft_warm_start(
            tiny_model(seed=1, vocab_size=tok.vocab_size), other, data, tok, checkpoint_dir=tmp_path
        )
