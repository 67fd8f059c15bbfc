"""Prefill computes only the logits sampling needs: each prompt's last token's, never `[S, P, V]`.

`Transformer.decode(..., logits_at_bk)` equals the full decode's logits at those positions bit
for bit; the engine's outputs (tokens, logprobs, lengths, evictions) equal bit for bit those of
the engine as it was (a copy of the old prefill, which projected every prompt position); and the
prefill program holds no array with both the prompt length and the vocabulary in its shape.
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.kvcache import CompressionConfig
from sparserl_jax.kvcache.evictions import NEVER
from sparserl_jax.models.cache import DenseKVCache
from sparserl_jax.rollout import RolloutConfig, RolloutEngine
from sparserl_jax.rollout.engine import SlotState
from sparserl_jax.rollout.sampling import request_keys
from sparserl_jax.testing import tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [9, 10], [11, 12, 13], [1], [2, 3, 4, 5, 6]]
P = 7  # max_prompt_len: distinct from every other dimension of the tiny model's arrays


class OldPrefillEngine(RolloutEngine):
    """The engine with its prefill as it was: logits for every prompt position, then a gather."""

    def _prefill_impl(self, params, cache, slots: SlotState, tokens_sp, lens_s, fill_s, req_s4):
        model = nnx.merge(self.graphdef, params)
        keys_s2 = request_keys(
            req_s4[:, 0].astype(jnp.uint32), req_s4[:, 1], req_s4[:, 2], req_s4[:, 3] > 0
        )
        p = tokens_sp.shape[1]
        mask_sp = (jnp.arange(p, dtype=jnp.int32)[None, :] < lens_s[:, None]) & fill_s[:, None]
        logits_spv, cache = model.decode(tokens_sp, cache, mask_sp)
        last_s = jnp.maximum(lens_s - 1, 0)
        last_sv = jnp.take_along_axis(logits_spv, last_s[:, None, None], axis=1)[:, 0]
        zero_s = jnp.zeros_like(slots.generated_s)
        slots = SlotState(
            logits_sv=jnp.where(fill_s[:, None], last_sv.astype(jnp.float32), slots.logits_sv),
            keys_s2=jnp.where(fill_s[:, None], keys_s2, slots.keys_s2),
            active_s=slots.active_s | fill_s,
            generated_s=jnp.where(fill_s, zero_s, slots.generated_s),
            stopped_s=slots.stopped_s & ~fill_s,
            evicted_s=jnp.where(fill_s, zero_s, slots.evicted_s),
            first_evicted_s=jnp.where(fill_s, NEVER, slots.first_evicted_s),
        )
        return cache, slots


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def config(**kw) -> RolloutConfig:
    base = dict(
        num_slots=2,
        max_prompt_len=P,
        max_new_tokens=9,
        temperature=1.0,
        chunk_steps=4,
        n_samples=2,
        stop_token_ids=(17,),
    )
    return RolloutConfig(**(base | kw))


def test_decode_logits_at_equal_full_decode(model):
    cfg = model.cfg
    tokens_bp = jnp.asarray(
        [[3, 4, 5, 6, 7, 8, 9], [10, 11, 0, 0, 0, 0, 0], [12, 0, 0, 0, 0, 0, 0]]
    )
    lens_b = jnp.asarray([7, 2, 1])
    mask_bp = jnp.arange(P)[None, :] < lens_b[:, None]

    def run(at_bk):
        cache = DenseKVCache.create(
            num_layers=cfg.num_layers,
            batch=3,
            max_len=12,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=cfg.compute_dtype,
        )
        return model.decode(tokens_bp, cache, mask_bp, at_bk)

    full_bpv, full_cache = jax.jit(lambda: run(None))()
    at_bk = jnp.stack([lens_b - 1, jnp.zeros_like(lens_b)], axis=1)
    got_bkv, got_cache = jax.jit(run)(at_bk)
    assert got_bkv.shape == (3, 2, cfg.vocab_size) and got_bkv.dtype == jnp.float32
    want_bkv = jnp.take_along_axis(full_bpv, at_bk[:, :, None], axis=1)
    np.testing.assert_array_equal(np.asarray(got_bkv), np.asarray(want_bkv))
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(full_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _prefill_jaxpr(engine: RolloutEngine):
    s = engine.config.num_slots
    cache, slots = engine._init()
    return jax.make_jaxpr(engine._prefill_impl)(
        engine.default_params,
        cache,
        slots,
        jnp.zeros((s, P), jnp.int32),
        jnp.ones((s,), jnp.int32),
        jnp.ones((s,), bool),
        jnp.zeros((s, 4), jnp.uint32),
    )


def _avals(jaxpr):
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _avals(sub)


@pytest.mark.parametrize("cls", [RolloutEngine, OldPrefillEngine])
def test_prefill_holds_no_prompt_logits(model, cls):
    v = model.cfg.vocab_size
    jaxpr = _prefill_jaxpr(cls(model, config()))
    spv = [a.shape for a in _avals(jaxpr.jaxpr) if {P, v} <= set(getattr(a, "shape", ()))]
    if cls is OldPrefillEngine:  # the check sees the old program's [S, P, V] logits
        assert (2, P, v) in spv
    else:
        assert spv == [], f"prefill holds prompt-long logits: {spv}"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "rkv"])
def test_engine_outputs_equal_old_prefill_bit_for_bit(model, policy):
    """Dense, and R-KV (its window scoring reads the queries prefill records, not logits)."""
    if policy == "none":
        kv, cfg = None, config()
    else:
        kv = CompressionConfig(policy=policy, budget=8, window=3, interval=4)
        cfg = config(kv=kv, max_new_tokens=20, page_size=4)
    got = RolloutEngine(model, cfg).generate(PROMPTS, weight_version=3)
    want = OldPrefillEngine(model, cfg).generate(PROMPTS, weight_version=3)
    assert got.completion_lens.sum() > 0
    for name in (
        "completion_ids",
        "sampler_logprobs",
        "completion_mask",
        "completion_lens",
        "tokens_evicted",
        "finished_by_stop",
    ):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    if kv:
        assert got.tokens_evicted.sum() > 0
