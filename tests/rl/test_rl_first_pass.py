"""pi_old from the first pass's forward (`Learner.first_pass`, `rl.objective`) against the
separate teacher-forced recompute (`Learner.logprobs`) followed by `Learner.step`.

Each case runs pass 1 both ways from the same state and batch, then pass 2 from each one's
pi_old: fp32 and bf16 compute, with and without a mesh (data 2 x fsdp 2 x tensor 2 over the
8 fake devices), one micro-batch (the correction computed in place) and several (batch
statistics applied after the micro-batches), token-mean (DAPO) and sequence-mean (GRPO)
aggregation, with a KL and an entropy term.

Tolerances (state them; never loosen them to pass):
- pi_old: fp32 atol 2e-6, a few ulps of |log p| ~ 4 (1 ulp = 4.8e-7): the first pass and the
  recompute are different XLA programs and XLA:CPU rounds a few entries differently (seen:
  <= 9.5e-7). bf16 compute: seen bit-identical on XLA:CPU (bf16 rounding of every activation
  hides the fp32 ulps); asserted to 1e-2, the effect of one bf16 rounding flip upstream.
- gradients and the metrics made from them: fp32 rtol 1e-5 (accumulation order, and the
  batch statistics divide the sum instead of each term); bf16 rtol 2e-2 (bf16's eps is
  7.8e-3): with M > 1 the backward runs on unnormalised cotangents, which round to other bf16
  values (seen: gradient norm 5e-4 apart after pass 1, the pass-2 loss, a first-order
  function of that update, 5.4e-3).
- parameters after each pass (Adam eps 1e-3: the update is Lipschitz in the gradient with
  constant lr / eps = 1, so parameters compare gradients): fp32 atol 1e-6 (seen 2.4e-7),
  bf16 atol 5e-4 (seen 2.4e-4 after two passes).
A pi_old off by one row (checked below) is off by O(1), far outside all of them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from sparserl_jax.parallel import MeshConfig, make_mesh
from sparserl_jax.rl.config import LossConfig, OptimizerConfig
from sparserl_jax.rl.correction import SparseRLCorrectionConfig, sparse_rl_weights
from sparserl_jax.rl.gating import DGGConfig
from sparserl_jax.rl.learner import Learner
from sparserl_jax.rl.objective import first_pass_fallback
from sparserl_jax.step import old_logp_recompute_reason
from sparserl_jax.testing import tiny_model
from sparserl_jax.testing.learner import config, host, make_batch

TOL = {
    "float32": {"logp": 2e-6, "grad": 1e-5, "params": 1e-6},
    "bfloat16": {"logp": 1e-2, "grad": 2e-2, "params": 5e-4},
}
# dtype, on a mesh, micro-batches, tied embeddings, objective
CASES = {
    "fp32-M1": ("float32", False, 1, False, "dapo"),
    "fp32-M4": ("float32", False, 4, False, "dapo"),
    "fp32-mesh-M2-tied": ("float32", True, 2, True, "dapo"),
    "fp32-M2-grpo-kl-entropy": ("float32", False, 2, False, "kl"),
    "bf16-M1": ("bfloat16", False, 1, False, "dapo"),
    "bf16-mesh-M2": ("bfloat16", True, 2, False, "dapo"),
}


def learner_config(m: int, objective: str, **kw):
    kw = dict(
        num_micro_batches=m,
        gating=DGGConfig(window=2, max_passes=2),
        optimizer=OptimizerConfig(learning_rate=1e-3, weight_decay=0.01, eps=1e-3),
        **kw,
    )
    if objective == "kl":
        # GRPO aggregation, a KL and an entropy term next to the Sparse-RL correction without
        # its batch normalisation: the one scale of `first_pass_scales` (1 / Z, Z = B) serves
        # every term.
        kw["loss"] = LossConfig.grpo(kl_coef=0.05, entropy_coef=0.01)
        kw["correction"] = SparseRLCorrectionConfig(batch_normalize=False)
    return config(**kw)


def model_for(dtype, tied, seed=5):
    # No q/k/v bias: the key bias has an exactly-zero true gradient, whose rounding noise Adam
    # would blow up to lr-sized updates (as in test_rl_learner_sharded).
    return tiny_model(seed=seed, num_layers=1, dtype=dtype, tie_embeddings=tied, qkv_bias=False)


def assert_close(got: dict, want: dict, rtol: float, what: str):
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-7, err_msg=f"{what}: {k}")


def assert_params_close(a, b, atol: float):
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(host(a)), jax.tree.leaves(host(b)), strict=True
    ):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_first_pass_equals_recompute_then_step(case):
    dtype, on_mesh, m, tied, objective = CASES[case]
    tol = TOL[dtype]
    model = model_for(dtype, tied)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)) if on_mesh else None
    learner = Learner(model, learner_config(m, objective), mesh=mesh)
    assert learner.first_pass_fallback is None
    batch = make_batch(seed=1)
    s0 = learner.init(model)
    pi_old = learner.logprobs(s0.params, batch.tokens_bt)  # today's recompute
    batch = batch._replace(sampler_logp_bt=pi_old + batch.sampler_logp_bt)
    if objective == "kl":
        ref = learner.init(model_for(dtype, tied, seed=8)).params
        batch = batch._replace(ref_logp_bt=learner.logprobs(ref, batch.tokens_bt))
    params0 = host(s0.params)

    s_new, m_new, got = learner.first_pass(learner.init(model), batch)
    s_old, m_old = learner.step(learner.init(model), batch._replace(old_logp_bt=pi_old), 1)

    got, want = np.asarray(got), np.asarray(pi_old)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol["logp"])
    # The check has teeth: pi_old of the neighbouring row (a micro-batch mix-up) is O(1) off.
    mask = np.asarray(batch.mask_bt)
    assert np.abs(np.roll(got, 1, axis=0) - want)[mask].max() > 100 * tol["logp"]
    # Pass 1 on its own pi_old: pi_theta / pi_old is exactly 1.
    assert float(m_new["ratio_max"]) == 1.0 and float(m_new["approx_kl"]) == 0.0
    assert bool(m_new["applied"]) and bool(m_old["applied"])
    # The correction metrics are functions of pi_old alone.
    correction = {k: v for k, v in m_old.items() if k.startswith("correction/")}
    assert_close(m_new, correction, 1e-5, "pass 1")
    assert 0 < float(m_new["correction/masked_token_fraction"]) < 1
    assert_close(m_new, m_old, tol["grad"], "pass 1")
    assert_params_close(s_new.params, s_old.params, tol["params"])
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), host(s_old.params), params0)
    assert max(jax.tree.leaves(moved)) > 5e-4  # lr 1e-3: the update is there to compare

    # Pass 2 reads each path's pi_old from the batch.
    s_new, m_new = learner.step(s_new, batch._replace(old_logp_bt=got), 2)
    s_old, m_old = learner.step(s_old, batch._replace(old_logp_bt=pi_old), 2)
    assert float(m_old["approx_kl"]) > 0  # pass 2 is off pi_old
    assert_close(m_new, m_old, tol["grad"], "pass 2")
    assert_params_close(s_new.params, s_old.params, tol["params"])
    assert_params_close(s_new.opt_state, s_old.opt_state, tol["params"])


class _Spy:
    """Counts the separate pi_old recomputes of a learner."""

    def __init__(self, learner):
        self.calls, self._logprobs = 0, learner.logprobs
        learner.logprobs = self

    def __call__(self, *args):
        self.calls += 1
        return self._logprobs(*args)


@pytest.mark.slow
def test_train_on_batch_takes_pi_old_from_the_first_pass():
    """Default config: no separate recompute, pass 1 exactly on pi_old; turned off, the
    recompute runs and the passes agree to fp32 tolerance."""
    model = model_for("float32", False)
    cfg = learner_config(2, "dapo")
    on = Learner(model, cfg)
    off = Learner(model, dataclasses.replace(cfg, old_logp_from_first_pass=False))
    assert off.first_pass_fallback == "learner.old_logp_from_first_pass=false"
    batch = make_batch(seed=2)
    s0 = on.init(model)
    batch = batch._replace(sampler_logp_bt=on.logprobs(s0.params, batch.tokens_bt) + 0.1)
    spy_on, spy_off = _Spy(on), _Spy(off)
    s_on, h_on = on.train_on_batch(on.init(model), batch)
    s_off, h_off = off.train_on_batch(off.init(model), batch)
    assert (spy_on.calls, spy_off.calls) == (0, 1)
    assert len(h_on) == len(h_off) == 2
    assert float(h_on[0]["ratio_max"]) == 1.0 and float(h_on[0]["approx_kl"]) == 0.0
    for a, b in zip(h_on, h_off, strict=True):
        assert_close(a, b, TOL["float32"]["grad"], f"pass {int(b['pass_index'])}")
    assert_params_close(s_on.params, s_off.params, TOL["float32"]["params"])


def test_fallback_rules():
    """Which configurations keep the recompute, and the reason each gives."""
    kl = LossConfig.dapo(kl_coef=1e-3)
    ent = LossConfig.dapo(entropy_coef=1e-3)
    assert first_pass_fallback(config()) is None  # DAPO, M = 2, batch-normalised TIS
    assert first_pass_fallback(config(num_micro_batches=1, loss=kl)) is None  # in place
    naive = SparseRLCorrectionConfig(batch_normalize=False)
    assert first_pass_fallback(config(loss=kl, correction=naive)) is None
    no_weights = SparseRLCorrectionConfig(reweight=False)
    assert first_pass_fallback(config(loss=ent, correction=no_weights)) is None
    for loss in (kl, ent):
        why = first_pass_fallback(config(loss=loss))
        assert "num_micro_batches=2" in why and "batch-normalised" in why
    bypass = SparseRLCorrectionConfig.bypass_mode()
    assert "bypass" in first_pass_fallback(config(correction=bypass))
    off = config(old_logp_from_first_pass=False)
    assert first_pass_fallback(off) == "learner.old_logp_from_first_pass=false"

    model = tiny_model(seed=1, num_layers=1)
    learner = Learner(model, config(loss=kl))
    with pytest.raises(ValueError, match="cannot come from the first pass: num_micro_batches"):
        learner.first_pass(learner.init(model), make_batch())


def test_loop_rule_published_weights_and_staleness():
    """`learn_step`'s rule: the first pass computes pi_old only for fresh rollouts and when
    the forward at the fp32 master is the forward at the published weights."""
    bf16 = Learner(tiny_model(seed=1, num_layers=1, dtype="bfloat16"), config())
    fp32 = Learner(tiny_model(seed=1, num_layers=1), config())
    fresh, stale = np.full(8, 7), np.array([7] * 7 + [6])
    assert old_logp_recompute_reason(bf16, np.dtype("bfloat16"), 7, fresh) is None
    assert old_logp_recompute_reason(fp32, np.dtype("float32"), 7, fresh) is None
    assert old_logp_recompute_reason(fp32, None, 7, fresh) is None  # publish_dtype "keep"
    why = old_logp_recompute_reason(fp32, np.dtype("bfloat16"), 7, fresh)
    assert "computes in float32" in why and "bfloat16" in why
    assert "stale" in old_logp_recompute_reason(bf16, np.dtype("bfloat16"), 7, stale)
    kl = Learner(tiny_model(seed=1, num_layers=1), config(loss=LossConfig(kl_coef=1e-3)))
    assert "num_micro_batches" in old_logp_recompute_reason(kl, None, 7, fresh)


def test_rho_percentiles_run_over_the_tokens_after_the_first_eviction():
    """`RLBatch.after_eviction_bt` reaches the correction's percentiles on both paths: pi_old
    given, and pi_old from the first pass."""
    model = model_for("float32", False)
    learner = Learner(model, learner_config(2, "dapo"))
    batch = make_batch(seed=2)
    old = learner.logprobs(learner.init(model).params, batch.tokens_bt)
    batch = batch._replace(sampler_logp_bt=old + batch.sampler_logp_bt)
    after = np.asarray(batch.mask_bt) & (np.arange(batch.tokens_bt.shape[1]) >= 6)
    cfg = learner.config.correction
    want = sparse_rl_weights(old, batch.sampler_logp_bt, batch.mask_bt, cfg, after).metrics
    every = sparse_rl_weights(old, batch.sampler_logp_bt, batch.mask_bt, cfg).metrics
    assert abs(float(want.rho_p5) - float(every.rho_p5)) > 1e-3  # the subset matters here
    tagged = batch._replace(after_eviction_bt=after)
    _, first, _ = learner.first_pass(learner.init(model), tagged)
    _, given = learner.step(learner.init(model), tagged._replace(old_logp_bt=old))
    for metrics in (first, given):
        for k in ("rho_p1", "rho_p5"):
            np.testing.assert_allclose(metrics[f"correction/{k}"], getattr(want, k), rtol=1e-5)
        np.testing.assert_allclose(metrics["correction/rho_mean"], every.rho_mean, rtol=1e-5)
