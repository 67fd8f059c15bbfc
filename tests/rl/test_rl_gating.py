"""Dynamic Gradient Gating: the z-score rule, arming, state bookkeeping, lm_head energy."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax.rl import (
    DGGConfig,
    dynamic_gradient_gating,
    lm_head_grad_energy,
    lm_head_grad_energy_gram,
)


def run(gate, energies, passes, state=None):
    state = gate.init() if state is None else state
    update = jax.jit(gate.update)
    decisions = []
    for g, k in zip(energies, passes, strict=True):
        d, state = update(jnp.float32(g), state, k)
        decisions.append(jax.tree.map(np.asarray, d))
    return decisions, state


def cycle_passes(n, k=4):
    return [i % k + 1 for i in range(n)]


def test_steady_series_never_fires():
    # Constant increments (exact in fp32): the window std is 0, z = 0 < tau.
    gate = dynamic_gradient_gating(DGGConfig(window=4))
    energies = [100.0 - 0.25 * i for i in range(40)]
    decisions, _ = run(gate, energies, cycle_passes(40))
    assert not any(d.fire for d in decisions)
    assert any(d.armed for d in decisions)
    assert [bool(d.stop_reuse) for d in decisions[:8]] == [False, False, False, True] * 2


def test_spike_fires_only_when_armed():
    cfg = DGGConfig(window=4, tau=0.3)
    gate = dynamic_gradient_gating(cfg)
    # Increments alternate 0, 1 (mean 0.5, std 0.5) so the window has a spread.
    warm = [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    decisions, state = run(gate, warm, [1, 2, 3, 4, 1, 2])
    assert int(state.count) == 4
    # A spike of +10 on pass 3: z = (10 - 0.5) / 0.5 = 19 > tau -> fires.
    (d,), fired_state = run(gate, [12.0], [3], state)
    assert bool(d.armed) and bool(d.fire) and bool(d.stop_reuse)
    np.testing.assert_allclose(d.z, 19.0, rtol=1e-6)
    np.testing.assert_allclose(d.increment, 10.0)
    # A fired step leaves the gate state bit-identical (the spike never enters the window).
    for a, b in zip(fired_state, state, strict=True):
        np.testing.assert_array_equal(a, b)
    # The same spike on pass 1 (a fresh batch) is not armed.
    (d,), _ = run(gate, [12.0], [1], state)
    assert not bool(d.armed) and not bool(d.fire)
    # Window not full yet: not armed either.
    fresh, _ = run(gate, [0.0, 1.0, 50.0], [1, 2, 3])
    d = fresh[-1]
    assert not bool(d.armed) and not bool(d.fire)
    # A large drop is not a spike (one-sided test).
    (d,), _ = run(gate, [-40.0], [2], state)
    assert bool(d.armed) and not bool(d.fire) and float(d.z) < 0


def test_disabled_gate_tracks_but_never_fires():
    gate = dynamic_gradient_gating(DGGConfig(window=2, enabled=False))
    decisions, _ = run(gate, [0.0, 1.0, 1.0, 100.0], [1, 2, 3, 4])
    assert not any(d.fire for d in decisions)
    assert float(decisions[-1].z) > 1.0


def test_reset_each_batch_skips_cross_batch_increment():
    gate = dynamic_gradient_gating(DGGConfig(window=3, reset_each_batch=True))
    _, state = run(gate, [1.0, 2.0, 50.0, 51.0], [1, 2, 1, 2])
    # Only the within-batch increments (1, 1) were recorded; 50 - 2 was not.
    assert int(state.count) == 2
    np.testing.assert_allclose(np.asarray(state.increments_w)[:2], [1.0, 1.0])


def reference_gate(cfg, energies, passes):
    """dgg.md §1.3 written with a deque, as the paper's pseudocode reads."""
    window, prev, out = collections.deque(maxlen=cfg.window), None, []
    for g, k in zip(energies, passes, strict=True):
        has_inc = prev is not None and (k > 1 or not cfg.reset_each_batch)
        dg = g - prev if has_inc else 0.0
        arr = np.asarray(window, np.float64)
        z = (dg - arr.mean()) / (arr.std() + cfg.eps) if len(window) >= 2 else 0.0
        fire = len(window) == cfg.window and k > 1 and has_inc and z > cfg.tau
        out.append((fire, z))
        if not fire:
            if has_inc:
                window.append(dg)
            prev = g
    return out


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(-20, 20), min_size=5, max_size=30),
    st.integers(2, 5),
    st.sampled_from([0.1, 0.3, 0.5]),
    st.booleans(),
)
def test_matches_deque_reference(ints, window, tau, reset):
    cfg = DGGConfig(window=window, tau=tau, reset_each_batch=reset)
    energies = [float(i) / 4 for i in ints]
    passes = cycle_passes(len(energies))
    decisions, _ = run(dynamic_gradient_gating(cfg), energies, passes)
    for d, (fire, z) in zip(decisions, reference_gate(cfg, energies, passes), strict=True):
        assert bool(d.fire) == fire
        np.testing.assert_allclose(float(d.z), z, rtol=1e-4, atol=1e-3)


def test_rising_rule_fires_when_the_same_rows_energy_rises():
    gate = dynamic_gradient_gating(DGGConfig(rule="rising", window=2))
    update = jax.jit(gate.update)
    state = gate.init()
    seen = []
    # (energy, pass, the same rows' energy at their previous pass: inf on pass 1)
    for g, k, e in [(4.0, 1, np.inf), (2.0, 2, 4.0), (1.5, 2, 1.0), (9.0, 1, np.inf)]:
        d, state = update(jnp.float32(g), state, k, jnp.float32(e))
        seen.append((bool(d.fire), bool(d.armed)))
    # Pass 1 is never armed (a fresh batch may be anything); at pass 2 a fall passes, a rise
    # fires; no window has to fill first.
    assert seen == [(False, False), (False, True), (True, True), (False, False)]
    off = dynamic_gradient_gating(DGGConfig(rule="rising", enabled=False))
    d, _ = off.update(jnp.float32(5.0), off.init(), 2, jnp.float32(1.0))
    assert not bool(d.fire) and not bool(d.armed)


def test_config_validation():
    with pytest.raises(ValueError, match="rule must be 'zscore' or 'rising'"):
        DGGConfig(rule="spike")
    with pytest.raises(ValueError, match="tau"):
        DGGConfig(tau=0.0)
    with pytest.raises(ValueError, match="window must be >= 2.*got 1"):
        DGGConfig(window=1)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_energy_gram_matches_autograd(tied):
    b, t, d, v = 2, 3, 5, 11
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    h = jax.random.normal(k1, (b, t, d))
    targets = jax.random.randint(k2, (b, t), 0, v)
    adv = jax.random.normal(k3, (b, t))
    w = jax.random.normal(k4, (v, d) if tied else (d, v))

    def logits_fn(w_, h_):
        return jnp.einsum("btd,vd->btv", h_, w_) if tied else jnp.einsum("btd,dv->btv", h_, w_)

    def loss_from_logits(z):
        logp = jnp.take_along_axis(jax.nn.log_softmax(z), targets[..., None], -1)[..., 0]
        return -jnp.mean(adv * logp)

    grad_w = jax.grad(lambda w_: loss_from_logits(logits_fn(w_, h)))(w)
    dlogits = jax.grad(loss_from_logits)(logits_fn(w, h))
    np.testing.assert_allclose(
        lm_head_grad_energy_gram(h, dlogits), lm_head_grad_energy(grad_w), rtol=1e-5
    )
    if tied:
        # With tied weights the full gradient also holds the input-embedding part; the Gram
        # form isolates the output projection.
        def tied_loss(w_):
            h_in = h + jnp.take(w_, targets, axis=0)
            return loss_from_logits(logits_fn(w_, h_in))

        full = jax.grad(tied_loss)(w)
        h_in = h + jnp.take(w, targets, axis=0)
        dl = jax.grad(loss_from_logits)(logits_fn(w, h_in))
        head_only = jax.grad(lambda w_: loss_from_logits(logits_fn(w_, h_in)))(w)
        np.testing.assert_allclose(
            lm_head_grad_energy_gram(h_in, dl), lm_head_grad_energy(head_only), rtol=1e-5
        )
        assert abs(float(lm_head_grad_energy(full)) - float(lm_head_grad_energy(head_only))) > 1e-3
