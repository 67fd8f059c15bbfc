"""The learner step against a pure full-batch reference; DGG and non-finite skips leave the
state bit-identical; batch reuse stops at K passes or when the gate fires."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparserl_jax.rl import rejection_by_advantage, sparse_rl_weights
from sparserl_jax.rl.config import LossConfig, OptimizerConfig
from sparserl_jax.rl.gating import DGGConfig, DGGState
from sparserl_jax.rl.learner import Learner
from sparserl_jax.testing import assert_trees_equal, tiny_model
from sparserl_jax.testing.learner import config, host, make_batch, reference, with_old


@pytest.fixture(scope="module")
def untied():
    """One learner (and its compiled step) shared by the tests below."""
    model = tiny_model(seed=5, num_layers=1)
    return model, Learner(model, config(gating=DGGConfig(window=3)))


@pytest.fixture(scope="module")
def tied():
    # One micro-batch here; tied accumulation over two is checked in test_rl_learner_sharded.
    model = tiny_model(seed=5, num_layers=1, tie_embeddings=True)
    return model, Learner(model, config(gating=DGGConfig(window=3), num_micro_batches=1))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_step_matches_full_batch_reference(which, request):
    model, learner = request.getfixturevalue(which)
    state = learner.init(model)
    batch = with_old(learner, state, make_batch())
    params0 = host(state.params)
    want_loss, want_norm, want_energy = reference(
        params0, learner.graphdef, batch, learner.config, learner.tied
    )
    state, m = learner.step(state, batch, pass_index=1)
    np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["grad_norm"], want_norm, rtol=1e-5)
    np.testing.assert_allclose(m["dgg/g"], want_energy, rtol=1e-5)
    assert bool(m["applied"]) and int(state.step) == 1
    np.testing.assert_allclose(m["approx_kl"], 0.0, atol=1e-6)  # pass 1: pi_theta == pi_old
    # Every step reports the Sparse-RL correction metrics of the whole batch.
    want = sparse_rl_weights(batch.old_logp_bt, batch.sampler_logp_bt, batch.mask_bt).metrics
    for key, value in want._asdict().items():
        np.testing.assert_allclose(m[f"correction/{key}"], value, rtol=1e-6, err_msg=key)
    assert 0 < float(m["correction/masked_token_fraction"]) < 1
    corr = sparse_rl_weights(batch.old_logp_bt, batch.sampler_logp_bt, batch.mask_bt)
    split = rejection_by_advantage(corr.loss_mask_bt, batch.mask_bt, batch.advantages_b)
    for key, value in split.items():
        np.testing.assert_allclose(m[f"correction/{key}"], value, rtol=1e-6, err_msg=key)
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), state.params, params0)
    assert max(jax.tree.leaves(moved)) > 1e-4


def armed_gate(window, prev_energy=0.0):
    # A full window of zero increments: any positive increment has z = dg / eps >> tau.
    return DGGState(
        increments_w=jnp.zeros((window,), jnp.float32),
        count=jnp.int32(window),
        next_index=jnp.int32(0),
        prev_energy=jnp.float32(prev_energy),
        has_prev=jnp.bool_(True),
    )


@pytest.mark.slow
def test_dgg_fire_leaves_params_and_opt_state_bit_identical(untied):
    model, learner = untied
    state = learner.init(model)
    batch = with_old(learner, state, make_batch(seed=2))
    state, _ = learner.step(state, batch, 1)  # a real update, so Adam moments are non-zero
    state = state._replace(gate=armed_gate(3))
    before = host(state)
    state, m = learner.step(state, batch, 2)
    assert bool(m["dgg/fire"]) and bool(m["dgg/stop_reuse"]) and not bool(m["applied"])
    assert float(m["dgg/z"]) > 0.3
    assert_trees_equal(host(state.params), before.params, what="params")
    assert_trees_equal(host(state.opt_state), before.opt_state, what="opt_state")
    assert_trees_equal(host(state.gate), before.gate, what="gate")
    assert int(state.step) == 1 and int(state.gate_fires) == 1
    # The same armed gate on pass 1 of a batch does not fire: the update is applied.
    state = state._replace(gate=armed_gate(3))
    state, m = learner.step(state, batch, 1)
    assert not bool(m["dgg/fire"]) and bool(m["applied"]) and int(state.step) == 2


def test_nonfinite_step_is_skipped_and_counted(untied):
    model, learner = untied
    state = learner.init(model)
    batch = with_old(learner, state, make_batch(seed=4))
    state, _ = learner.step(state, batch, 1)
    bad = batch._replace(advantages_b=batch.advantages_b.at[1].set(jnp.nan))
    before = host(state)
    state, m = learner.step(state, bad, 2)
    assert bool(m["nonfinite"]) and not bool(m["applied"]) and bool(m["dgg/stop_reuse"])
    assert not bool(m["dgg/fire"])
    assert_trees_equal(host(state.params), before.params, what="params")
    assert_trees_equal(host(state.opt_state), before.opt_state, what="opt_state")
    assert_trees_equal(host(state.gate), before.gate, what="gate")
    assert int(state.nonfinite_steps) == 1 and int(state.step) == 1


def test_train_on_batch_reuses_up_to_k_and_stops_on_fire(untied):
    model, learner = untied
    state = learner.init(model)  # fresh gate: its window is empty, so it cannot fire
    batch = make_batch(seed=5)
    batch = batch._replace(sampler_logp_bt=learner.logprobs(state.params, batch.tokens_bt))
    state, history = learner.train_on_batch(state, batch)
    assert [int(m["pass_index"]) for m in history] == [1, 2, 3, 4]  # K = 4
    assert int(history[-1]["passes_applied"]) == 4 and int(state.step) == 4
    assert float(history[1]["approx_kl"]) > 0.0  # pass 2 is off pi_old
    # Window [0, 0] and a huge previous energy: pass 1 (never gated) appends a large negative
    # increment, so pass 2's ordinary increment has z ~ 1 > tau and fires, ending reuse.
    state = learner.init(model)
    state = state._replace(gate=armed_gate(3, prev_energy=1e6))
    state, history = learner.train_on_batch(state, batch)
    assert len(history) == 2 and bool(history[1]["dgg/fire"]), [m["dgg/z"] for m in history]
    assert int(history[-1]["passes_applied"]) == 1 and int(state.gate_fires) == 1


def test_mini_batches_are_steps_on_row_slices_with_pi_old_from_before_the_batch():
    """num_mini_batches=2: pi_old recomputed once at the start, then per pass one step on the
    even rows and one on the odd rows (strided, as the micro-batches), in order: bit-identical
    to those steps taken by hand."""
    model = tiny_model(seed=6, num_layers=1)
    cfg = config(gating=DGGConfig(window=3, max_passes=2), num_micro_batches=1)
    mini = Learner(model, config(**{**vars(cfg), "num_mini_batches": 2}))
    assert "num_mini_batches=2" in mini.first_pass_fallback
    batch = make_batch(seed=7)
    state = mini.init(model)
    batch = batch._replace(
        sampler_logp_bt=batch.sampler_logp_bt + mini.logprobs(state.params, batch.tokens_bt)
    )
    old = mini.logprobs(state.params, batch.tokens_bt)
    got, history = mini.train_on_batch(state, batch)
    assert [(int(m["pass_index"]), int(m["mini_batch"])) for m in history] == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    assert int(got.step) == 4 and float(history[-1]["passes_applied"]) == 2.0
    old_batch = batch._replace(old_logp_bt=old)
    cut = [slice(0, 8, 2), slice(1, 8, 2)]
    halves = [type(batch)(*(x if x is None else x[r] for x in old_batch)) for r in cut]
    want = mini.init(model)
    for k in (1, 2):
        for half in halves:
            want, _ = mini.step(want, half, k)
    assert_trees_equal(host(got.params), host(want.params), what="params")
    assert_trees_equal(host(got.opt_state), host(want.opt_state), what="opt_state")
    # A fire on pass 2's first mini-batch discards it and ends the batch (both loops).
    state = mini.init(model)
    state = state._replace(gate=armed_gate(3, prev_energy=1e6))
    state, history = mini.train_on_batch(state, batch)
    assert [int(m["pass_index"]) for m in history] == [1, 1, 2] and bool(history[-1]["dgg/fire"])
    assert int(state.step) == 2 and float(history[-1]["passes_applied"]) == 1.0
    # rule="rising": a step at pass k > 1 fires when its rows' energy is above their last pass.
    # (lr 3e-2: mini-batch 1's energy rises at pass 3 on this batch.)
    hot = {"gating": DGGConfig(window=3, max_passes=4, rule="rising"), "num_mini_batches": 2}
    hot["optimizer"] = OptimizerConfig(learning_rate=3e-2, weight_decay=0.01)
    rising = Learner(model, config(**{**vars(cfg), **hot}))
    _, history = rising.train_on_batch(rising.init(model), batch)
    last = {}
    for m in history:
        j, g = int(m["mini_batch"]), float(m["dgg/g"])
        assert bool(m["dgg/fire"]) == (int(m["pass_index"]) > 1 and g > last[j])
        last[j] = g
    assert bool(history[-1]["dgg/fire"]) and len(history) < 8  # the fire ended the batch
    with pytest.raises(ValueError, match="multiple of num_mini_batches"):
        Learner(model, config(num_mini_batches=3)).train_on_batch(mini.init(model), batch)
    with pytest.raises(ValueError, match="num_mini_batches must be >= 1"):
        config(num_mini_batches=0)


def test_errors_name_the_problem():
    model = tiny_model(seed=1, num_layers=1)
    learner = Learner(model, config(loss=LossConfig(kl_coef=1e-3), num_micro_batches=3))
    state = learner.init(model)
    batch = make_batch()
    with pytest.raises(ValueError, match="old_logp_bt is None"):
        learner.step(state, batch)
    batch = batch._replace(old_logp_bt=batch.sampler_logp_bt)
    with pytest.raises(ValueError, match="kl_coef=0.001"):
        learner.step(state, batch)
    with pytest.raises(ValueError, match="batch size 8 must be a multiple"):
        learner.step(state, batch._replace(ref_logp_bt=batch.old_logp_bt))
    with pytest.raises(ValueError, match="fp32 master weights"):
        Learner(tiny_model(param_dtype="bfloat16"), config())
