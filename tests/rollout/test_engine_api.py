"""The engine's public surface: result layout, stop tokens, per-prompt seeds, weight swaps
without recompiling, abandoning a rollout between chunks, the kernels it runs, and configuration
errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.kvcache import CompressionConfig
from sparserl_jax.rollout import RolloutAborted, RolloutConfig, RolloutEngine
from sparserl_jax.testing import tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [1], [2, 3, 4, 5, 6]]
MAX_NEW = 9


def config(**kw) -> RolloutConfig:
    base = dict(
        num_slots=2, max_prompt_len=6, max_new_tokens=MAX_NEW, temperature=1.0, chunk_steps=4
    )
    base.update(kw)
    return RolloutConfig(**base)


@pytest.fixture(scope="module")
def sampled():
    engine = RolloutEngine(tiny_model(seed=3), config(n_samples=2, stop_token_ids=(17,)))
    return engine, engine.generate(PROMPTS, weight_version=7)


def test_result_layout_and_stop_tokens(sampled):
    _, res = sampled
    n = len(PROMPTS) * 2
    assert res.completion_ids.shape == res.sampler_logprobs.shape == (n, MAX_NEW)
    assert res.prompt_ids == [PROMPTS[r // 2] for r in range(n)]
    assert res.prompt_lens.tolist() == [len(PROMPTS[r // 2]) for r in range(n)]
    assert (res.weight_version == 7).all() and (res.tokens_evicted == 0).all()
    for r in range(n):
        k = res.completion_lens[r]
        row = res.completion_ids[r]
        assert res.completion_mask[r].tolist() == [True] * k + [False] * (MAX_NEW - k)
        assert (row[k:] == 0).all() and (res.sampler_logprobs[r, k:] == 0).all()
        stops = np.flatnonzero(row[:k] == 17)
        if res.finished_by_stop[r]:
            assert stops.tolist() == [k - 1]  # the stop token is included and ends it
        else:
            assert k == MAX_NEW and stops.size == 0
    assert res.stats["generated_tokens"] == res.completion_lens.sum()
    assert res.stats["kv_peak_bytes"] > 0
    # Dense, 2 slots: each keeps its prompt and every token fed back (the last one never is).
    longest = (res.prompt_lens + res.completion_lens - 1).max()
    assert res.prompt_lens.max() < res.stats["kv_peak_tokens"] <= 2 * longest


def test_per_prompt_seeds_follow_the_prompt(sampled):
    engine, _ = sampled
    seeds = [11, 22, 33, 44, 55]
    a = engine.generate(PROMPTS, seeds=seeds)
    order = [3, 0, 4, 2, 1]
    b = engine.generate([PROMPTS[i] for i in order], seeds=[seeds[i] for i in order])
    for new, old in enumerate(order):
        for j in range(2):
            np.testing.assert_array_equal(
                b.completion_ids[new * 2 + j], a.completion_ids[old * 2 + j]
            )
    assert not np.array_equal(a.completion_ids[0], a.completion_ids[1])  # samples differ
    again = engine.generate(PROMPTS, seeds=seeds)
    np.testing.assert_array_equal(again.completion_ids, a.completion_ids)


@pytest.mark.slow
def test_new_weights_do_not_recompile():
    engine = RolloutEngine(tiny_model(seed=3), config(temperature=0.0, max_new_tokens=4))
    engine.generate(PROMPTS[:2])
    compiled = (engine._prefill._cache_size(), engine._chunk._cache_size())
    other = tiny_model(seed=8)
    params = nnx.to_pure_dict(nnx.state(other))
    res = engine.generate(PROMPTS[:2], params=params, weight_version=1)
    assert (engine._prefill._cache_size(), engine._chunk._cache_size()) == compiled
    assert (res.weight_version == 1).all()
    # The tokens are greedy under the new weights: each is the argmax of `other`'s forward.
    tokens_bt, mask_bt, _ = res.sequences()
    argmax_bt = np.asarray(jnp.argmax(other(jnp.asarray(tokens_bt)), axis=-1))
    np.testing.assert_array_equal(
        tokens_bt[:, 1:][mask_bt[:, 1:]], argmax_bt[:, :-1][mask_bt[:, 1:]]
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_slots=0), "num_slots"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(stop_token_ids=(3, -1)), "stop_token_ids"),
        (dict(num_pages=1, page_size=4), "num_pages"),
        (dict(kernel_impl="cuda"), "kernel_impl"),
    ],
)
def test_config_errors_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        config(**kw)


def test_prompt_errors(sampled):
    engine, _ = sampled
    with pytest.raises(ValueError, match="max_prompt_len"):
        engine.generate([[1] * 7])
    with pytest.raises(ValueError, match="seeds"):
        engine.generate(PROMPTS, seeds=[1, 2])
    with pytest.raises(ValueError, match="n_samples must be an int >= 1, got 0"):
        engine.generate(PROMPTS, n_samples=0)


def test_a_call_may_ask_another_group_size(sampled):
    """`generate(n_samples=k)`: k completions per prompt instead of the config's 2, sample j
    of a prompt drawn with the same key as in the config's group (so the same tokens), and no
    new program compiled."""
    engine, _ = sampled
    seeds = [11, 22, 33, 44, 55]
    group = engine.generate(PROMPTS, seeds=seeds)
    compiled = (engine._prefill._cache_size(), engine._chunk._cache_size())
    for k in (1, 3):
        res = engine.generate(PROMPTS, seeds=seeds, n_samples=k)
        assert res.completion_ids.shape == (len(PROMPTS) * k, MAX_NEW)
        assert res.prompt_ids == [PROMPTS[r // k] for r in range(len(PROMPTS) * k)]
        for j in range(min(k, 2)):
            np.testing.assert_array_equal(res.completion_ids[j::k], group.completion_ids[j::2])
    assert (engine._prefill._cache_size(), engine._chunk._cache_size()) == compiled


def test_stop_hook_abandons_the_rollout_between_chunks(sampled):
    engine, res = sampled
    asked = []

    def stop():
        asked.append(1)
        return len(asked) > 2  # two chunks run, then the rollout is abandoned

    with pytest.raises(RolloutAborted, match="after 2 decode chunks"):
        engine.generate(PROMPTS, weight_version=7, stop=stop)
    again = engine.generate(PROMPTS, weight_version=7, stop=lambda: False)  # nothing left over
    np.testing.assert_array_equal(again.completion_ids, res.completion_ids)


def test_kernel_impl_reaches_the_cache_and_keeps_the_tokens(monkeypatch):
    """`rollout.kernel_impl` picks the cache ops' implementation without the environment (which
    would also change the learner's attention): the GPU kernels, interpreted on this CPU, decode
    the tokens and logprobs XLA does, R-KV's scoring and compaction included."""
    monkeypatch.delenv("SPARSERL_KERNEL_IMPL", raising=False)
    kv = CompressionConfig(policy="rkv", budget=8, window=2, interval=4)
    model, got = tiny_model(seed=3), {}
    for impl in ("xla", "pallas_gpu"):
        engine = RolloutEngine(model, config(kernel_impl=impl, kv=kv, page_size=4))
        assert engine._empty()[0].impl == impl
        got[impl] = engine.generate(PROMPTS[:2])
    assert got["xla"].tokens_evicted.sum() > 0
    np.testing.assert_array_equal(got["xla"].completion_ids, got["pallas_gpu"].completion_ids)
    a, b = got["xla"].sampler_logprobs, got["pallas_gpu"].sampler_logprobs
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
