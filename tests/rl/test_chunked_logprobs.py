"""The chunked LM head (`rollout.head_logprobs`) against the unchunked computation.

Logprobs, entropies and their gradients equal `model.logits` followed by the per-token maths
(tied and untied heads, T - 1 not a multiple of the chunk, temperature != 1); the learner step
equals the old step that held `[B, T, V]` logits (params after a step, DGG's lm_head energy,
every metric); pi_old equals the unchunked recompute; and no `[B, T, V]` array is left in the
step's program.

Tolerances: fp32, 1e-6. The chunked matmul has other shapes than the whole-sequence one, so
XLA:CPU rounds differently by a few ulps: values are ~log(V) = 4.2 (1 ulp = 4.8e-7), hence
rtol 1e-6 next to atol 1e-6; the losses are token means, as the learner's are, so gradients are
O(1) and their chunk-by-chunk sums differ from one contraction by ulps of that.
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.models.transformer import head_logits
from sparserl_jax.rl import learner as learner_mod
from sparserl_jax.rl.config import LearnerConfig, LossConfig, OptimizerConfig
from sparserl_jax.rl.learner import Learner
from sparserl_jax.rl.losses import LOG_RATIO_BOUND, kl_penalty
from sparserl_jax.rl.objective import with_embedding
from sparserl_jax.rl.policy_losses import compute_policy_loss
from sparserl_jax.rollout import dense_logprobs, head_logprobs, teacher_forced_logprobs
from sparserl_jax.rollout.sampling import entropy_from_logits, shifted_token_logprobs
from sparserl_jax.testing import tiny_model
from sparserl_jax.testing.learner import config, host, make_batch, with_old

TOL = dict(atol=1e-6, rtol=1e-6)


def unchunked(cfg, w, h_btd, tokens_bt, temperature):
    """The computation before chunking: whole `[B, T, V]` logits, then the per-token maths."""
    logits_btv = head_logits(h_btd, w, tied=cfg.tie_embeddings, dtype=cfg.compute_dtype)
    logp_bt = shifted_token_logprobs(logits_btv, tokens_bt, temperature=temperature)
    ent_bt = entropy_from_logits(logits_btv[:, :-1], temperature=temperature)
    return logp_bt, jnp.pad(ent_bt, ((0, 0), (1, 0)))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_unchunked(tied, temperature):
    model = tiny_model(seed=1, tie_embeddings=tied)
    cfg = model.cfg
    b, t = 3, 21  # 20 predicting positions: chunks of 3 and 8 leave a padded last chunk
    tokens_bt = jax.random.randint(jax.random.key(0), (b, t), 0, cfg.vocab_size)
    h_btd = model.hidden_states(tokens_bt)
    w = model.head_weight()
    ka, kb = jax.random.split(jax.random.key(1))
    a_bt = jax.random.normal(ka, (b, t)) / (b * t)
    c_bt = jax.random.normal(kb, (b, t)) / (b * t)

    def loss(fn):
        def f(w, h):
            logp_bt, ent_bt = fn(w, h)
            return jnp.sum(a_bt * logp_bt + c_bt * ent_bt), (logp_bt, ent_bt)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    (_, want), want_g = loss(lambda w, h: unchunked(cfg, w, h, tokens_bt, temperature))(w, h_btd)
    for chunk in (1, 3, 8, 20, 512):
        (_, got), got_g = loss(
            lambda w, h, c=chunk: head_logprobs(
                cfg,
                w,
                h,
                tokens_bt,
                temperature=temperature,
                chunk_size=c,
                entropy=True,
                entropy_grad=True,
            )
        )(w, h_btd)
        for name, x, y in zip(
            ("logp", "entropy", "d/dW", "d/dh"), got + got_g, want + want_g, strict=True
        ):
            np.testing.assert_allclose(x, y, **TOL, err_msg=f"{name}, chunk {chunk}")
        assert np.all(np.asarray(got[0][:, 0]) == 0) and np.all(np.asarray(got[1][:, 0]) == 0)


def test_entropy_without_grad_and_bad_chunk():
    model = tiny_model(seed=2)
    tokens_bt = jax.random.randint(jax.random.key(3), (2, 9), 0, model.cfg.vocab_size)
    h_btd = model.hidden_states(tokens_bt)
    w = model.head_weight()

    def ent_sum(w, grad):
        _, ent = head_logprobs(
            model.cfg,
            w,
            h_btd,
            tokens_bt,
            temperature=1.0,
            chunk_size=4,
            entropy=True,
            entropy_grad=grad,
        )
        return jnp.sum(ent)

    assert float(jnp.abs(jax.grad(ent_sum)(w, True)).max()) > 0
    assert float(jnp.abs(jax.grad(ent_sum)(w, False)).max()) == 0
    logp, ent = head_logprobs(model.cfg, w, h_btd, tokens_bt, temperature=1.0)
    assert ent is None and logp.shape == tokens_bt.shape
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        head_logprobs(model.cfg, w, h_btd, tokens_bt, temperature=1.0, chunk_size=0)
    with pytest.raises(ValueError, match="logits_chunk_size must be >= 1, got -1"):
        LearnerConfig(logits_chunk_size=-1)
    with pytest.raises(ValueError, match="logits_chunk_size must be >= 1, got 0"):
        dense_logprobs(model, None, tokens_bt, logits_chunk_size=0)


@pytest.mark.parametrize("tied", [False, True])
def test_teacher_forced_logprobs_equal_unchunked(tied):
    """pi_old / pi_ref: micro-batched, explicit positions, chunked head vs `model(tokens)`."""
    model = tiny_model(seed=4, tie_embeddings=tied)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tokens_bt = jax.random.randint(jax.random.key(5), (4, 13), 0, model.cfg.vocab_size)
    positions_bt = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32) + 2, (4, 13))
    want = jax.jit(
        lambda p: shifted_token_logprobs(
            nnx.merge(graphdef, p)(tokens_bt, positions=positions_bt), tokens_bt, temperature=0.8
        )
    )(params)
    for m, chunk in ((1, 5), (2, 5), (2, 12), (4, 1)):
        got = jax.jit(
            lambda p, m=m, c=chunk: teacher_forced_logprobs(
                graphdef,
                p,
                tokens_bt,
                positions_bt,
                temperature=0.8,
                num_micro_batches=m,
                chunk_size=c,
            )
        )(params)
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"M={m}, chunk {chunk}")


def _old_micro_loss(params, head_w, mb, *, graphdef, config: LearnerConfig, tied):
    """The learner's micro-batch loss before chunking (a copy of the old code): `[B, T, V]`
    logits from `model.logits`, the head reading its own copy `head_w` when tied."""
    loss_cfg, temp = config.loss, config.loss.temperature
    model = nnx.merge(graphdef, params)
    h_btd = model.hidden_states(mb["tokens"])
    head = nnx.merge(graphdef, with_embedding(params, head_w)) if tied else model
    logits_btv = head.logits(h_btd)
    logp_bt = shifted_token_logprobs(logits_btv, mb["tokens"], temperature=temp)
    old_bt = mb["old_logp"]
    pg_bt, clip_bt = compute_policy_loss(
        logp_bt,
        old_bt,
        mb["adv"],
        mb.get("mask"),
        loss=loss_cfg.policy_loss,
        eps_low=loss_cfg.eps_low,
        eps_high=loss_cfg.eps_high,
        dual_clip=loss_cfg.dual_clip,
    )
    pg_loss = jnp.sum(mb["pg_coef"] * pg_bt)
    loss = pg_loss
    ent_bt = jnp.pad(entropy_from_logits(logits_btv[:, :-1], temperature=temp), ((0, 0), (1, 0)))
    tok_w = mb["tok_w"]
    kl = jnp.zeros((), jnp.float32)
    if "ref_logp" in mb:
        kl_bt = kl_penalty(logp_bt, mb["ref_logp"], estimator=loss_cfg.kl_estimator)
        loss = loss + loss_cfg.kl_coef * jnp.sum(mb["reg_coef"] * kl_bt)
        kl = jnp.sum(tok_w * kl_bt)
    if loss_cfg.entropy_coef > 0:
        loss = loss - loss_cfg.entropy_coef * jnp.sum(mb["reg_coef"] * ent_bt)
    ratio_bt = jnp.exp(jnp.clip(logp_bt - old_bt, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    aux = {
        "loss": loss,
        "pg_loss": pg_loss,
        "kl": kl,
        "entropy": jnp.sum(tok_w * jax.lax.stop_gradient(ent_bt)),
        "clip_fraction": jnp.sum(tok_w * clip_bt),
        "approx_kl": jnp.sum(tok_w * kl_penalty(old_bt, logp_bt, k3_clamp=None)),
        "ratio_max": jnp.max(jnp.where(tok_w > 0, ratio_bt, 0.0)),
    }
    return loss, jax.lax.stop_gradient(aux)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_learner_step_equals_unchunked_step(tied, monkeypatch):
    """Params after a step, DGG's lm_head energy and every metric: chunks of 3 over T - 1 = 9
    (a padded last chunk), KL to a reference, an entropy bonus, temperature 0.9."""
    model = tiny_model(seed=6, tie_embeddings=tied)
    loss = LossConfig.dapo(kl_coef=0.05, entropy_coef=0.01, temperature=0.9)
    # Adam's first step is lr * g / (|g| + eps): with eps = 1e-8 a gradient entry of ~1e-7 turns
    # a 1e-3 relative rounding difference of g (another summation order over the chunks) into
    # 1e-6 of the parameter (seen on a fresh venv: [1, 11] off by 1.5e-6). eps = 1e-3 keeps the
    # update Lipschitz in g with constant lr / eps = 1, so the params compare g itself.
    opt = OptimizerConfig(learning_rate=1e-3, weight_decay=0.01, eps=1e-3)
    cfg = config(loss=loss, logits_chunk_size=3, optimizer=opt)
    learner = Learner(model, cfg)
    state = learner.init(model)
    batch = with_old(learner, state, make_batch(seed=7))
    ref = tiny_model(seed=8, tie_embeddings=tied)
    batch = batch._replace(ref_logp_bt=learner.logprobs(learner.init(ref).params, batch.tokens_bt))
    params0 = host(state.params)

    got_state, got = learner.step(state, batch, 1)
    got_state, got = host(got_state), host(got)

    monkeypatch.setattr(learner_mod, "_micro_loss", _old_micro_loss)
    old = Learner(model, cfg)  # a fresh jit cache: its step traces the old loss
    want_state, want = old.step(old.init(model), batch, 1)
    want_state, want = host(want_state), host(want)

    assert bool(got["applied"]) and bool(want["applied"])
    assert got["dgg/g"] > 0
    for k in want:
        np.testing.assert_allclose(got[k], want[k], **TOL, err_msg=k)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), want_state.params, params0)
    assert max(jax.tree.leaves(moved)) > 1e-4
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(got_state.params),
        jax.tree.leaves(want_state.params),
        strict=True,
    ):
        np.testing.assert_allclose(x, y, **TOL, err_msg=jax.tree_util.keystr(path))


def _avals(jaxpr):
    """Every intermediate's abstract value in a closed jaxpr, sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _avals(sub)


def test_learner_step_holds_no_sequence_logits():
    """The compiled step's program has `[.., chunk, V]` logits, never `[.., T or T - 1, V]`."""
    model = tiny_model(seed=6)
    v = model.cfg.vocab_size
    learner = Learner(model, config(num_micro_batches=1, logits_chunk_size=4))
    state = learner.init(model)
    batch = with_old(learner, state, make_batch(seed=7))  # T = 10: chunks of 4, 4, 1 + padding
    t = batch.tokens_bt.shape[1]
    step = learner._compiled_step(batch)
    jaxpr = jax.make_jaxpr(step)(state, batch, jnp.int32(1), jnp.float32(jnp.inf))
    with_v = [a.shape for a in _avals(jaxpr.jaxpr) if v in getattr(a, "shape", ())]
    assert any(s[-2:] == (4, v) for s in with_v), with_v
    long = [s for s in with_v if {t, t - 1, 12} & set(s)]
    assert long == [], f"sequence-long logits in the learner step: {long}"
