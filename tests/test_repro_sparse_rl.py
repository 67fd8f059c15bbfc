"""`tools/repro_sparse_rl.py --quick` (the CI smoke test of the Sparse-RL study) and the study's
one shared SFT start: a run resumed from a copy of the warm start's step-0 checkpoint is the run
that would have done its own warm start, row for row."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from sparserl_jax.config import load_config
from sparserl_jax.metrics import read_metrics
from sparserl_jax.train import train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

# Keys that differ between two runs of the same computation: clocks and speeds, and the patch
# sizes (each run's own random run id is in PULSESync's compressed header: a byte or two apart).
_CLOCKS = ("timing_s/", "perf/", "wall_time_s", "sync/payload_bytes")


def _numbers(rows):
    return [{k: v for k, v in r.items() if not k.startswith(_CLOCKS)} for r in rows]


@pytest.mark.slow
def test_quick_study_runs_and_shares_one_sft_start(tmp_path, capsys, monkeypatch):
    import repro_sparse_rl

    monkeypatch.chdir(ROOT)
    out = tmp_path / "study"
    result = repro_sparse_rl.main(["--quick", "--out", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(result))
    assert result["budgets"] == [8] and result["rollout_length"] == 32
    sig = result["signature"]["8"] if "8" in result["signature"] else result["signature"][8]
    assert 0 <= sig["sparse_greedy"] <= 1 and 0 <= sig["dense_greedy"] <= 1
    cells = {c["arm"]: c for c in result["cells"]}
    assert set(cells) == {"dense", "corrected", "replay"}
    # Replay trains the sparse policy itself: its ratio to the sampler is 1 up to rounding.
    assert cells["replay"]["evicted_fraction"]["mean"] > 0
    assert cells["replay"]["mismatch_kl"]["mean"] < 1e-9 < cells["corrected"]["mismatch_kl"]["mean"]
    assert cells["dense"]["peak_kv_vs_dense"] == pytest.approx(1.0)
    assert cells["corrected"]["peak_kv_bytes"]["mean"] < cells["dense"]["peak_kv_bytes"]["mean"]
    assert cells["corrected"]["evicted_fraction"]["mean"] > 0
    assert result["targets"] and result["targets"][0]["budget"] == 8
    assert (out / "curves.png").stat().st_size > 0

    # The corrected run started from the copied step-0 checkpoint; the same config with its own
    # SFT stage in a fresh directory gives the same rows (numbers, not clocks).
    copied = out / "runs" / "corrected_s0_b8"
    overrides = json.loads((copied / "config.json").read_text())
    assert overrides["train"]["eval_dense"] is True
    fresh = tmp_path / "fresh"
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "sft.steps=2",
            "data.batch_size=4",
            "train.eval_examples=4",
            "train.eval_every=0",
            "train.save_every=2",
            "train.steps=2",
            "train.progress=false",
            "train.plot=false",
            f"run_dir={fresh}",
            "train.seed=0",
            "train.eval_dense=true",
            "rollout.kv.budget=8",
        ],
    )
    train(cfg, log_fn=lambda m: None)
    assert _numbers(read_metrics(fresh)) == _numbers(read_metrics(copied))


def test_signature_failures_name_each_part():
    sys.path.insert(0, str(ROOT))
    from benchmarks.repro_sparse_rl import signature_failures

    good = {"ratio": 0.7, "evicted_fraction": 0.6, "mismatch_kl": 0.1, "rho_p5": 0.5}
    assert signature_failures(good) == []
    bad = {"ratio": 0.95, "evicted_fraction": 0.3, "mismatch_kl": 0.5, "rho_p5": 0.86}
    got = signature_failures(bad)
    assert [g.split(" =")[0] for g in got] == ["ratio", "evicted_fraction", "mismatch_kl", "rho_p5"]
    assert got[0].startswith("ratio = 0.950, needs [0.5, 0.9): sparse greedy")
    assert got[1].startswith("evicted_fraction = 0.300, needs >= 0.5")
    assert got[3].startswith("rho_p5 = 0.860, needs < 0.86")
    assert signature_failures({**good, "mismatch_kl": None}) == [
        "mismatch_kl = missing, needs [0.02, 0.3): a mismatch the correction can see and still "
        "correct"
    ]


@pytest.mark.slow
def test_a_run_cut_off_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """The study can run in pieces: a run stopped mid-way (its done.json missing, checkpoints
    left) resumes from its newest checkpoint instead of starting over, and ends as it would
    have; a finished one is kept."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import repro_sparse_rl as study

    monkeypatch.chdir(ROOT)
    base = [
        "sft.steps=2",
        "data.batch_size=4",
        "train.eval_examples=0",
        "train.save_every=1",
        "train.progress=false",
        "train.plot=false",
        "rollout.kv.budget=8",
    ]
    sft = load_config("configs/tiny.yaml", [*base, f"run_dir={tmp_path / 'sft'}", "train.steps=0"])
    train(sft, log_fn=lambda m: None)
    cfg = load_config("configs/tiny.yaml", [*base, f"run_dir={tmp_path / 'run'}", "train.steps=3"])
    logs = []
    study._run(cfg, tmp_path / "sft", 0, logs.append)
    whole = _numbers(read_metrics(cfg.run_dir))
    # Cut off after step 1: no done.json, checkpoints 2 and 3 and their rows never written.
    (Path(cfg.run_dir) / "done.json").unlink()
    for s in (2, 3):
        shutil.rmtree(Path(cfg.run_dir) / "checkpoints" / str(s))
    study._run(cfg, tmp_path / "sft", 0, logs.append)
    assert any("resumes from its checkpoint 1" in m for m in logs), logs
    assert _numbers(read_metrics(cfg.run_dir)) == whole
    study._run(cfg, tmp_path / "sft", 0, logs.append)
    assert "done before: kept" in logs[-1]
