"""The rollout engine's contract against references.

- With no compression and T = 1, sampler logprobs equal teacher-forced dense logprobs (<= 1e-5),
  both the trainer's pi_old (`Learner.logprobs`) and the stand-alone `dense_logprobs`.
- Greedy decoding equals step-by-step argmax of the dense forward `model(tokens)`.
- Continuous batching (fewer slots than requests, a pool smaller than slots x length) gives the
  same per-request outputs as static batching (one slot per request) for the same seeds.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sparserl_jax.rl import Learner, LearnerConfig
from sparserl_jax.rollout import RolloutConfig, RolloutEngine, dense_logprobs
from sparserl_jax.testing import tiny_model
from sparserl_jax.testing.oracles import stepwise_greedy

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [1], [2, 3, 4, 5, 6]]
MAX_NEW = 9


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def pi_old(model, tokens_bt, *, num_micro_batches: int) -> jax.Array:
    """pi_old as the trainer computes it (`Learner.logprobs`, T = 1)."""
    learner = Learner(model, LearnerConfig(num_micro_batches=num_micro_batches))
    return learner.logprobs(learner.init(model).params, tokens_bt)


def config(**kw) -> RolloutConfig:
    base = dict(
        num_slots=2, max_prompt_len=6, max_new_tokens=MAX_NEW, temperature=1.0, chunk_steps=4
    )
    base.update(kw)
    return RolloutConfig(**base)


@pytest.fixture(scope="module")
def sampled(model):
    """Continuous batching: 2 slots for 10 requests, T = 1, a stop token, 2 samples/prompt."""
    engine = RolloutEngine(model, config(n_samples=2, stop_token_ids=(17,)))
    return engine, engine.generate(PROMPTS, weight_version=7)


def test_sampler_logprobs_equal_teacher_forced_dense(model, sampled):
    _, res = sampled
    tokens_bt, mask_bt, sampler_bt = res.sequences()
    assert mask_bt.sum() == res.completion_lens.sum() > 0
    # The trainer's pi_old: `Learner.logprobs`, one micro-batch of every row.
    learner_bt = np.asarray(pi_old(model, tokens_bt, num_micro_batches=1))
    np.testing.assert_allclose(sampler_bt[mask_bt], learner_bt[mask_bt], atol=1e-5, rtol=0)
    dense_bt = np.asarray(dense_logprobs(model, None, tokens_bt, temperature=1.0))
    np.testing.assert_allclose(sampler_bt[mask_bt], dense_bt[mask_bt], atol=1e-5, rtol=0)
    # Both entry points run one function (`teacher_forced_logprobs`). One micro-batch of every
    # row is the same program, bit for bit. Smaller ones change the matmul shapes, and XLA:CPU
    # then reduces in another order: the unbatched path itself gives up to 1.2e-6 (~5 fp32 ulps
    # at |logp| 2.7) apart on 3 rows vs all 10 on some CPUs. So they agree to a few ulps, not bits.
    whole = np.asarray(dense_logprobs(model, None, tokens_bt, micro_batch_size=len(tokens_bt)))
    np.testing.assert_array_equal(whole, dense_bt)
    np.testing.assert_array_equal(learner_bt, dense_bt)
    micro = np.asarray(dense_logprobs(model, None, tokens_bt, micro_batch_size=3))
    np.testing.assert_allclose(micro, dense_bt, atol=1e-6, rtol=1e-6)
    for m in (2, 5):
        micro = np.asarray(pi_old(model, tokens_bt, num_micro_batches=m))
        np.testing.assert_allclose(micro, learner_bt, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_greedy_equals_stepwise_argmax(model):
    res = RolloutEngine(model, config(temperature=0.0, num_slots=3)).generate(PROMPTS)
    np.testing.assert_array_equal(res.completion_ids, stepwise_greedy(model, PROMPTS, MAX_NEW))
    # Greedy records T = 1 logprobs.
    tokens_bt, mask_bt, sampler_bt = res.sequences()
    dense_bt = np.asarray(dense_logprobs(model, None, tokens_bt, temperature=0.0))
    np.testing.assert_allclose(sampler_bt[mask_bt], dense_bt[mask_bt], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_continuous_batching_equals_static(model, sampled):
    engine, res = sampled
    cfg = engine.config
    static = RolloutEngine(
        model, config(n_samples=2, stop_token_ids=(17,), num_slots=len(PROMPTS) * 2)
    ).generate(PROMPTS, weight_version=7)
    # A pool that holds one sequence at a time: requests wait for pages, not only for slots.
    serial = RolloutEngine(
        model,
        config(n_samples=2, stop_token_ids=(17,), num_slots=3, num_pages=cfg.pages_per_slot),
    ).generate(PROMPTS, weight_version=7)
    for other in (static, serial):
        np.testing.assert_array_equal(other.completion_ids, res.completion_ids)
        np.testing.assert_array_equal(other.completion_lens, res.completion_lens)
        np.testing.assert_array_equal(other.finished_by_stop, res.finished_by_stop)
        np.testing.assert_allclose(other.sampler_logprobs, res.sampler_logprobs, atol=1e-5)
