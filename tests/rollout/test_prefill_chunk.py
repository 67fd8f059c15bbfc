"""`rollout.prefill_chunk` changes how prefill is scheduled (slots per step of its loop), never
what is sampled: tokens equal, logprobs and evictions equal, for greedy and sampled decoding with
the same keys, dense and compressed, with continuous batching (refills of a few slots)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparserl_jax.kvcache import CompressionConfig
from sparserl_jax.rollout import RolloutConfig, RolloutEngine
from sparserl_jax.testing import tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 3, 4], [9, 10, 11], [11, 12, 13, 14, 15, 2], [3], [7, 8, 2, 2, 1]]


@pytest.mark.parametrize(
    ("temperature", "kv"),
    [
        (0.0, None),
        (1.0, None),
        (1.0, CompressionConfig(policy="rkv", budget=12, window=3, interval=4)),
    ],
    ids=["greedy-dense", "sampled-dense", "sampled-rkv"],
)
def test_prefill_chunk_does_not_change_results(temperature, kv):
    model = tiny_model(seed=3)
    # 4 slots for 10 requests: the first prefill fills all 4, later ones refill a few slots.
    base = RolloutConfig(
        num_slots=4,
        max_prompt_len=7,
        max_new_tokens=20,
        temperature=temperature,
        n_samples=2,
        chunk_steps=5,
        page_size=4,
        kv=kv,
        seed=11,
    )
    results = [
        RolloutEngine(model, dataclasses.replace(base, prefill_chunk=chunk)).generate(PROMPTS)
        for chunk in (4, 3, 1)  # one group, groups with a remainder, one slot per group
    ]
    one = results[0]
    assert one.completion_lens.sum() > 0
    for res in results[1:]:
        np.testing.assert_array_equal(res.completion_ids, one.completion_ids)
        np.testing.assert_array_equal(res.completion_lens, one.completion_lens)
        np.testing.assert_array_equal(res.tokens_evicted, one.tokens_evicted)
        np.testing.assert_allclose(res.sampler_logprobs, one.sampler_logprobs, atol=1e-5)


def test_prefill_chunk_validated():
    with pytest.raises(ValueError, match="prefill_chunk"):
        RolloutConfig(prefill_chunk=0)
