"""pi_old from the first pass in the loops (`step.learn_step`): `sparserl train` and the
decoupled trainer at staleness 0 on the tiny config computing in bf16 (the published weights
are bf16, so the forward at the fp32 master is the forward at the published weights).

- `sparserl train` takes pi_old from the first pass (metrics row: no recompute) and its first
  step equals the run with `learner.old_logp_from_first_pass=false` to bf16 tolerance (one
  micro-batch: the step is the recompute's, computed in place; seen bit-identical on XLA:CPU);
- the decoupled trainer at staleness 0 takes it from the first pass as well and still equals
  `sparserl train` bit for bit (`tests/test_decoupled.py` checks the same at fp32, where both
  keep the recompute).
"""

import threading
from pathlib import Path

import jax
import numpy as np
import pytest
import tensorstore as ts

from sparserl_jax.build import build_model
from sparserl_jax.checkpoint import CheckpointManager
from sparserl_jax.config import load_config
from sparserl_jax.decoupled.exchange import Exchange
from sparserl_jax.decoupled.sampler_job import run_sampler
from sparserl_jax.decoupled.trainer import run_trainer
from sparserl_jax.metrics import read_metrics
from sparserl_jax.rl import Learner
from sparserl_jax.testing import assert_trees_equal
from sparserl_jax.train import train

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
COMMON = [
    "model.dtype=bfloat16",
    "data.batch_size=4",  # 8 rows over the 8 fake devices of the test process
    "sft.steps=0",
    "train.eval_examples=0",
    "exchange.poll_s=0.05",
    "async.max_staleness=0",
    # Every rollout moves the weights (a random model scores 0 on the task's own reward).
    "data.reward_fn=sparserl_jax.testing.fixtures:length_reward",
]


def _params(run_dir, step):
    cfg = load_config(TINY, [f"run_dir={run_dir}", *COMMON])
    model = build_model(cfg.model)
    template = {"learner": Learner(model, cfg.learner).init(model)}
    mngr = CheckpointManager(run_dir, async_save=False)
    state, _ = mngr.restore(step, template)
    mngr.close()
    return jax.device_get(state["learner"].params)


def _rows(run_dir):
    return [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "critic/score/mean" in r]


@pytest.mark.slow
def test_loops_take_pi_old_from_the_first_pass(tmp_path):
    on, off, dec = tmp_path / "on", tmp_path / "off", tmp_path / "dec"
    train(load_config(TINY, [f"run_dir={on}", "train.steps=2", *COMMON]), log_fn=print)
    overrides = ["train.steps=1", "learner.old_logp_from_first_pass=false", *COMMON]
    train(load_config(TINY, [f"run_dir={off}", *overrides]), log_fn=print)
    cfg = load_config(TINY, [f"run_dir={dec}", "train.steps=2", *COMMON])
    ctx, got = ts.Context(), {}
    sampler = threading.Thread(
        target=lambda: got.update(
            run_sampler(cfg, "0", url="memory://", exchange=Exchange("memory://", context=ctx))
        )
    )
    sampler.start()
    summary = run_trainer(cfg, exchange=Exchange("memory://", context=ctx))
    sampler.join(timeout=300)
    assert summary["end_step"] == 2 and got["exit_code"] == 0

    for run, want in ((on, 1), (off, 0), (dec, 1)):
        rows = _rows(run)
        assert rows and all(r["actor/old_log_prob_from_first_pass"] == want for r in rows), run
    assert all(r["timing_s/old_log_prob"] < 1e-3 for r in _rows(on))  # no separate forward
    # Step 1 samples the same rollout in both runs: pi_old's statistics are the same, and so
    # are the weights after it (bf16 tolerance, tests/rl/test_rl_first_pass.py).
    row_on, row_off = _rows(on)[0], _rows(off)[0]
    for k in [k for k in row_off if k.startswith("correction/")]:
        np.testing.assert_allclose(row_on[k], row_off[k], rtol=1e-5, atol=1e-7, err_msg=k)
    first_on, first_off = _params(on, 1), _params(off, 1)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(first_on), jax.tree.leaves(first_off), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-4, err_msg=jax.tree_util.keystr(path))
    assert_trees_equal(_params(on, 2), _params(dec, 2), what="decoupled vs sparserl train")
