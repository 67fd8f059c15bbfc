"""The adaptive KV budget: the ladder, the hysteresis control law, and its config checks."""

import dataclasses
from pathlib import Path

import pytest
from flax import nnx

from sparserl_jax.config import ConfigError, load_config
from sparserl_jax.kvcache import (
    AdaptiveBudgetConfig,
    BudgetController,
    BudgetState,
    CompressionConfig,
    budget_ladder,
)
from sparserl_jax.rollout import RolloutConfig
from sparserl_jax.sampler import Sampler
from sparserl_jax.testing import tiny_model

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def controller(patience=2, backoff=2, max_patience=32, max_rejected=None):
    return BudgetController(
        (16, 32, 48, 64),
        target=0.86,
        margin=0.05,
        patience=patience,
        backoff=backoff,
        max_patience=max_patience,
        max_rejected=max_rejected,
    )


def test_raise_at_once_below_target():
    c = controller()
    s = c.init(32)
    assert s == BudgetState(32, 0)
    assert c.update(s, 0.85) == BudgetState(48, 0)
    assert c.update(BudgetState(32, 1), 0.2) == BudgetState(48, 0)  # resets the streak
    assert c.update(s, float("nan")) == BudgetState(48, 0)  # unknown tail: be safe


def test_lower_after_patience_above_the_band():
    c = controller(patience=2)
    s = c.update(BudgetState(48, 0), 0.95)
    assert s == BudgetState(48, 1)  # one step above: wait
    # Two in a row: one rung down, and the rung below is on trial for `patience` steps.
    assert c.update(s, 0.95) == BudgetState(32, 0, trial=2)
    assert controller(patience=1).update(BudgetState(48, 0), 0.95) == BudgetState(32, 0, trial=1)


def _walk(c, state, p5_of_budget, steps):
    budgets = []
    for _ in range(steps):
        budgets.append(state.budget)
        state = c.update(state, p5_of_budget(state.budget))
    return budgets, state


def test_failed_probes_back_off_geometrically():
    # Rung 32 always fails (p5 0.5); 48 is well above the band (0.95).
    p5 = {32: 0.5, 48: 0.95}.__getitem__
    budgets, state = _walk(controller(patience=2, max_patience=8), BudgetState(48), p5, 40)
    # Waits before each probe of 32: 2, 4, 8, then capped at max_patience = 8.
    probes = [i for i, b in enumerate(budgets) if b == 32]
    assert probes == [2, 7, 16, 25, 34]
    assert state.wait == 8
    # Without backoff the failing rung is probed every patience + 1 = 3 steps (the old law).
    budgets, _ = _walk(controller(patience=2, backoff=1), BudgetState(48), p5, 12)
    assert budgets == [48, 48, 32] * 4


def test_a_passed_probe_resets_the_wait():
    c = controller(patience=2)
    s = BudgetState(32, 0, wait=8, trial=2)  # just lowered to 32 after a long wait
    s = c.update(s, 0.88)  # in the band: the trial goes on
    assert s == BudgetState(32, 0, wait=8, trial=1)
    s = c.update(s, 0.95)  # patience steps at or above the target: passed
    assert s == BudgetState(32, 1)  # wait back to patience (stored as 0), one step above
    assert c.update(s, 0.95) == BudgetState(16, 0, trial=2)  # the next rung after `patience`
    # A failure after the trial ended raises without backing off.
    assert c.update(BudgetState(32, 1), 0.5) == BudgetState(48, 0)
    # A failure during the trial backs off, and a rung that fails at once is probed rarely.
    assert c.update(BudgetState(32, 0, wait=8, trial=1), 0.5) == BudgetState(48, 0, wait=16)


def test_a_step_that_rejects_too_many_sequences_raises_the_budget():
    c = controller(max_rejected=0.2)
    # p5 above the band or in it, but a quarter or half of the batch rejected: up at once.
    assert c.update(BudgetState(32, 0), 0.95, rejected=0.5) == BudgetState(48, 0)
    assert c.update(BudgetState(32, 1), 0.88, rejected=0.25) == BudgetState(48, 0)
    # At or under the limit p5 decides, as without it.
    assert c.update(BudgetState(48, 0), 0.95, rejected=0.2) == BudgetState(48, 1)
    assert c.update(BudgetState(48, 1), 0.95, rejected=0.0) == BudgetState(32, 0, trial=2)
    # A probe that rejects too many has failed: back up, and wait longer before the next.
    assert c.update(BudgetState(32, 0, trial=2), 0.95, rejected=0.5) == BudgetState(48, 0, wait=4)
    # A non-finite fraction (no sequence in the batch) is read as too many.
    assert c.update(BudgetState(32, 0), 0.95, rejected=float("nan")) == BudgetState(48, 0)
    # Without the limit (the default: Sparrow's law) the fraction is not read.
    assert controller().update(BudgetState(32, 0), 0.95, rejected=1.0) == BudgetState(32, 1)
    with pytest.raises(ValueError, match=r"max_rejected must be in \[0, 1\), got 1"):
        controller(max_rejected=1)


def test_the_rejection_limit_keeps_the_budget_off_a_rung_where_half_the_batch_is_vetoed():
    # The L/4 study's adaptive arm (docs/reproductions.md): at its low rung p5 sat in the band
    # (0.88: hold) while 48% of sequences were vetoed; the rung above had p5 0.975, 1% vetoed.
    seen = {32: (0.88, 0.48), 48: (0.975, 0.01)}

    def walk(c, steps=60):
        state, budgets = BudgetState(32), []
        for _ in range(steps):
            budgets.append(state.budget)
            state = c.update(state, *seen[state.budget])
        return budgets

    assert walk(controller()) == [32] * 60  # p5 alone never leaves the rung
    budgets = walk(controller(max_rejected=0.2, max_patience=16))
    # Probes of 32 after waits of 2, 4, 8, 16, 16 steps at 48: 6 of 60 steps at the low rung.
    assert [i for i, b in enumerate(budgets) if b == 32] == [0, 3, 8, 17, 34, 51]


def test_hysteresis_band_holds_and_resets_streak():
    c = controller()
    # Inside [target, target + margin] = [0.86, 0.91]: hold, and forget any streak.
    for p5 in (0.86, 0.88, 0.91):
        assert c.update(BudgetState(48, 1), p5) == BudgetState(48, 0)
    # A p5 oscillating across the lower bound of the band never lowers the budget.
    s = BudgetState(48, 0)
    for p5 in (0.95, 0.9, 0.95, 0.9, 0.95):
        s = c.update(s, p5)
    assert s.budget == 48


def test_clamped_to_the_ladder():
    c = controller(patience=1)
    assert c.update(BudgetState(64, 0), 0.1) == BudgetState(64, 0)
    assert c.update(BudgetState(16, 0), 0.99) == BudgetState(16, 0)
    assert c.init(10) == BudgetState(16, 0)
    assert c.init(40) == BudgetState(48, 0)  # the lowest rung at or above
    assert c.init(100) == BudgetState(64, 0)
    with pytest.raises(ValueError, match="not on the adaptive ladder"):
        c.update(BudgetState(40, 0), 0.9)


def test_restore_round_trip_and_checks():
    c = controller()
    s = BudgetState(48, 1, wait=8, trial=1)
    assert c.restore(s._asdict()) == s
    assert c.restore({"budget": 48, "above": 1}) == BudgetState(48, 1)  # saved before backoff
    with pytest.raises(ValueError, match=r"KV budget 40 is not on the adaptive ladder"):
        c.restore({"budget": 40, "above": 0})
    with pytest.raises(ValueError, match="ascending"):
        BudgetController((32, 16), target=0.86, margin=0.05, patience=1)


def test_ladder_page_steps_and_levels():
    # By default the ladder reaches down to half the start budget (above the window), with the
    # start budget a rung: 6, then 12 +- whole pages (2 of 4 tokens) up to 32.
    down = CompressionConfig(budget=12, window=4, adaptive=AdaptiveBudgetConfig(enabled=True))
    assert budget_ladder(down, page_size=4, max_len=32) == (6, 12, 20, 28, 32)
    assert budget_ladder(down, page_size=1, max_len=16) == (6, 8, 10, 12, 14, 16)
    with pytest.raises(ValueError, match="levels=2 cannot hold"):
        budget_ladder(
            dataclasses.replace(down, adaptive=AdaptiveBudgetConfig(enabled=True, levels=2)),
            page_size=4,
            max_len=32,
        )
    kv = CompressionConfig(
        budget=12, window=4, adaptive=AdaptiveBudgetConfig(enabled=True, min_budget=12)
    )
    # From 12 to 32 in 6 rungs at most: stride = ceil(20 / (5 * 4)) pages = 1 page of 4.
    assert budget_ladder(kv, page_size=4, max_len=32) == (12, 16, 20, 24, 28, 32)
    # A long rollout still gets at most `levels` rungs, each step a whole number of pages.
    ladder = budget_ladder(kv, page_size=16, max_len=4096)
    assert len(ladder) <= 6 and ladder[0] == 12 and ladder[-1] == 4096
    assert {b - a for a, b in zip(ladder[:-2], ladder[1:-1], strict=True)} == {ladder[1] - 12}
    assert (ladder[1] - 12) % 16 == 0
    kv2 = CompressionConfig(
        budget=64, adaptive=AdaptiveBudgetConfig(enabled=True, min_budget=32, max_budget=96)
    )
    assert budget_ladder(kv2, page_size=16, max_len=4096) == (32, 48, 64, 80, 96)
    assert controller().init(64) == BudgetState(64, 0)


def test_config_section_and_validation():
    cfg = load_config(
        TINY, ["rollout.kv.adaptive.enabled=true", "rollout.kv.adaptive.max_budget=24"]
    )
    assert cfg.rollout.kv.adaptive.target == 0.86
    assert cfg.rollout.kv_ladder == (6, 8, 12, 16, 20, 24)  # down to half the start
    assert load_config(TINY).rollout.kv.adaptive.enabled is False  # off by default
    assert cfg.rollout.kv.adaptive.max_rejected is None  # p5 alone by default
    limited = load_config(
        TINY, ["rollout.kv.adaptive.enabled=true", "rollout.kv.adaptive.max_rejected=0.2"]
    )
    kv = limited.rollout.kv
    assert BudgetController.from_config(kv, page_size=4, max_len=32).max_rejected == 0.2
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.kv.adaptive.targt'.*'target'"):
        load_config(TINY, ["rollout.kv.adaptive.targt=0.9"])
    with pytest.raises(ConfigError, match=r"rollout.kv.adaptive.margin = 'x'"):
        load_config(TINY, ["rollout.kv.adaptive.margin=x"])
    bad = [
        (["rollout.kv.adaptive.target=1.5"], r"target must be in \(0, 1\]"),
        (["rollout.kv.adaptive.margin=0"], "hysteresis band"),
        (["rollout.kv.adaptive.levels=1"], "levels must be >= 2"),
        (["rollout.kv.adaptive.backoff=0"], r"backoff must be >= 1 \(1: no backoff\)"),
        (["rollout.kv.adaptive.max_patience=1"], r"max_patience \(1\) must be >= .*patience"),
        (["rollout.kv.adaptive.max_rejected=1.0"], r"max_rejected must be in \[0, 1\)"),
        (["rollout.kv.adaptive.min_budget=16"], r"must lie in .*\[16, the rollout length\]"),
        (["rollout.kv.adaptive.min_budget=4"], r"min_budget \(4\) must exceed window"),
        (["rollout.kv.adaptive.max_budget=10"], r"\[12, 10\]"),
        (
            ["rollout.kv.budget=32", "rollout.kv.adaptive.min_budget=32"],
            r"min_budget < max_budget, got \[32, 32\]",
        ),
        (["rollout.kv.policy=none"], "needs a compression policy"),
        # 7 pages hold a slot at budget 12 (6 pages) but not at the top rung, 32 (8).
        (["rollout.num_pages=7"], "num_pages=7 cannot hold one sequence"),
    ]
    for overrides, match in bad:
        with pytest.raises(ConfigError, match=match):
            load_config(TINY, ["rollout.kv.adaptive.enabled=true", *overrides])
    with pytest.raises(ConfigError, match="generate.kv.adaptive"):
        load_config(TINY, ["generate.kv.policy=rkv", "generate.kv.adaptive.enabled=true"])


def test_sampler_switches_budgets_compiling_once_per_rung():
    """Each budget's engines are built once and kept: going back to a budget reuses its
    compiled programs, and a smaller budget rolls out in a smaller peak KV."""
    model = tiny_model(seed=3)
    rollout = RolloutConfig(
        num_slots=2,
        max_prompt_len=6,
        max_new_tokens=24,
        chunk_steps=8,
        page_size=4,
        kv=CompressionConfig(policy="streaming", budget=8, window=2, interval=4, sink_tokens=1),
    )
    params = nnx.to_pure_dict(nnx.state(model))
    sampler = Sampler.create(model, params, rollout, shardings={}, publish_dtype=None)
    assert sampler.kv_budget == 8 and sampler.engine.config.kv.budget == 8
    prompts = [[5, 6, 7], [9, 10]]
    peaks = {}
    for budget in (8, 16, 8, 16, 8):
        sampler.set_kv_budget(budget)
        res = sampler.engine.generate(prompts)
        peaks.setdefault(budget, res.stats["kv_peak_bytes"])
        assert res.stats["kv_peak_bytes"] == peaks[budget]
    assert sorted(sampler.by_budget) == [8, 16]
    for engine, eval_engine in sampler.by_budget.values():
        assert engine._chunk._cache_size() == engine._prefill._cache_size() == 1
        assert eval_engine.config.temperature == 0.0
    assert peaks[8] < peaks[16]
    assert sampler.by_budget[16][0].config.kv.budget == 16
