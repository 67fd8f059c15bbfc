"""The PULSELoCo benchmark on the tiny preset: its GRPO task, its byte bookkeeping, its errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.bigram import chain
from benchmarks.loco import LoCoBenchConfig, build_model, grpo_loss, rl_problem, run
from sparserl_jax.sync import loco

TINY = dict(
    preset="tiny", replicas=2, inner_steps=2, rounds=2, batch=8, seq_len=8, pretrain_steps=5,
    eval_prompts=16, group_size=4, pad_multiple=1,
)  # fmt: skip


@pytest.mark.slow
def test_rl_rollouts_and_grpo_loss_at_pi_old():
    cfg = LoCoBenchConfig(**TINY)
    graphdef, params = build_model("tiny", seed=0, dtype=cfg.dtype)
    data, evaluate = rl_problem(graphdef, params, chain(128, seed=1), cfg)
    k, h, r, b = cfg.rounds, cfg.inner_steps, cfg.replicas, cfg.batch
    width = cfg.prompt_len + cfg.seq_len
    assert (
        data["tokens"].shape == data["old_logp"].shape == data["mask"].shape == (k, h, r, b, width)
    )
    assert data["adv"].shape == (k, h, r, b)
    # The mask covers the completion tokens only; group-normalised advantages sum to 0 per group.
    np.testing.assert_array_equal(data["mask"][0, 0, 0, 0], np.arange(width) >= cfg.prompt_len)
    groups = data["adv"].reshape(-1, cfg.group_size)
    np.testing.assert_allclose(groups.sum(axis=1), 0.0, atol=1e-5)
    assert np.all(data["old_logp"][..., 1:] < 0) and np.all(data["old_logp"][..., 0] == 0)
    # At pi_theta = pi_old every ratio is 1, so the per-token loss is -A and the GRPO
    # (seq-mean-token-mean) loss of a batch is -mean(A).
    batch = jax.tree.map(lambda x: jnp.asarray(x[0, 0, 0]), data)
    got = float(jax.jit(grpo_loss(graphdef, cfg.clip_eps))(params, batch))
    np.testing.assert_allclose(got, -float(np.mean(data["adv"][0, 0, 0])), rtol=1e-5, atol=1e-6)
    start = evaluate(params, final=True)
    # At pi_old the importance weights are all 1 (ESS = every held-out row) and the policy's own
    # samples, drawn with the held-out keys, are the held-out rollouts: both estimates agree.
    assert start["ess"] == pytest.approx(cfg.eval_prompts * cfg.group_size, rel=1e-5)
    assert 0 < start["reward"] < 1 and start["loss"] == 1 - start["reward"]
    assert start["reward"] == pytest.approx(start["reward_is"], rel=1e-6)
    assert start["success_nll"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("task", ["rl", "shift"])
def test_run_reports_its_fields(task):
    cfg = LoCoBenchConfig(**TINY, task=task)
    out = run(cfg)
    json.dumps(out)  # one JSON line
    num, steps = out["config"]["params"], cfg.rounds * cfg.inner_steps
    assert out["ddp"]["bytes"] == loco.ddp_bytes(num, cfg.replicas, steps)
    assert out["diloco"]["bytes"] == loco.diloco_bytes(num, cfg.replicas, cfg.rounds)
    rounds = out["pulseloco"]["rounds"]
    assert len(rounds) == cfg.rounds
    assert out["pulseloco"]["bytes"] == sum(x["sent_bytes"] for x in rounds)
    assert 0 < out["pulseloco"]["bytes"] < out["diloco"]["bytes"]
    for m in ("ddp", "diloco", "pulseloco"):
        assert len(out[m]["curve"]) == cfg.rounds and np.isfinite(out[m]["final_loss"])
        assert ("final_reward" in out[m]) == (task == "rl")
    s = out["summary"]
    assert s["diloco_over_pulseloco_bytes"] == out["diloco"]["bytes"] / out["pulseloco"]["bytes"]
    assert set(s["targets_met"]) == {
        "loss_within_2pct_of_diloco", "bytes_15x_below_diloco", "bytes_150x_below_ddp",
    }  # fmt: skip
    pay = out["pulseloco"]["payload"]
    assert pay["format"] == "coded"
    assert pay["position_bytes"] + pay["value_bytes"] < out["pulseloco"]["bytes"]
    # The gate entropy given θ's exponents is at most the plain one; the positions cost about
    # it (a sanity bound: the coder is an empirical one).
    assert pay["context_entropy_bits_per_entry"] <= pay["gate_entropy_bits_per_entry"]
    assert pay["position_bits_per_entry"] > 0.5 * pay["context_entropy_bits_per_entry"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"task": "dpo"}, "task 'dpo' unknown; expected one of"),
        ({"group_size": 3}, "group_size >= 2 dividing batch"),
        ({"dtype": "float16"}, "dtype 'float16' unknown"),
        ({"preset": "huge"}, "preset 'huge' unknown"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoCoBenchConfig(**kwargs)
