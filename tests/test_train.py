"""`sparserl train`: the batch layout, an end-to-end run on the split topology, and resume after
kill -9 continuing bit for bit."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from sparserl_jax.build import build_model
from sparserl_jax.checkpoint import CheckpointManager
from sparserl_jax.config import load_config
from sparserl_jax.metrics import read_metrics
from sparserl_jax.rl import Learner, rejected_sequences, sparse_rl_weights
from sparserl_jax.rollout import RolloutResult
from sparserl_jax.sampler import step_seeds
from sparserl_jax.testing import assert_trees_equal, child_env
from sparserl_jax.train import rl_batch, train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_rl_batch_layout():
    res = RolloutResult(
        prompt_ids=[[1, 5, 6], [1, 7]],
        completion_ids=np.array([[8, 9, 2, 0], [3, 0, 0, 0]], np.int32),
        sampler_logprobs=np.array([[-0.1, -0.2, -0.3, 0], [-0.4, 0, 0, 0]], np.float32),
        completion_mask=np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool),
        prompt_lens=np.array([3, 2], np.int32),
        completion_lens=np.array([3, 1], np.int32),
        tokens_evicted=np.zeros(2, np.int32),
        weight_version=np.zeros(2, np.int32),
        finished_by_stop=np.array([True, False]),
        stats={},
    )
    b = rl_batch(res, np.array([0.5, -0.5]), seq_len=9)
    np.testing.assert_array_equal(
        b.tokens_bt, [[1, 5, 6, 8, 9, 2, 0, 0, 0], [1, 7, 3, 0, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        b.mask_bt, [[0, 0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_allclose(b.sampler_logp_bt[0, 3:6], [-0.1, -0.2, -0.3])
    np.testing.assert_allclose(b.sampler_logp_bt[1, 2], -0.4)
    assert b.sampler_logp_bt[~b.mask_bt].sum() == 0
    with pytest.raises(ValueError, match="seq_len"):
        rl_batch(res, np.zeros(2), seq_len=5)


def test_step_seeds_are_a_function_of_seed_and_step():
    assert step_seeds(0, 3, 4) == step_seeds(0, 3, 4)
    assert step_seeds(0, 3, 4) != step_seeds(0, 4, 4)
    assert step_seeds(0, 3, 4) != step_seeds(1, 3, 4)


@pytest.mark.slow
def test_split_topology_end_to_end_and_sigterm(tmp_path):
    """Trainer on 4 fake devices, sampler on the other 4 (fsdp 2 x tensor 2: each fsdp shard
    its own rollout slots and pages and half of each weight's hidden dim, gathered a layer at a
    time): every step's patch is applied onto the sampler mesh and verified; metrics and
    checkpoints are written. A SIGTERM during step 2
    ends the run after that step with a checkpoint."""
    cfg = load_config(
        TINY,
        [
            f"run_dir={tmp_path}",
            "train.topology=split",
            "train.sampler_devices=4",
            "train.sampler_tensor=2",  # the sampler's mesh: fsdp 2 x tensor 2
            "train.sampler_fsdp=2",
            "rollout.fsdp_shards=true",
            "train.steps=5",
            "train.save_every=10",
            "train.eval_examples=2",
            "sft.steps=0",
        ],
    )

    def on_step(step, row):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    summary = train(cfg, log_fn=lambda m: None, on_step=on_step)
    assert summary["stopped_by_signal"] and summary["end_step"] == 2
    rows = read_metrics(tmp_path)
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["sync/verified"] is True and r["sync/format"] == 3
        assert r["sync/payload_bytes"] > 0
        assert 0 < r["sync/changed"] <= r["sync/dense_bf16_bytes"] // 2
        assert r["rollout/weight_version"] == r["step"] - 1
        for key in ("correction/rho_mean", "dgg/z", "actor/entropy", "response_length/mean"):
            assert np.isfinite(r[key]), key
    assert sum("val/reward_mean" in r for r in rows) == 1  # before; no "after" when stopped
    assert CheckpointManager(tmp_path, async_save=False).steps()[-1] == 2


def _run(run_dir, *overrides, env):
    cmd = [sys.executable, "-m", "sparserl_jax", "train", TINY, f"run_dir={run_dir}", *overrides]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _final_state(run_dir, step):
    cfg = load_config(TINY, [f"run_dir={run_dir}"])
    model = build_model(cfg.model)
    template = {"learner": Learner(model, cfg.learner).init(model)}
    mngr = CheckpointManager(run_dir, async_save=False)
    state, meta = mngr.restore(step, template)
    mngr.close()
    return state, meta


@pytest.mark.slow
def test_kill9_then_resume_is_bit_identical(tmp_path):
    env = child_env(tmp_path / "jax_cache")  # one CPU device; the three runs compile once
    common = ["train.steps=8", "train.save_every=2", "train.eval_examples=0", "sft.steps=2"]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full = _run(full_dir, *common, env=env)
    cut = _run(cut_dir, *common, env=env)
    ckpt_dir = cut_dir / "checkpoints"
    deadline = time.time() + 600
    while not (ckpt_dir / "2").is_dir() and time.time() < deadline:
        assert cut.poll() is None, cut.communicate()[1][-3000:]
        time.sleep(0.02)
    assert cut.poll() is None, "the run ended before it could be killed"
    cut.send_signal(signal.SIGKILL)
    cut.wait()
    saved = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
    assert saved and saved[-1] < 8, saved
    out, err = full.communicate(timeout=600)
    assert full.returncode == 0, err[-3000:]

    resumed = _run(cut_dir, *common, env=env)
    out2, err2 = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err2[-3000:]
    assert "resumed from" in err2
    assert json.loads(out2.strip().splitlines()[-1])["start_step"] >= 2

    a, meta_a = _final_state(full_dir, 8)
    b, meta_b = _final_state(cut_dir, 8)
    assert_trees_equal(jax.device_get(a), jax.device_get(b))
    assert meta_a["data_state"] == meta_b["data_state"]
    assert meta_a["sync_version"] == meta_b["sync_version"] == 8  # numbering survives a restart


@pytest.mark.slow
def test_kill9_during_the_sft_warm_start_resumes_it_bit_for_bit(tmp_path):
    """Killed once the warm start has saved some progress, the same command resumes it from
    there (not from step 0) and ends where an uninterrupted run ends; the progress is removed
    once step 0 holds the warm start."""
    env = child_env(tmp_path / "jax_cache")
    common = ["train.steps=2", "train.save_every=2", "train.eval_examples=0", "sft.steps=60"]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full = _run(full_dir, *common, env=env)
    cut = _run(cut_dir, *common, env=env)
    progress = cut_dir / "sft_progress" / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and not (
        progress.is_dir() and any(p.name.isdigit() for p in progress.iterdir())
    ):
        assert cut.poll() is None, cut.communicate()[1][-3000:]
        time.sleep(0.01)
    cut.send_signal(signal.SIGKILL)
    cut.wait()
    assert not (cut_dir / "checkpoints").is_dir() or not any(
        p.name.isdigit() for p in (cut_dir / "checkpoints").iterdir()
    ), "killed after the warm start, not during it"
    out, err = full.communicate(timeout=600)
    assert full.returncode == 0, err[-3000:]
    assert not (full_dir / "sft_progress").exists()

    resumed = _run(cut_dir, *common, env=env)
    out2, err2 = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err2[-3000:]
    assert re.search(r"SFT resumed from .*sft_progress/checkpoints at step [1-9]\d*/60", err2)
    assert not (cut_dir / "sft_progress").exists()
    a, _ = _final_state(full_dir, 2)
    b, _ = _final_state(cut_dir, 2)
    assert_trees_equal(jax.device_get(a), jax.device_get(b))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rollout.temperature=0.7"], "learner.loss.temperature"),
        (["rollout.n_samples=1"], "at least 2 samples"),
        (["train.topology=split", "train.sampler_devices=8"], "sampler_devices=8"),
    ],
)
def test_bad_settings_are_clear_errors(tmp_path, overrides, match):
    cfg = load_config(TINY, [f"run_dir={tmp_path}", *overrides])
    with pytest.raises(ValueError, match=match):
        train(cfg, log_fn=lambda m: None)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["learner.loss.policy_loss=gspo", "train.advantage_estimator=rloo"],
        ["learner.loss.policy_loss=cispo", "train.advantage_estimator=reinforce_pp_baseline"],
        ["rollout.kv.policy=none", "learner.correction.bypass=true"],
    ],
    ids=["gspo-rloo", "cispo-reinforce_pp_baseline", "dense-bypass"],
)
def test_algorithm_options_end_to_end(tmp_path, overrides):
    """The loop runs with each family of options: finite losses, verified syncs, and bypass
    skips the pi_old recompute."""
    cfg = load_config(
        TINY,
        [
            f"run_dir={tmp_path}",
            "train.steps=2",
            "train.eval_examples=0",
            "sft.steps=0",
            "data.batch_size=4",  # 8 rows: one per fake device
            *overrides,
        ],
    )
    summary = train(cfg, log_fn=lambda m: None)
    assert summary["end_step"] == 2
    rows = [r for r in read_metrics(tmp_path) if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert np.isfinite(r["actor/pg_loss"]) and r["sync/verified"] is True
        assert r.get("actor/old_log_prob_bypassed", 0) == ("bypass" in overrides[-1])


def test_advantages_over_kept_need_a_group_estimator(tmp_path):
    with pytest.raises(ValueError, match="group estimator"):
        load_config(
            TINY, ["train.advantages_over_kept=true", "train.advantage_estimator=reinforce_pp"]
        )


@pytest.mark.slow
def test_advantages_over_kept_end_to_end(tmp_path, monkeypatch):
    """`train.advantages_over_kept`: the batch the learner gets gives every rejected sequence
    advantage 0 and each group's kept sequences advantages that sum to 0 (GRPO over the kept
    ones); the learner's `correction/kept_advantage_mean` reads 0. A sequence-level rejection
    band of +-2% rejects some rows of each batch here (the veto alone rejects none on a random
    model), and a length reward gives the groups a spread."""
    seen = []
    original = Learner.train_on_batch

    def spy(self, state, batch):
        seen.append(jax.device_get(batch))
        return original(self, state, batch)

    monkeypatch.setattr(Learner, "train_on_batch", spy)
    common = [
        "train.steps=2",
        "train.eval_examples=0",
        "sft.steps=0",
        "data.batch_size=2",
        "rollout.n_samples=4",
        "data.reward_fn=sparserl_jax.testing.fixtures:length_reward",
        "learner.correction.reject_level=sequence",
        "learner.correction.reject_lower=0.98",
        "learner.correction.reject_upper=1.02",
    ]
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "train.advantages_over_kept=true", *common])
    train(cfg, log_fn=lambda m: None)
    rows = [r for r in read_metrics(tmp_path) if "critic/score/mean" in r]
    rejected_any = False
    for batch, row in zip(seen, rows, strict=True):
        corr = sparse_rl_weights(
            batch.old_logp_bt, batch.sampler_logp_bt, batch.mask_bt, cfg.learner.correction
        )
        rejected = np.asarray(rejected_sequences(corr.loss_mask_bt, batch.mask_bt))
        rejected_any |= bool(rejected.any()) and not rejected.all()
        adv = np.asarray(batch.advantages_b)
        assert not adv[rejected].any()
        np.testing.assert_allclose(adv.reshape(-1, 4).sum(1), 0.0, atol=1e-5)
        assert abs(row["correction/kept_advantage_mean"]) < 1e-5
    assert rejected_any, "no batch had both kept and rejected rows: the test saw nothing"
    assert any(np.asarray(b.advantages_b).any() for b in seen)


@pytest.mark.slow
def test_adaptive_kv_budget_moves_and_resumes_bit_identically(tmp_path):
    """`rollout.kv.adaptive` on the tiny config: the budget moves between steps as p5 asks,
    every row logs it, and a run stopped after step 2 and resumed ends with the same weights,
    the same controller state and the same rows as one that never stopped."""
    common = [
        "train.eval_examples=0",
        "sft.steps=0",
        "data.batch_size=4",  # 8 rows: one per fake device
        "rollout.kv.adaptive.enabled=true",
        "rollout.kv.adaptive.patience=1",
        "train.save_every=2",
    ]

    def run(run_dir, steps):
        cfg = load_config(TINY, [f"run_dir={run_dir}", f"train.steps={steps}", *common])
        return train(cfg, log_fn=lambda m: None)

    run(tmp_path / "full", 4)
    run(tmp_path / "cut", 2)
    assert run(tmp_path / "cut", 4)["start_step"] == 2

    keys = ("rollout/kv_budget", "correction/rho_p5", "correction/rho_p1", "actor/pg_loss")
    rows = {}
    for name in ("full", "cut"):
        got = [r for r in read_metrics(tmp_path / name) if "critic/score/mean" in r]
        rows[name] = [(r["step"], *(r[k] for k in keys)) for r in got]
    assert rows["full"] == rows["cut"]
    budgets = [r[1] for r in rows["full"]]
    ladder = load_config(TINY, common).rollout.kv_ladder
    assert budgets[0] == 12 and set(budgets) <= set(ladder)
    assert len(set(budgets)) > 1, rows["full"]  # the controller moved the budget
    for (_, budget, p5, *_), nxt in zip(rows["full"], budgets[1:], strict=False):
        i = ladder.index(budget)
        want = ladder[min(i + 1, len(ladder) - 1)] if p5 < 0.86 else budget
        want = ladder[max(i - 1, 0)] if p5 > 0.91 else want
        assert nxt == want, (budget, p5, nxt)

    a, meta_a = _final_state(tmp_path / "full", 4)
    b, meta_b = _final_state(tmp_path / "cut", 4)
    assert_trees_equal(jax.device_get(a), jax.device_get(b))
    assert meta_a["kv_budget"] == meta_b["kv_budget"]
    assert meta_a["kv_budget"]["budget"] in ladder
    # The resumed run took step 3's budget from checkpoint 2, not from the config.
    assert _final_state(tmp_path / "cut", 2)[1]["kv_budget"]["budget"] == budgets[2]


@pytest.mark.slow
def test_eviction_replay_end_to_end(tmp_path):
    """`learner.attention_mask=replay` on the tiny R-KV config: the learner computes the sparse
    policy the sampler ran, so pi_old / mu is 1 up to float rounding (fp32) where the dense
    learner of the same run sees the mismatch; the loop runs and syncs as usual. Replay without
    the record is refused before anything runs."""
    with pytest.raises(ValueError, match="rollout.record_evictions=true"):
        load_config(TINY, ["learner.attention_mask=replay"])
    rows = {}
    for mask in ("dense", "replay"):
        cfg = load_config(
            TINY,
            [
                f"run_dir={tmp_path / mask}",
                "train.steps=2",
                "train.eval_examples=0",
                "sft.steps=0",
                "data.batch_size=4",  # 8 rows: one per fake device
                "rollout.record_evictions=true",
                f"learner.attention_mask={mask}",
            ],
        )
        assert train(cfg, log_fn=lambda m: None)["end_step"] == 2
        rows[mask] = [r for r in read_metrics(tmp_path / mask) if "correction/rho_p5" in r]
    assert len(rows["replay"]) == 2
    for r in rows["replay"]:
        assert r["sync/verified"] is True and np.isfinite(r["actor/pg_loss"])
        assert r["correction/mismatch_kl"] < 1e-9 and abs(r["correction/rho_p5"] - 1) < 1e-4
    # The first step samples from the same weights in both runs: the dense learner sees a gap.
    assert rows["dense"][0]["correction/mismatch_kl"] > 1e3 * max(
        rows["replay"][0]["correction/mismatch_kl"], 1e-12
    )


def test_an_evaluation_only_run_evaluates_once(tmp_path, monkeypatch):
    """`train.steps=0` (no step: the same weights before and after) decodes the held-out set
    once and reports it as both evaluations."""
    from sparserl_jax.sampler import Sampler

    calls = []
    real = Sampler.evaluate
    monkeypatch.setattr(Sampler, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = load_config(
        TINY,
        [f"run_dir={tmp_path}", "train.steps=0", "train.eval_examples=2", "data.batch_size=4"],
    )
    summary = train(cfg, log_fn=lambda m: None)
    assert len(calls) == 1
    assert summary["val_reward_after"] == summary["val_reward_before"]
    assert summary["val_greedy_reward_after"] == summary["val_greedy_reward_before"]
    assert len([r for r in read_metrics(tmp_path) if "val/reward_mean" in r]) == 1


def test_greedy_only_evaluation_keeps_the_greedy_figures(tmp_path):
    """`train.eval_sampled=false` decodes only each held-out prompt's greedy completion (with
    the run's cache and, with `eval_dense`, the full one): the same greedy figures, no sampled
    ones, and a resumed evaluation-only run still counts as evaluated."""
    base = ["train.steps=0", "train.eval_examples=3", "data.batch_size=4", "train.eval_dense=true"]
    both = load_config(TINY, [f"run_dir={tmp_path / 'both'}", *base])
    greedy = load_config(
        TINY, [f"run_dir={tmp_path / 'greedy'}", *base, "train.eval_sampled=false"]
    )
    assert both.rollout.kv is not None
    logs = []
    train(both, log_fn=lambda m: None)
    summary = train(greedy, log_fn=logs.append)
    [want] = read_metrics(tmp_path / "both")
    [row] = read_metrics(tmp_path / "greedy")
    keys = ("val/greedy_reward_mean", "val/dense_greedy_reward_mean")
    assert {k: row[k] for k in keys} == {k: want[k] for k in keys}
    assert not any(k in row for k in ("val/reward_mean", "val/dense_reward_mean"))
    assert "val_reward_before" not in summary
    assert summary["val_greedy_reward_before"] == want["val/greedy_reward_mean"]
    assert any("held-out reward greedy" in m for m in logs), logs


def test_eval_samples_samples_each_held_out_prompt_that_many_times(tmp_path, monkeypatch):
    """`train.eval_samples=1`: each sampled held-out decode (the run's cache and, with
    `eval_dense`, the full one) draws one completion per prompt, and it is the first sample of
    the training-size group (same per-prompt seeds); the greedy decodes are unchanged. A
    negative count is refused in one line."""
    from sparserl_jax.config import ConfigError
    from sparserl_jax.rollout import RolloutEngine

    calls = []
    generate = RolloutEngine.generate

    def spy(self, prompts, **kw):
        res = generate(self, prompts, **kw)
        size = kw.get("n_samples") or self.config.n_samples
        calls.append((self.config.temperature, size, res.completion_ids))
        return res

    monkeypatch.setattr(RolloutEngine, "generate", spy)
    base = ["train.steps=0", "train.eval_examples=3", "data.batch_size=4", "train.eval_dense=true"]
    group = load_config(TINY, [f"run_dir={tmp_path / 'group'}", *base])
    one = load_config(TINY, [f"run_dir={tmp_path / 'one'}", *base, "train.eval_samples=1"])
    n = group.rollout.n_samples
    assert n > 1 and group.rollout.kv is not None
    train(group, log_fn=lambda m: None)
    by_group, calls[:] = list(calls), []
    train(one, log_fn=lambda m: None)
    sampled = [(c, g) for c, g in zip(calls, by_group, strict=True) if c[0] > 0]
    assert len(sampled) == 2  # the run's cache and the full one
    for (_, size, ids), (_, group_size, group_ids) in sampled:
        assert (size, group_size, len(ids)) == (1, n, 3)
        # The same keys draw the same tokens, up to a near-tie that the other batch's float
        # rounding flips (and all that follows it in that row); other keys would agree on ~1%.
        assert np.mean(ids == group_ids[::n]) > 0.9
    greedy = [(c[2], g[2]) for c, g in zip(calls, by_group, strict=True) if c[0] == 0]
    assert len(greedy) == 2
    for ids, want in greedy:
        np.testing.assert_array_equal(ids, want)
    with pytest.raises(ConfigError, match="eval_samples must be >= 0"):
        load_config(TINY, [*base, "train.eval_samples=-1"])


def test_a_resumed_run_does_not_decode_an_evaluation_on_record(tmp_path, monkeypatch):
    """Resumed at a step whose row holds the held-out evaluation (here the first run's "after"
    one), the run takes it from the row (same weights, same seeds) instead of decoding the
    held-out set again: one decode (after step 3), and the same "before" figures."""
    from sparserl_jax.sampler import Sampler

    base = [f"run_dir={tmp_path}", "train.eval_examples=2", "data.batch_size=4"]
    train(load_config(TINY, [*base, "train.steps=2"]), log_fn=lambda m: None)
    at_2 = [r for r in read_metrics(tmp_path) if r["step"] == 2 and "val/reward_mean" in r]
    calls = []
    real = Sampler.evaluate
    monkeypatch.setattr(Sampler, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    summary = train(load_config(TINY, [*base, "train.steps=3"]), log_fn=lambda m: None)
    assert len(calls) == 1 and summary["end_step"] == 3
    assert summary["val_greedy_reward_before"] == at_2[0]["val/greedy_reward_mean"]
    assert summary["val_reward_before"] == at_2[0]["val/reward_mean"]
    assert [r["step"] for r in read_metrics(tmp_path) if "val/reward_mean" in r] == [0, 2, 3]


def test_a_run_resumed_between_evaluations_takes_the_last_one_on_record(tmp_path, monkeypatch):
    """Resumed at a step between evaluations (its training row written, as a run a signal
    stopped after saving leaves it), the run does not decode the held-out set before its next
    step: its "before" is the newest evaluation on record (logged with that step), and the
    metrics hold the same evaluations as before. Resumed at the run's end with no evaluation at
    that step, the "after" one is still decoded (other weights than the one on record)."""
    import json

    from sparserl_jax.sampler import Sampler

    base = [f"run_dir={tmp_path}", "train.eval_examples=2", "data.batch_size=4"]
    every = "train.eval_every=2"
    train(load_config(TINY, [*base, "train.steps=3", every]), log_fn=lambda m: None)
    rows = read_metrics(tmp_path)
    at_2 = next(r for r in rows if r["step"] == 2 and "val/reward_mean" in r)

    def drop_evaluation_at(step):  # as a run a signal stopped after checkpoint `step` leaves it
        rows = read_metrics(tmp_path)
        kept = [r for r in rows if not (r["step"] == step and "val/reward_mean" in r)]
        assert len(kept) == len(rows) - 1 and any(r["step"] == step for r in kept)
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))

    drop_evaluation_at(3)
    calls, logs = [], []
    real = Sampler.evaluate
    monkeypatch.setattr(Sampler, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    summary = train(load_config(TINY, [*base, "train.steps=4", every]), log_fn=logs.append)
    assert len(calls) == 1 and summary["end_step"] == 4  # the "after" one only
    assert summary["val_greedy_reward_before"] == at_2["val/greedy_reward_mean"]
    assert summary["val_reward_before"] == at_2["val/reward_mean"]
    assert any(m.startswith("step 2: held-out reward") for m in logs), logs
    assert [r["step"] for r in read_metrics(tmp_path) if "val/reward_mean" in r] == [0, 2, 4]
    # Resumed at its end: the evaluation on record is step 2's, so step 4's is decoded again.
    drop_evaluation_at(4)
    calls[:] = []
    summary = train(load_config(TINY, [*base, "train.steps=4", every]), log_fn=logs.append)
    assert len(calls) == 1 and summary["val_greedy_reward_before"] == at_2["val/greedy_reward_mean"]
    assert [r["step"] for r in read_metrics(tmp_path) if "val/reward_mean" in r] == [0, 2, 4]
