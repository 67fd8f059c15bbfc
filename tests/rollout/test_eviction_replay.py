"""The sparse engine contract: with the sampler's evictions recorded (`rollout.record_evictions`)
and replayed in the attention (`kvcache.evictions`), teacher-forced logprobs equal the sparse
sampler's logprobs (fp32, <= 1e-5) for every policy and granularity, on the chunked and the
dense attention; the dense path without a record is unchanged; the record itself is checked
against a hand count (evictions happen where the budget forces them, and never of the newest
window)."""

from __future__ import annotations

import numpy as np
import pytest

from sparserl_jax.kvcache import CompressionConfig
from sparserl_jax.kvcache.evictions import NEVER, record_evictions
from sparserl_jax.rl import Learner, LearnerConfig
from sparserl_jax.rollout import RolloutConfig, RolloutEngine, dense_logprobs
from sparserl_jax.testing import tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [9, 10], [11, 12, 13, 14], [3, 4, 5, 6, 7, 8]]
MAX_NEW = 26


def _run(model, policy: str, granularity: str, **kw):
    kv = CompressionConfig(
        policy=policy, budget=8, window=2, interval=3, granularity=granularity, sink_tokens=2
    )
    cfg = RolloutConfig(
        num_slots=3,
        max_prompt_len=7,
        max_new_tokens=MAX_NEW,
        temperature=1.0,
        chunk_steps=5,
        n_samples=2,
        kv=kv,
        page_size=4,
        record_evictions=True,
        **kw,
    )
    return RolloutEngine(model, cfg).generate(PROMPTS, weight_version=1)


def _check_replay(model, res, *, atol=1e-5):
    tokens_bt, mask_bt, sampler_bt = res.sequences()
    ev = res.evictions(tokens_bt.shape[1])
    replay = np.asarray(dense_logprobs(model, None, tokens_bt, evict_pos_bykt=ev))
    np.testing.assert_allclose(sampler_bt[mask_bt], replay[mask_bt], atol=atol, rtol=0)
    dense = np.asarray(dense_logprobs(model, None, tokens_bt))
    return float(np.max(np.abs(dense - sampler_bt)[mask_bt]))


FAST = {("rkv", "head"), ("snapkv", "sequence"), ("streaming", "layer")}
CASES = [
    pytest.param(p, g, marks=() if (p, g) in FAST else pytest.mark.slow)
    for p in ("streaming", "snapkv", "h2o", "rkv")
    for g in ("sequence", "layer", "head")
]


@pytest.mark.parametrize("policy, granularity", CASES)
def test_replayed_logprobs_equal_the_sparse_sampler(policy, granularity):
    model = tiny_model(seed=3)
    res = _run(model, policy, granularity)
    y, k = model.cfg.num_layers, model.cfg.num_kv_heads
    want = {"sequence": (1, 1), "layer": (y, 1), "head": (y, k)}[granularity]
    assert res.evict_pos.shape == (len(PROMPTS) * 2, *want, 7 + MAX_NEW)
    assert res.tokens_evicted.sum() > 0
    gap = _check_replay(model, res)
    # Without the replay the learner sees another policy: the contract above is not vacuous.
    assert gap > 1e-3
    _check_first_evicted(res)


def _check_first_evicted(res):
    """`first_evicted` against the record: the first query that lost a key, at position q,
    computes the logits of completion token q + 1 - prompt_len (if that token was drawn)."""
    r = len(res.completion_lens)
    q = res.evict_pos.reshape(r, -1).min(1).astype(np.int64)
    i = q + 1 - res.prompt_lens
    want = np.where((q < NEVER) & (i < res.completion_lens), i, NEVER)
    np.testing.assert_array_equal(res.first_evicted, want)
    assert (want < NEVER).any()
    t = res.sequences()[0].shape[1]
    after = res.after_eviction(t)
    for row in range(r):
        p, n, f = res.prompt_lens[row], res.completion_lens[row], min(want[row], MAX_NEW)
        expect = np.zeros(t, bool)
        expect[p + f : p + n] = True
        np.testing.assert_array_equal(after[row], expect)


def test_the_learner_replays_for_pi_old_and_refuses_without_a_record():
    model = tiny_model(seed=3)
    res = _run(model, "rkv", "layer")
    tokens_bt, mask_bt, sampler_bt = res.sequences()
    learner = Learner(model, LearnerConfig(attention_mask="replay", num_micro_batches=2))
    params = learner.init(model).params
    old = learner.logprobs(params, tokens_bt, res.evictions(tokens_bt.shape[1]))
    np.testing.assert_allclose(sampler_bt[mask_bt], np.asarray(old)[mask_bt], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="rollout.record_evictions"):
        learner.logprobs(params, tokens_bt)


def test_record_counts_match_the_engine_and_spare_the_window():
    model = tiny_model(seed=3)
    res = _run(model, "rkv", "head")
    for r in range(len(res.completion_lens)):
        n = int(res.prompt_lens[r] + res.completion_lens[r])
        ev = res.evict_pos[r]
        assert (ev[..., n:] == NEVER).all()  # positions never written
        evicted = ev[..., :n] != NEVER
        # Every layer / head evicted as many as the engine counted for the sequence.
        assert (evicted.sum(-1) == res.tokens_evicted[r]).all()
        # A key is evicted after it was stored, and never by the step that stored it.
        pos = np.arange(n)
        assert (np.where(evicted, ev[..., :n], NEVER) > pos).all()


def test_dense_attention_and_micro_batches_replay_alike():
    model = tiny_model(seed=3, attention="dense")
    res = _run(model, "h2o", "head")
    _check_replay(model, res)
    tokens_bt, mask_bt, _ = res.sequences()
    ev = res.evictions(tokens_bt.shape[1])
    whole = np.asarray(dense_logprobs(model, None, tokens_bt, evict_pos_bykt=ev))
    micro = np.asarray(
        dense_logprobs(model, None, tokens_bt, evict_pos_bykt=ev, micro_batch_size=3)
    )
    np.testing.assert_allclose(micro[mask_bt], whole[mask_bt], atol=1e-6, rtol=0)


def test_a_dense_rollout_records_nothing_evicted_and_replays_to_dense():
    model = tiny_model(seed=3)
    cfg = RolloutConfig(
        num_slots=3, max_prompt_len=7, max_new_tokens=MAX_NEW, page_size=4, record_evictions=True
    )
    res = RolloutEngine(model, cfg).generate(PROMPTS)
    assert (res.evict_pos == NEVER).all() and res.evict_pos.shape[1:3] == (1, 1)
    assert res.first_evicted is None and res.after_eviction(40) is None
    tokens_bt, mask_bt, sampler_bt = res.sequences()
    replay = np.asarray(
        dense_logprobs(model, None, tokens_bt, evict_pos_bykt=res.evictions(tokens_bt.shape[1]))
    )
    np.testing.assert_array_equal(replay, np.asarray(dense_logprobs(model, None, tokens_bt)))
    np.testing.assert_allclose(sampler_bt[mask_bt], replay[mask_bt], atol=1e-5, rtol=0)


def test_record_evictions_by_hand():
    # One row of 6 stored positions (next_pos 6), one of 3 not compressed; keep entries 0, 2, 5.
    ev = np.full((1, 2, 1, 8), NEVER, np.int32)
    ev[0, 0, 0, 1] = 4  # position 1 was evicted earlier: stored entries are 0, 2, 3, 4, 5, 6
    keep = np.array([[[[0, 2, 5]], [[0, 1, 2]]]], np.int32)
    got = np.asarray(
        record_evictions(ev, keep, np.array([7, 3], np.int32), np.array([True, False]))
    )
    want = ev.copy()
    want[0, 0, 0, [2, 4, 5]] = 7  # entries 1, 3, 4 are positions 2, 4, 5
    np.testing.assert_array_equal(got, want)


def test_splash_and_cudnn_refuse_a_replay():
    from sparserl_jax.models.attention import causal_attention

    q = np.zeros((1, 4, 4, 8), np.float32)
    kv = np.zeros((1, 4, 2, 8), np.float32)
    ev = np.full((1, 2, 4), NEVER, np.int32)
    for impl in ("splash", "cudnn"):
        with pytest.raises(ValueError, match="cannot replay evictions"):
            causal_attention(q, kv, kv, impl=impl, evict_pos_bkt=ev)
