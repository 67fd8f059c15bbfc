"""The DGG reproduction harness: its figures on synthetic runs, and `--quick` end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.repro_dgg import batches_to_reach, summarise_arm, trailing_mean

ROOT = Path(__file__).resolve().parents[1]


def test_trailing_mean_and_first_hit():
    x = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(trailing_mean(x, 2), [0.0, 0.5, 1.5, 2.5, 3.5])
    steps = np.arange(1, 6)
    assert batches_to_reach(steps, x, 2.0) == 3
    assert batches_to_reach(steps, x, 0.0, first=2) == 2
    assert batches_to_reach(steps, x, 9.0) is None


def rows(train, val_every=2, z_later=0.0):
    out = [{"step": 0, "val/reward_mean": 0.0}]
    for s, r in enumerate(train, start=1):
        row = {"step": s, "critic/score/mean": r, "dgg/fires": 0, "dgg/passes_run": 2}
        row |= {"dgg/passes_applied": 2, "dgg/armed_passes": 1}
        row |= {"dgg/z_pass1": 1.0, "dgg/z_pass2": z_later, "dgg/dg_pass1": 3.0}
        row["dgg/dg_pass2"] = -1.0
        out.append(row)
        if s % val_every == 0:
            out.append({"step": s, "val/reward_mean": r})
    return out


def test_summarise_arm_counts_batches_to_the_single_use_reward():
    single = rows([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    fast = rows([0.4, 0.6, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8], z_later=0.5)
    fig = summarise_arm([fast], [single], smooth=1, tau=0.3)
    # Single use reaches its own final 0.8 at batch 8; the reusing arm at batch 4.
    assert fig["target_train"] == pytest.approx(0.8)
    assert fig["batches_to_target_train"] == 4 and fig["single_batches_to_target_train"] == 8
    assert fig["speedup_train"] == pytest.approx(2.0)
    assert fig["batches_to_target_val"] == 4 and fig["speedup_val"] == pytest.approx(2.0)
    assert fig["gate"]["z_pass1_above_tau"] == 1.0 and fig["gate"]["z_later_above_tau"] == 1.0
    assert fig["ends_below_single_train"] == 0 and fig["ends_below_single_val"] == 0
    slow = rows([0.1] * 8)
    fig = summarise_arm([slow], [single], smooth=2, tau=0.3)
    assert fig["batches_to_target_train"] is None and fig["reached_train"] == 0
    assert fig["speedup_train"] is None
    # Reaching the target on the way down still counts as reaching it; ending below is reported.
    peaked = rows([0.9, 0.9, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1])
    fig = summarise_arm([peaked], [single], smooth=1, tau=0.3)
    assert fig["batches_to_target_train"] == 1 and fig["ends_below_single_train"] == 1


def test_areas_and_rollouts_to_target_with_intervals_over_seeds():
    single = [rows([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], val_every=1) for _ in range(3)]
    fast = [
        rows([0.4, 0.6, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8], val_every=1),
        rows([0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8, 0.8], val_every=1),
        rows([0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.8], val_every=1),
    ]
    fig = summarise_arm(fast, single, smooth=1, tau=0.3)
    # Areas: mean held-out reward after step 0; single's is 0.45 on every seed.
    aucs = [np.mean(r) for r in ([0.4, 0.6, 0.7] + [0.8] * 5, [0.2, 0.4, 0.6] + [0.8] * 5)]
    aucs.append(np.mean([0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.8]))
    ratio = fig["auc_val_vs_single"]
    assert ratio["ratio"] == pytest.approx(np.mean(aucs) / 0.45) and ratio["n"] == 3
    assert ratio["lo"] <= ratio["ratio"] <= ratio["hi"] and ratio["lo"] > 1
    # Batches to single's final 0.8: 4, 4 and 7 against 8: single's mean over the arm's.
    rollouts = fig["rollouts_single_over_arm"]
    assert rollouts["ratio"] == pytest.approx(8 / 5) and rollouts["lo"] >= 8 / 7
    # A trailing mean over 2 evaluations moves the target to (0.7 + 0.8) / 2 and counts from
    # the second evaluation.
    fig = summarise_arm(fast[:1], single[:1], smooth=1, tau=0.3, val_smooth=2)
    assert fig["target_val"] == pytest.approx(0.75) and fig["batches_to_target_val"] == 4
    assert fig["single_batches_to_target_val"] == 8
    # Single use never ends below its own target, on the same trailing mean.
    jagged = rows([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.9, 0.7], val_every=1)
    fig = summarise_arm([jagged], [jagged], smooth=1, tau=0.3, val_smooth=2)
    assert fig["ends_below_single_val"] == 0 and fig["ends_below_single_train"] == 0


@pytest.mark.slow
def test_quick_mode_end_to_end(tmp_path):
    out = tmp_path / "dgg"
    proc = subprocess.run(
        [sys.executable, "tools/repro_dgg.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [a["arm"] for a in last["arms"]] == ["single", "dgg4"]
    dgg = last["arms"][1]
    assert dgg["passes_applied_per_batch"] <= 4 and dgg["learner_passes"] >= 3
    assert "z_later_mean" in dgg["gate"]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every arm started from the one shared SFT checkpoint.
    for arm in ("single", "dgg4"):
        log = (out / "lr=0.001" / f"{arm}_s0" / "stderr.log").read_text()
        assert "resumed from" in log and "at step 0" in log


def fixed_rows(energies):
    """Rows of a fixed-reuse run (gate off) with the given `[batches, K]` energies per pass."""
    out, prev = [], None
    for s, g in enumerate(energies, start=1):
        row = {"step": s, "dgg/g": g[-1], "dgg/fires": 0, "dgg/passes_run": len(g)}
        for k, e in enumerate(g, start=1):
            row[f"dgg/dg_pass{k}"] = 0.0 if prev is None else e - prev
            prev = e
        out.append(row)
    return out


def test_replay_rebuilds_energies_and_finds_a_surge():
    from benchmarks.repro_dgg import pass_energies, replay_gates

    rng = np.random.default_rng(0)
    # Every batch: a fresh-batch energy, then falling over the passes ...
    g = [[1.0 + 0.1 * rng.random(), 0.5, 0.25, 0.125] for _ in range(12)]
    g[10] = [1.0, 0.5, 2.0, 0.125]  # ... except batch 11, whose pass 3 surges
    rows = fixed_rows(g)
    got, m = pass_energies(rows)
    np.testing.assert_allclose(got, g, rtol=1e-12)
    assert m == 1
    replay = replay_gates(rows, tau=0.3, window=8)
    # The increment +1.5 tops every earlier one, pass-1 jumps included.
    assert replay["pooled"]["first_fire_batch"] == 11
    assert replay["pooled_rising"]["fires"] == 1
    # Without pass-1 jumps in the window, pass 4's smaller drop (-0.125) already stands out
    # against the window of later drops (-0.5, -0.25, -0.125): fires at the first step armed,
    # batch 3's pass 4 (the window's 8 values: batches 1-2 and batch 3's passes 2-3).
    assert replay["pooled_later"]["first_fire_batch"] == 3
    assert replay["per_pass_g"]["first_fire_batch"] == 11
    assert replay["g_last_over_first"]["first_half"] < 0.13


def test_replay_tests_every_step_of_mini_batch_passes():
    from benchmarks.repro_dgg import pass_energies, replay_gates

    rng = np.random.default_rng(1)
    # 2 passes of 2 mini-batches: the energy of every step, falling over the passes ...
    g = [[1.0 + 0.1 * rng.random(), 0.9, 0.5, 0.45] for _ in range(12)]
    g[9] = [1.0, 0.9, 0.5, 3.0]  # ... except batch 10's pass 2, mini-batch 2
    rows = []
    for s, e in enumerate(g, start=1):
        row = {"step": s, "dgg/passes_run": 2, "actor/updates": 4, "dgg/dg_pass1": 0.0}
        rows.append(row | {f"dgg/g_update{i}": v for i, v in enumerate(e, start=1)})
    got, m = pass_energies(rows)
    np.testing.assert_allclose(got, g, rtol=0)
    assert m == 2
    replay = replay_gates(rows, tau=0.3, window=8)
    assert replay["pooled"]["first_fire_batch"] == 10
    assert replay["pooled_rising"]["fires"] == 1  # the only rising step of a pass > 1
    assert replay["per_pass_g"]["first_fire_batch"] == 10
