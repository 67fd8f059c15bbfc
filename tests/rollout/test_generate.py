"""The reference sampler, a test oracle: greedy is the argmax of the dense forward; logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.rollout import sample, token_logprobs
from sparserl_jax.testing import tiny_model
from sparserl_jax.testing.oracles import stepwise_greedy
from sparserl_jax.testing.reference_sampler import generate

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


def test_greedy_equals_stepwise_argmax():
    model = tiny_model()
    out = generate(model, PROMPTS, max_new_tokens=7)
    np.testing.assert_array_equal(out.tokens, stepwise_greedy(model, PROMPTS, 7))
    assert out.lengths.tolist() == [7, 7, 7]


@pytest.mark.slow
def test_sampled_logprobs_equal_teacher_forced_T1():
    model = tiny_model(seed=3)
    out = generate(model, PROMPTS, max_new_tokens=6, temperature=1.0, seed=11)
    for i, prompt in enumerate(PROMPTS):
        seq = jnp.asarray([prompt + out.tokens[i].tolist()])
        logits = model(seq)[:, len(prompt) - 1 : -1]
        expected = token_logprobs(logits, seq[:, len(prompt) :])[0]
        np.testing.assert_allclose(out.logprobs[i], expected, atol=1e-5, rtol=0)


def test_stop_tokens_and_seeds():
    model = tiny_model()
    greedy = generate(model, PROMPTS, max_new_tokens=7)
    stop = int(greedy.tokens[0, 2])
    out = generate(model, PROMPTS, max_new_tokens=7, stop_ids=[stop], pad_id=0)
    n = out.lengths[0]
    assert out.tokens[0, n - 1] == stop and n <= 3
    assert (out.tokens[0, n:] == 0).all() and not out.mask[0, n:].any()
    a = generate(model, PROMPTS, max_new_tokens=5, temperature=1.0, seed=1)
    b = generate(model, PROMPTS, max_new_tokens=5, temperature=1.0, seed=1)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_top_k_top_p_truncate_but_logprob_does_not():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)
    toks = np.array([sample(logits, k, temperature=1.0, top_k=2)[0][0] for k in keys[:100]])
    assert set(toks.tolist()) <= {0, 1}
    toks = np.array([sample(logits, k, temperature=1.0, top_p=0.7)[0][0] for k in keys[100:]])
    assert set(toks.tolist()) <= {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    tok, logp = sample(logits, keys[0], temperature=1.0, top_k=1)
    np.testing.assert_allclose(logp, jnp.log(0.5), rtol=1e-6)  # untruncated distribution
