"""Research code using the pure functions in its own JAX loop (the README example), and the
benchmark tool's JSON line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparserl_jax.rl import (
    DGGConfig,
    aggregate_loss,
    dynamic_gradient_gating,
    grpo_advantages,
    lm_head_grad_energy,
    ppo_clip_loss,
    shifted_token_logprobs,
    sparse_rl_weights,
)

V, D, B, T, G = 11, 8, 8, 6, 4


def apply_fn(params, tokens_bt):
    """A toy policy: embedding then an output head."""
    return jnp.einsum("btd,dv->btv", params["embed"][tokens_bt], params["head"])


def loss_fn(params, tokens, mask, rewards, old_logp, sampler_logp):
    adv = grpo_advantages(rewards, group_size=G)  # over the full group, before rejection
    corr = sparse_rl_weights(old_logp, sampler_logp, mask)  # veto, token mask, TIS weights
    logp = shifted_token_logprobs(apply_fn(params, tokens), tokens)
    loss_bt = ppo_clip_loss(logp, old_logp, adv, eps_low=0.2, eps_high=0.28)
    return aggregate_loss(loss_bt * corr.weights_bt, corr.loss_mask_bt, mode="token_mean")


@pytest.mark.slow
def test_readme_research_loop():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "embed": jax.random.normal(k1, (V, D)),
        "head": 0.1 * jax.random.normal(k2, (D, V)),
    }
    tokens = jax.random.randint(k3, (B, T), 0, V)
    mask = jnp.broadcast_to(jnp.arange(T) >= 2, (B, T))
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    old_logp = shifted_token_logprobs(apply_fn(params, tokens), tokens)
    sampler_logp = old_logp + 0.1  # a slightly off sparse sampler

    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    gate = dynamic_gradient_gating(DGGConfig(tau=0.3, window=4))
    gate_state = gate.init()

    @jax.jit
    def update(params, opt_state, gate_state, k):
        grads = jax.grad(loss_fn)(params, tokens, mask, rewards, old_logp, sampler_logp)
        decision, gate_state = gate.update(lm_head_grad_energy(grads["head"]), gate_state, k)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = decision.fire  # DGG: discard the update before the optimizer sees it
        params, opt_state = jax.tree.map(
            lambda n, o: jnp.where(keep, o, n), (new_params, new_opt), (params, opt_state)
        )
        return params, opt_state, gate_state, decision

    before = loss_fn(params, tokens, mask, rewards, old_logp, sampler_logp)
    for k in range(1, 5):
        params, opt_state, gate_state, decision = update(params, opt_state, gate_state, k)
        assert not bool(decision.fire)  # the window is never full in 4 updates
    after = loss_fn(params, tokens, mask, rewards, old_logp, sampler_logp)
    assert float(after) < float(before)
    # Rewarded sequences became more likely, unrewarded ones less.
    new_logp = shifted_token_logprobs(apply_fn(params, tokens), tokens)
    gain = np.asarray(jnp.sum((new_logp - old_logp) * mask, axis=1))
    r = np.asarray(rewards)
    assert gain[r == 1].mean() > 0 > gain[r == 0].mean()


@pytest.mark.slow
def test_bench_learner_prints_json_last():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "tools/bench_learner.py", "--preset", "tiny", "--batch", "8"]
        + ["--seq-len", "16", "--prompt-len", "4", "--group-size", "4", "--steps", "2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens_per_s"] > 0 and np.isfinite(result["loss"])
    assert result["batch"] == 8 and result["seq_len"] == 16


@pytest.mark.slow
def test_bench_learner_old_logp_comparison_json():
    """`--old-logp-passes`: per K, the batch time with pi_old recomputed and from the first
    pass, side by side."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "tools/bench_learner.py", "--preset", "tiny", "--batch", "8"]
        + ["--seq-len", "16", "--prompt-len", "4", "--group-size", "4", "--steps", "1"]
        + ["--no-mesh", "--old-logp-passes", "1", "2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["passes"] for r in result["old_logp"]] == [1, 2]
    for r in result["old_logp"]:
        assert r["recompute_ms"] > 0 and r["first_pass_ms"] > 0
        assert r["saved_ms"] == pytest.approx(r["recompute_ms"] - r["first_pass_ms"])
    assert result["old_logp_ms"] > 0 and result["batch"] == 8 and result["seq_len"] == 16
