"""Weights taken mid-rollout (partial rollouts, `RolloutEngine.generate(refresh=...)`).

Between decode chunks the engine takes newer weights and continues every sequence in flight
with them; the keys and values already cached stay those of the weights that computed them
(PipelineRL's in-flight update; no re-prefill). Each token records the version whose logits it
was sampled from, and its behaviour logprob is exactly that policy's:

- tokens sampled before the swap: the teacher-forced logprobs of the old weights (<= 1e-5);
- tokens after it: the logprobs of a dense-cache reference that runs the positions before the
  swap through the old weights and the rest through the new ones (<= 1e-5), which is not the
  teacher-forced policy of the new weights (the cached prefix is the old weights');
- a refresh that brings nothing changes nothing, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.models.cache import DenseKVCache
from sparserl_jax.rollout import RolloutConfig, RolloutEngine, dense_logprobs
from sparserl_jax.testing import tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
MAX_NEW, CHUNK = 12, 4


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=3), tiny_model(seed=4)  # versions 7 and 8


def _engine(model):
    cfg = RolloutConfig(
        num_slots=4, max_prompt_len=6, max_new_tokens=MAX_NEW, temperature=1.0, chunk_steps=CHUNK
    )
    return RolloutEngine(model, cfg)


def _once(params, version):
    """A refresh hook that brings `(params, version)` at its first call, nothing after."""
    calls = []

    def refresh():
        calls.append(1)
        return (params, version) if len(calls) == 1 else None

    return refresh


def _mixed_logprobs(old, new, prompt, tokens, swap):
    """Logprob of completion token j (j >= 1) when inputs before completion token `swap - 1`
    ran through `old` and the rest through `new`, on a dense cache: token j's logits come from
    the forward of the input before it."""
    cfg = old.cfg
    cache = DenseKVCache.create(
        num_layers=cfg.num_layers,
        batch=1,
        max_len=len(prompt) + len(tokens),
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=cfg.compute_dtype,
    )
    head = jnp.asarray([prompt + tokens[: swap - 1]])
    logits_old, cache = old.decode(head, cache)
    tail = jnp.asarray([tokens[swap - 1 : -1]])
    logits_new, _ = new.decode(tail, cache)
    logits = jnp.concatenate([logits_old[:, len(prompt) :], logits_new], axis=1)[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return np.asarray(logp[jnp.arange(len(tokens) - 1), jnp.asarray(tokens[1:])])


def test_tokens_after_the_swap_follow_the_new_weights_on_the_old_cache(models):
    old, new = models
    engine = _engine(old)
    params_new = nnx.to_pure_dict(nnx.state(new))
    res = engine.generate(PROMPTS, weight_version=7, seeds=[1, 2, 3], refresh=_once(params_new, 8))
    # Chunk 1 (weights 7) samples tokens 0-3 and computes token 4's logits; chunk 2 (weights 8)
    # samples token 4 from those, then tokens 5... from its own forwards.
    swap = CHUNK + 1
    assert (res.completion_lens > swap + 1).all(), res.completion_lens
    for r in range(len(PROMPTS)):
        n = int(res.completion_lens[r])
        want = np.where(np.arange(n) < swap, 7, 8)
        np.testing.assert_array_equal(res.token_version[r, :n], want)
    np.testing.assert_array_equal(res.weight_version, [7, 7, 7])
    tokens_bt, mask_bt, logp_bt = res.sequences()
    # Before the swap: the old weights' teacher-forced policy.
    tf_old = np.asarray(dense_logprobs(old, None, tokens_bt, temperature=1.0))
    tf_new = np.asarray(dense_logprobs(new, None, tokens_bt, temperature=1.0))
    far = 0.0
    for r, prompt in enumerate(PROMPTS):
        p, n = len(prompt), int(res.completion_lens[r])
        np.testing.assert_allclose(logp_bt[r, p : p + swap], tf_old[r, p : p + swap], atol=1e-5)
        toks = res.completion_ids[r, :n].tolist()
        mixed = _mixed_logprobs(old, new, prompt, toks, swap)
        np.testing.assert_allclose(res.sampler_logprobs[r, swap:n], mixed[swap - 1 :], atol=1e-5)
        far = max(far, np.abs(logp_bt[r, p + swap : p + n] - tf_new[r, p + swap : p + n]).max())
    assert far > 1e-3  # the new weights' own teacher-forced policy is another one


def test_a_refresh_that_brings_nothing_changes_nothing(models):
    old, _ = models
    engine = _engine(old)
    plain = engine.generate(PROMPTS, weight_version=7, seeds=[1, 2, 3])
    asked = engine.generate(PROMPTS, weight_version=7, seeds=[1, 2, 3], refresh=lambda: None)
    for k in ("completion_ids", "sampler_logprobs", "completion_lens", "token_version"):
        np.testing.assert_array_equal(getattr(asked, k), getattr(plain, k))
    assert (plain.token_version[plain.completion_mask] == 7).all()


def test_a_recomputed_cache_follows_each_versions_teacher_forced_policy(models):
    """`recompute_cache`: at the swap every sequence is prefilled again with the new weights,
    so the tokens after it follow the new weights' teacher-forced policy and those before it
    the old one's (the issue's contract for partial rollouts, on a dense cache)."""
    old, new = models
    engine = _engine(old)
    params_new = nnx.to_pure_dict(nnx.state(new))
    res = engine.generate(
        PROMPTS,
        weight_version=7,
        seeds=[1, 2, 3],
        refresh=_once(params_new, 8),
        recompute_cache=True,
    )
    swap = CHUNK  # chunk 1 samples tokens 0-3; the rebuilt cache's logits sample token 4 on
    assert (res.completion_lens > swap + 1).all(), res.completion_lens
    tokens_bt, mask_bt, logp_bt = res.sequences()
    tf_old = np.asarray(dense_logprobs(old, None, tokens_bt, temperature=1.0))
    tf_new = np.asarray(dense_logprobs(new, None, tokens_bt, temperature=1.0))
    for r, prompt in enumerate(PROMPTS):
        p, n = len(prompt), int(res.completion_lens[r])
        np.testing.assert_array_equal(res.token_version[r, :n], np.where(np.arange(n) < swap, 7, 8))
        np.testing.assert_allclose(logp_bt[r, p : p + swap], tf_old[r, p : p + swap], atol=1e-5)
        np.testing.assert_allclose(
            logp_bt[r, p + swap : p + n], tf_new[r, p + swap : p + n], atol=1e-5
        )
    # The same seeds draw the same tokens before the swap as a rollout that never swapped.
    plain = engine.generate(PROMPTS, weight_version=7, seeds=[1, 2, 3])
    np.testing.assert_array_equal(res.completion_ids[:, :swap], plain.completion_ids[:, :swap])


def test_a_compressed_cache_cannot_be_recomputed(models):
    old, _ = models
    from sparserl_jax.kvcache import CompressionConfig

    cfg = RolloutConfig(
        num_slots=4,
        max_prompt_len=6,
        max_new_tokens=MAX_NEW,
        chunk_steps=CHUNK,
        kv=CompressionConfig(policy="streaming", budget=8, window=4),
    )
    with pytest.raises(ValueError, match="recompute_cache needs a dense cache"):
        RolloutEngine(old, cfg).generate(PROMPTS, refresh=lambda: None, recompute_cache=True)
