"""`tools/repro_sparse_rl.py --quick` (the CI smoke test of the Sparse-RL study) and the study's
one shared SFT start: a run resumed from a copy of the warm start's step-0 checkpoint is the run
that would have done its own warm start, row for row."""

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from sparserl_jax.checkpoint import TEST_SIGNAL_ENV
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
    # The tool turns JAX's persistent compilation cache on (the arms share programs); here it
    # uses the suite's own when there is one (other tests compile the same tiny programs). Set
    # back after it (the cache is set up once per process), or every later test in this
    # process reads and writes the tool's directory.
    before = jax.config.jax_compilation_cache_dir
    cache = ["--compile-cache", before] if before else []
    try:
        result = repro_sparse_rl.main(["--quick", "--out", str(out), "--heldout", "6", *cache])
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(result))
    # Read again with a seed never run: `--finished-only` reports the same cells from disk and
    # leaves the missing seed out (nothing started for it).
    try:
        again = repro_sparse_rl.main(
            ["--quick", "--out", str(out), "--heldout", "6", "--seeds", "0", "1", "--finished-only"]
            + cache
        )
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()
    assert again["cells"] == result["cells"] and again["targets"] == result["targets"]
    assert not list((out / "runs").glob("*_s1*"))
    _check_archive(out, tmp_path / "archive", result, cache, capsys)
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
    assert 0 < cells["corrected"]["peak_kv_tokens_vs_dense"] < 1  # the paper's count, in tokens
    assert cells["corrected"]["evicted_fraction"]["mean"] > 0
    assert result["targets"] and result["targets"][0]["budget"] == 8
    ci = cells["corrected"]["dense_greedy_vs_dense_ci"]
    assert ci["n"] == 1 and ci["lo"] is None  # one seed: a ratio, no interval
    assert "reached_target" in cells["corrected"] and result["target_reward"] is not None
    assert (out / "curves.png").stat().st_size > 0
    # --heldout: every run's final weights decoded on 6 prompts, one greedy completion and one
    # sampled each, dense and at budget 8.
    for arm in ("dense", "corrected"):
        heldout = out / "runs" / f"{arm}_s0{'' if arm == 'dense' else '_b8'}_heldout6_b8"
        [row] = read_metrics(heldout)
        cfg = json.loads((heldout / "config.json").read_text())
        assert cfg["train"]["eval_samples"] == 1 and cfg["train"]["eval_examples"] == 6
        assert cells[arm]["heldout_prompts"] == 6
        for key, name in (
            ("heldout_greedy", "greedy_reward_mean"),
            ("heldout_dense_greedy", "dense_greedy_reward_mean"),
            ("heldout_sampled", "reward_mean"),
            ("heldout_dense_sampled", "dense_reward_mean"),
        ):
            assert cells[arm][key]["mean"] == row[f"val/{name}"], key
            assert row[f"val/{name}"] * 6 == pytest.approx(round(row[f"val/{name}"] * 6))
    for key in ("heldout_dense_greedy", "heldout_dense_sampled"):
        assert cells["dense"][f"{key}_vs_dense_ci"]["ratio"] in (1.0, None)
    assert result["targets"][0]["greedy_heldout_prompts"] == 6
    # tools/token_mismatch.py on the SFT start at the study's budget: every token after an
    # eviction has one kind, and the kinds' tails add up to the whole tail.
    from token_mismatch import measure

    mm = measure(out / "sft", 0, 8, num=2, samples=2, seed=0)
    assert 0 < mm["tokens_after_eviction"] <= mm["tokens"] and mm["sequences"] == 4
    kinds = mm["kinds"].values()
    assert sum(k["share"] for k in kinds) == pytest.approx(1.0)
    assert sum(k["share"] * k["below_tail"] for k in kinds) == pytest.approx(mm["below_tail"])
    assert sum(k["share"] * k["mismatch_kl"] for k in kinds) == pytest.approx(
        mm["mismatch_kl"], rel=1e-5
    )

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


def _check_archive(out, archive, result, cache, capsys):
    """The study's archive (`--archive`) of the quick study: the SFT start's step-0 checkpoint
    and every finished run without checkpoints; on a machine without `out`, the same report,
    the same SFT bits, and a decode that needs a run's dropped checkpoint left out in a line."""
    import repro_sparse_rl

    from benchmarks.repro_sparse_rl import restore_checkpoint
    from benchmarks.study_archive import ArchiveError, restore_archive, save_archive

    before = jax.config.jax_compilation_cache_dir
    saved = save_archive(out, archive)
    assert "sft" in saved and "runs/dense_s0" in saved and "signature/b8" in saved
    kept = sorted(str(p.relative_to(archive)) for p in archive.rglob("checkpoints/*"))
    assert kept == ["sft/checkpoints/0"]
    assert save_archive(out, archive) == []  # nothing new
    with pytest.raises(ArchiveError, match="not of"):
        restore_archive(archive, out.with_name("elsewhere"))
    gone = out.with_name("gone")
    out.rename(gone)
    capsys.readouterr()
    try:
        again = repro_sparse_rl.main(
            ["--quick", "--out", str(out), "--heldout", "6", "--finished-only"]
            + ["--archive", str(archive), *cache]
        )
        assert again["cells"] == result["cells"] and again["targets"] == result["targets"]
        # A decode the archive does not hold needs the run's final checkpoint: left out.
        other = repro_sparse_rl.main(
            ["--quick", "--out", str(out), "--heldout", "5", "--archive", str(archive), *cache]
        )
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()
    assert "heldout_prompts" not in {k for c in other["cells"] for k in c}
    assert "which is not on disk" in capsys.readouterr().err
    a, b = restore_checkpoint(out / "sft", 0).params, restore_checkpoint(gone / "sft", 0).params
    assert all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    shutil.rmtree(out)
    gone.rename(out)


def test_every_arm_is_a_valid_config_of_the_study():
    from benchmarks.repro_sparse_rl import ARMS, Study, batch_overrides

    study = Study(config="configs/repro_sparse_rl.yaml", out_dir="unused", steps=3)
    for arm, overrides in ARMS.items():
        cfg = study.cfg(*overrides, "rollout.kv.budget=128")
        assert cfg.train.steps == 3, arm
    base = study.cfg("data.batch_size=8")
    half = study.cfg(*ARMS["dense_half"], *batch_overrides("dense_half", base))
    assert half.data.batch_size == 4 and not half.rollout.sparse
    double = study.cfg(*ARMS["corrected_double"], *batch_overrides("corrected_double", base))
    assert double.data.batch_size == 16 and double.rollout.sparse
    # twice the prompts through the slots one study batch fills: corrected's peak KV
    assert double.rollout.num_slots == 8 * base.rollout.n_samples
    assert batch_overrides("corrected", base) == ()


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


def test_sft_start_is_kept_across_rl_batching_but_not_across_its_data(tmp_path):
    """An arm with fewer prompts per RL step reuses the study's SFT start (the SFT reads its
    own pairs in `sft.batch_size`); anything the pairs depend on voids it."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import repro_sparse_rl as study
    from sparserl_jax.config import to_dict

    def cfg(*extra):
        return load_config(ROOT / "configs/tiny.yaml", [f"run_dir={tmp_path}", *extra])

    assert not study._sft_done(cfg())
    (tmp_path / "done.json").write_text(json.dumps({"config": to_dict(cfg()), "summary": {}}))
    assert study._sft_done(cfg())
    assert study._sft_done(cfg("data.batch_size=3", "data.shuffle=false", "train.steps=7"))
    # How teacher forcing computes is not what the start is: a faster layout keeps it.
    assert study._sft_done(cfg("model.attention_block=128", "model.remat=true"))
    assert study._sft_done(cfg("model.attention=dense", "model.mlp_chunk=0"))
    assert not study._sft_done(cfg("model.dtype=bfloat16"))
    assert not study._sft_done(cfg("data.seed=5"))
    # A key the code gained since the run was saved reads at its default: still the same run.
    saved = json.loads((tmp_path / "done.json").read_text())
    del saved["config"]["train"]["eval_sampled"]
    (tmp_path / "done.json").write_text(json.dumps(saved))
    assert study._sft_done(cfg()) and study._done(cfg()) == {}
    assert study._done(cfg("train.eval_sampled=false")) is None
    assert not study._sft_done(cfg("sft.batch_size=3"))
    assert not study._sft_done(cfg("model.seed=1"))


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
    # A signal stops it at a safe point: the study stops (one exception, no done.json, so the
    # run is not taken as finished), and the same call resumes it to the same end.
    (Path(cfg.run_dir) / "done.json").unlink()
    for s in (2, 3):
        shutil.rmtree(Path(cfg.run_dir) / "checkpoints" / str(s))
    monkeypatch.setenv(TEST_SIGNAL_ENV, "update:3")
    with pytest.raises(study.RunStopped, match="stopped by SIGTERM during the update of step 3"):
        study._run(cfg, tmp_path / "sft", 0, logs.append)
    assert not (Path(cfg.run_dir) / "done.json").exists()
    monkeypatch.delenv(TEST_SIGNAL_ENV)
    study._run(cfg, tmp_path / "sft", 0, logs.append)
    assert "cut off before: resumes from its checkpoint 3" in logs[-2]  # the step ended first
    assert _numbers(read_metrics(cfg.run_dir)) == whole


@pytest.mark.slow
def test_a_longer_run_extends_the_shorter_one_bit_for_bit(tmp_path, monkeypatch):
    """`extend_from`: the 4-step run `<name>_t4` continues the 2-step `<name>` (run first) from
    its checkpoint 2 and metrics, and ends as a 4-step run from step 0 does; killed before it
    trained, it starts over from the copy; a 2-step run kept without its checkpoint (restored
    from an archive) gives a run from step 0, the same again."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import repro_sparse_rl as study

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(study, "_signature", lambda *a, **k: {})
    overrides = (
        "sft.steps=2",
        "data.batch_size=4",
        "train.eval_examples=4",
        "train.eval_every=2",
        "train.save_every=1",
    )

    def plan(out, **kw):
        return study.Study(
            config="configs/tiny.yaml",
            out_dir=str(tmp_path / out),
            arms=("corrected",),
            budgets=(8,),
            seeds=(0,),
            overrides=overrides,
            check_signature=False,
            **kw,
        )

    def by_step(run):  # a run's final evaluation is a row of its own; mid-run, in its step's
        rows = {}
        for r in _numbers(read_metrics(run)):
            rows.setdefault(r["step"], {}).update(r)
        return rows

    logs = []
    whole = study.run_study(plan("whole", steps=4), log=logs.append)["runs"][0]
    longer = study.run_study(plan("ext", steps=4, extend_from=2), log=logs.append)["runs"][0]
    runs = tmp_path / "ext" / "runs"
    assert longer["name"] == "corrected_s0_b8_t4" and (runs / "corrected_s0_b8").is_dir()
    assert any("[corrected_s0_b8_t4] resumed from" in m and "at step 2" in m for m in logs)
    reference = by_step(tmp_path / "whole" / "runs" / "corrected_s0_b8")
    assert by_step(runs / "corrected_s0_b8_t4") == reference
    assert longer["train_reward"] == whole["train_reward"] and len(whole["train_reward"]) == 4
    # Killed after the copy, before `train` wrote its config: the copy is made again.
    ext = runs / "corrected_s0_b8_t4"
    shutil.rmtree(ext)
    study._copy_checkpoint(runs / "corrected_s0_b8", 2, ext, metrics=True)
    study.run_study(plan("ext", steps=4, extend_from=2), log=logs.append)
    assert by_step(ext) == reference
    # The 2-step run restored from an archive keeps no checkpoints: from step 0.
    shutil.rmtree(ext)
    shutil.rmtree(runs / "corrected_s0_b8" / "checkpoints")
    study.run_study(plan("ext", steps=4, extend_from=2), log=logs.append)
    assert any("keeps no checkpoint 2: starts from step 0" in m for m in logs)
    assert by_step(ext) == reference
    logs.clear()  # done: kept, whatever its 2-step run keeps
    study.run_study(plan("ext", steps=4, extend_from=2), log=logs.append)
    assert "[corrected_s0_b8_t4] done before: kept" in "\n".join(logs)
    assert not any("keeps no checkpoint" in m for m in logs)
    with pytest.raises(ValueError, match="extend_from"):
        plan("bad", steps=2, extend_from=2)


def test_an_sft_start_cut_off_resumes_and_one_of_other_settings_starts_over(tmp_path, monkeypatch):
    """A study cut off during its SFT keeps the warm start's progress for the same command to
    resume (it used to delete it and start over: 640 of 800 steps lost); one of other SFT
    settings, or of unknown settings (no record of them), is started over."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import repro_sparse_rl as study

    monkeypatch.chdir(ROOT)
    out = tmp_path / "study"
    seen = []

    def cut_off(cfg, log):  # the SFT's progress is on disk when the session ends
        seen.append(sorted(p.name for p in Path(cfg.run_dir).iterdir()))
        (Path(cfg.run_dir) / "sft_progress").mkdir(exist_ok=True)
        raise study.RunStopped("cut off")

    monkeypatch.setattr(study, "_train", cut_off)

    def attempt(*overrides):
        plan = study.Study(config="configs/tiny.yaml", out_dir=str(out), overrides=overrides)
        with pytest.raises(study.RunStopped):
            study.run_study(plan, log=lambda m: None)

    (out / "sft" / "sft_progress").mkdir(parents=True)  # of unknown settings (no record)
    (out / "runs" / "dense_s0").mkdir(parents=True)
    attempt()
    attempt()
    attempt("data.batch_size=3")  # RL batching: the same warm start
    assert not (out / "runs").exists()
    attempt("sft.steps=3")
    assert seen == [
        ["sft_view.json"],
        ["sft_progress", "sft_view.json"],
        ["sft_progress", "sft_view.json"],
        ["sft_view.json"],
    ]


def test_finished_only_starts_nothing_and_deletes_nothing(tmp_path, monkeypatch):
    """`--finished-only` reads what is on disk: a run not finished raises `NotFinished` before
    anything is copied or trained, and a study whose SFT start is missing stops in one line
    instead of starting one (which would clear the runs it descends from)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import repro_sparse_rl as study

    monkeypatch.chdir(ROOT)
    cfg = load_config("configs/tiny.yaml", [f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(study.NotFinished, match="no finished run of this config in run"):
        study._run(cfg, tmp_path / "sft", 0, print, finished_only=True)
    assert not (tmp_path / "run").exists()
    out = tmp_path / "study"
    (out / "runs" / "dense_s0").mkdir(parents=True)
    (out / "runs" / "dense_s0" / "metrics.jsonl").write_text("{}\n")
    plan = study.Study(config="configs/tiny.yaml", out_dir=str(out), finished_only=True)
    with pytest.raises(
        study.NotFinished, match="no finished SFT start of this config .*: nothing to report"
    ):
        study.run_study(plan, log=lambda m: None)
    assert (out / "runs" / "dense_s0" / "metrics.jsonl").read_text() == "{}\n"


def test_finished_only_keeps_the_decodes_that_are_finished(tmp_path, monkeypatch):
    """A report over a budget added later (a fixed arm at the adaptive arm's mean) keeps what
    each run has finished at the other budgets: a held-out or sparse decode not finished at one
    budget leaves out that budget's figures only."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import repro_sparse_rl as study

    monkeypatch.chdir(ROOT)
    plan = study.Study(
        config="configs/tiny.yaml", out_dir=str(tmp_path), heldout=16, finished_only=True
    )
    finished = {"dense_s0_heldout16_b8", "dense_s0_decode_b8"}

    def run(cfg, src, step, log):
        if Path(cfg.run_dir).name not in finished:
            raise study.NotFinished(f"no finished run of this config in {cfg.run_dir}")
        return {"val_greedy_reward_before": 0.5, "val_reward_before": 0.25}

    rows = {
        "val/dense_greedy_reward_mean": 0.9,
        "val/dense_reward_mean": 0.8,
        "val/greedy_reward_mean": 0.7,
        "val/reward_mean": 0.6,
    }
    monkeypatch.setattr(study.Study, "run", lambda self, *a: run(*a))
    monkeypatch.setattr(study, "read_metrics", lambda d: [rows])
    left_out = []
    dense = tmp_path / "runs" / "dense_s0"
    assert study._heldout(plan, dense, 10, (8, 12), left_out.append) == {
        "heldout_prompts": 16,
        "heldout_dense_greedy": 0.9,
        "heldout_dense_sampled": 0.8,
        "heldout_greedy_b8": 0.7,
        "heldout_sampled_b8": 0.6,
    }
    assert study._decode_sparse(plan, dense, 10, (8, 12), left_out.append) == {
        8: {"greedy": 0.5, "sampled": 0.25}
    }
    assert study._heldout(plan, tmp_path / "runs" / "corrected_s0_b12", 10, (12,), print) == {}
    assert len(left_out) == 2 and all("_b12" in m for m in left_out)


def _record(arm, seed, *, sampled, greedy, budget=8, **extra):
    keys = ("train_reward_first3", "train_reward_last3", "greedy_final", "sampled_final")
    return {
        "arm": arm,
        "seed": seed,
        "budget": None if arm == "dense" else budget,
        "train_reward": [0.5] * 3,
        "dense_sampled_final": sampled,
        "dense_greedy_final": greedy,
        "evicted_fraction": None if arm == "dense" else 0.6,
        "collapsed": False,
        **dict.fromkeys(keys, 0.5),
        **extra,
    }


def test_targets_pair_each_arm_with_dense_of_the_same_seed():
    """A report read while some runs are missing (`--finished-only`): corrected's seed 1 has
    no dense run beside it, so the ratio the 97% target reads is seed 0's alone; a dense run
    whose sparse decodes were left out does not break the cells."""
    from benchmarks.repro_sparse_rl import summarise

    raw = {
        "rollout_length": 32,
        "budgets": [8],
        "runs": [
            _record("dense", 0, sampled=0.8, greedy=0.9),  # no "sparse_decoded"
            _record("corrected", 0, sampled=0.4, greedy=0.45),
            _record("corrected", 1, sampled=0.8, greedy=0.9),
        ],
    }
    out = summarise(raw)
    (row,) = out["targets"]
    assert row["corrected_vs_dense_sampled"] == pytest.approx(0.5)
    assert row["corrected_vs_dense_greedy"] == pytest.approx(0.5)
    assert not row["corrected_ge_97pct"] and row["half_evicted"]
    dense = next(c for c in out["cells"] if c["arm"] == "dense")
    assert dense["greedy_final"]["mean"] is None  # the left-out decode, not a crash


def test_ratio_to_dense_with_a_bootstrap_interval_over_seeds():
    from benchmarks.repro_sparse_rl import bootstrap_ratio

    same = bootstrap_ratio([(0.5, 0.5), (0.7, 0.7), (0.6, 0.6)])
    assert same == {"ratio": 1.0, "lo": 1.0, "hi": 1.0, "n": 3}
    # Worse on every seed by 20%: the interval is 0.8 wherever the resampled seeds fall.
    worse = bootstrap_ratio([(0.4, 0.5), (0.56, 0.7), (0.48, 0.6)])
    assert worse["ratio"] == pytest.approx(0.8) and worse["hi"] == pytest.approx(0.8)
    # Seed-to-seed spread with pairing kept: the interval holds the ratio and is not a point.
    mixed = bootstrap_ratio([(0.9, 1.0), (0.5, 0.4), (0.7, 0.8), (0.6, 0.6)])
    assert mixed["lo"] < mixed["ratio"] < mixed["hi"] and mixed["n"] == 4
    lone = bootstrap_ratio([(0.4, 0.5)])
    assert lone["ratio"] == pytest.approx(0.8) and lone["lo"] is None and lone["hi"] is None
    assert bootstrap_ratio([])["ratio"] is None and bootstrap_ratio([(0.1, 0.0)])["ratio"] is None


def test_difference_with_a_bootstrap_interval_over_seeds():
    from benchmarks.repro_sparse_rl import bootstrap_diff

    lower = bootstrap_diff([(0.4, 0.5), (0.5, 0.7), (0.3, 0.6)])  # below on every seed
    assert lower["diff"] == pytest.approx(-0.2) and lower["hi"] < 0 and lower["n"] == 3
    mixed = bootstrap_diff([(0.4, 0.5), (0.7, 0.5), (0.5, 0.5)])  # one seed each way
    assert mixed["lo"] < 0 < mixed["hi"]
    assert bootstrap_diff([(0.4, 0.5)]) == {
        "diff": pytest.approx(-0.1),
        "lo": None,
        "hi": None,
        "n": 1,
    }
    assert bootstrap_diff([])["diff"] is None


def test_steps_to_target_uses_the_trailing_mean():
    from benchmarks.repro_sparse_rl import steps_to_target

    curve = [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert steps_to_target(curve, 0.5, window=2) == 2  # (0 + 1) / 2
    assert steps_to_target(curve, 0.8, window=3) == 6  # (1 + 1 + 1) / 3 at step 6; 2/3 before
    assert steps_to_target(curve, 1.1, window=2) is None
    assert steps_to_target(curve, 1.0, window=1) == 2


def test_summary_pairs_arms_with_dense_by_seed():
    from benchmarks.repro_sparse_rl import TARGET_FRACTION, summarise

    def run(arm, seed, final, curve, budget=None):
        rec = {k: None for k in ("greedy_final", "sampled_final", "peak_kv_bytes")}
        rec |= {k: 0.0 for k in ("evicted_fraction", "masked_token_fraction", "mismatch_kl")}
        rec |= {"rejected_seq_fraction": 0.0, "rho_p5": 1.0, "kv_budget_mean": None}
        rec |= {"dense_greedy_final": final, "dense_sampled_final": final}
        rec |= {"train_reward": curve, "train_reward_first3": curve[0]}
        rec |= {"train_reward_last3": float(np.mean(curve[-3:])), "collapsed": False}
        if arm == "dense":  # its final weights decoded with the sparse cache
            rec["sparse_decoded"] = {8: {"greedy": final, "sampled": final}}
        return {"arm": arm, "seed": seed, "budget": budget, **rec}

    up = [0.2, 0.6, 1.0, 1.0, 1.0, 1.0, 1.0]
    slow = [0.2, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    raw = {
        "budgets": [8],
        "rollout_length": 32,
        "runs": [run("dense", s, f, up) for s, f in ((0, 0.8), (1, 0.6), (2, 0.7))]
        + [run("corrected", s, f, slow, 8) for s, f in ((0, 0.72), (1, 0.54), (2, 0.63))]
        + [run("naive", s, f, slow, 8) for s, f in ((0, 0.70), (1, 0.50), (2, 0.60))],
    }
    out = summarise(raw)
    [target] = out["targets"]
    gap = target["naive_minus_corrected_dense_sampled_final"]
    assert gap["diff"] == pytest.approx(-0.03) and gap["hi"] < 0 and gap["n"] == 3
    assert target["naive_measurably_below"]
    assert target["naive_minus_corrected_heldout_dense_greedy"]["diff"] is None  # not decoded
    assert out["target_reward"] == pytest.approx(TARGET_FRACTION * 1.0)
    cells = {c["arm"]: c for c in out["cells"]}
    ci = cells["corrected"]["dense_greedy_vs_dense_ci"]
    assert ci["ratio"] == pytest.approx(0.9) and ci["lo"] == pytest.approx(0.9) and ci["n"] == 3
    # The trailing mean of 5 steps: 0.76 at step 5, 0.92 >= 0.9 at step 6.
    assert cells["dense"]["steps_to_target"]["mean"] == 6
    assert cells["corrected"]["reached_target"] == 0
    assert cells["dense"]["reached_target"] == 3
    # With the large held-out set decoded (sampled, one per prompt), the targets read it first.
    held = {"dense": (0.8, 0.6, 0.7), "corrected": (0.76, 0.57, 0.665), "naive": (0.4,) * 3}
    for r in raw["runs"]:
        v = held[r["arm"]][r["seed"]]
        r |= {"heldout_prompts": 1024, "heldout_dense_greedy": v, "heldout_dense_sampled": v}
        r |= {"heldout_greedy_b8": v, "heldout_sampled_b8": v}
    out = summarise(raw)
    [target] = out["targets"]
    cells = {c["arm"]: c for c in out["cells"]}
    assert target["corrected_vs_dense_sampled"] == pytest.approx(0.95)
    assert cells["corrected"]["heldout_sampled_vs_dense_ci"]["ratio"] == pytest.approx(0.95)
    assert not target["corrected_ge_97pct"]
    gap = target["naive_minus_corrected_heldout_dense_sampled"]
    assert gap["diff"] == pytest.approx(-(0.76 + 0.57 + 0.665) / 3 + 0.4) and gap["hi"] < 0


def test_the_table_has_a_row_per_cell_with_its_interval():
    from benchmarks.repro_sparse_rl import markdown_table, summarise

    def run(arm, seed, held, budget=None):
        rec = {k: None for k in ("greedy_final", "sampled_final", "dense_greedy_final")}
        rec |= {"peak_kv_bytes": 400 if arm == "dense" else 100, "peak_kv_tokens": None}
        rec |= {"evicted_fraction": 0.0 if arm == "dense" else 0.6, "masked_token_fraction": 0}
        rec |= {"rejected_seq_fraction": 0.25, "rho_p5": 1.0, "kv_budget_mean": budget}
        rec |= {"mismatch_kl": 0.0, "dense_sampled_final": held, "collapsed": arm == "naive"}
        reward = 0.1 if arm == "naive" else 0.5
        rec |= {"train_reward": [reward], "train_reward_first3": reward}
        rec |= {"train_reward_last3": reward}
        rec |= {"heldout_prompts": 1024, "heldout_dense_greedy": held}
        rec |= {"heldout_dense_sampled": held, f"heldout_sampled_b{budget}": held / 2}
        return {"arm": arm, "seed": seed, "budget": budget, **rec}

    raw = {
        "budgets": [8],
        "rollout_length": 32,
        "runs": [run("dense", s, v) for s, v in ((0, 0.8), (1, 0.6))]
        + [run("corrected", s, v, 8) for s, v in ((0, 0.72), (1, 0.54))]
        + [run("naive", 0, 0.1, 8)]
        + [run("tis", s, v, 8) for s, v in ((0, 0.4), (1, 0.3), (2, 0.2))],  # no dense s2
    }
    lines = markdown_table(summarise(raw)).splitlines()
    assert len(lines) == 2 + 4 and all(line.count("|") == 14 for line in lines)
    row = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines[2:]}
    # 0.9 on both seeds: the interval is a point; one seed has no interval, only n = 1.
    assert row["corrected"][3] == "0.900 [0.900, 0.900]" and row["corrected"][5].startswith("0.450")
    assert row["naive"][3] == "0.125 (n=1)" and row["naive"][-2] == "1/1"
    assert row["dense"][-1] == "2/2 (1) |" and row["naive"][-1] == "0/1 |"  # 0.9 x 0.5 at step 1
    assert row["corrected"][7] == "0.25" and row["corrected"][8:11] == ["60%", "25%", "8"]
    assert row["dense"][6] == "-"  # no tokens logged: no ratio, not a crash
    assert row["tis"][2] == "3" and row["tis"][3] == "0.500 [0.500, 0.500] (n=2)"


def test_rungs_split_a_run_by_the_budget_each_step_used():
    from benchmarks.repro_sparse_rl import rungs

    def step(budget, rejected, p5, reward):
        return {
            "rollout/kv_budget": budget,
            "correction/rejected_seq_fraction": rejected,
            "correction/rho_p5": p5,
            "correction/mismatch_kl": 1 - p5,
            "critic/score/mean": reward,
        }

    steps = [step(128, 0.5, 0.88, 0.25), step(224, 0.0, 0.97, 0.75), step(128, 0.3, 0.84, 0.5)]
    assert rungs(steps) == {
        "128": {
            "steps": 2,
            "rejected_seq_fraction": pytest.approx(0.4),
            "rho_p5": pytest.approx(0.86),
            "steps_rho_p5_under_0.86": 1,
            "mismatch_kl": pytest.approx(0.14),
            "train_reward": pytest.approx(0.375),
        },
        "224": {
            "steps": 1,
            "rejected_seq_fraction": 0.0,
            "rho_p5": pytest.approx(0.97),
            "steps_rho_p5_under_0.86": 0,
            "mismatch_kl": pytest.approx(0.03),
            "train_reward": 0.75,
        },
    }
    assert rungs([{"critic/score/mean": 1.0}]) == {}  # a dense run has no budget


def test_token_mismatch_kinds_of_a_tagged_completion():
    from token_mismatch import kinds, token_texts

    from sparserl_jax.models import CharTokenizer

    tok = CharTokenizer()
    text = "1wz7\n2yx14\nanswer: 14"
    ids = tok.encode(text) + [tok.eos_ids[0]]
    got = kinds(token_texts(ids, tok))
    assert got[:5] == ["digit", "tag", "tag", "digit", "newline"]
    assert got[5:11] == ["digit", "tag", "tag", "digit", "digit", "newline"]
    assert got[11:] == ["answer"] * 10 + ["eos"]
    # A special id mid-way (decoded alone it is empty) keeps every later label in place.
    ids = tok.encode("1: 7") + [tok.bos_id] + tok.encode("\nanswer: 7")
    got = kinds(token_texts(ids, tok))
    assert got[:5] == ["digit", "sep", "sep", "digit", "special"]
    assert got[5:] == ["newline"] + ["answer"] * 9


def test_run_at_step_reads_a_checkpoint_argument():
    from benchmarks.repro_sparse_rl import run_at_step

    assert run_at_step("runs/x@y/dense_s0@100") == (Path("runs/x@y/dense_s0"), 100)
    for bad in ("runs/x/dense_s0", "runs/x@last"):
        with pytest.raises(ValueError, match="RUN_DIR@STEP"):
            run_at_step(bad)


def test_gold_logprob_parts_split_the_scratchpad_in_thirds_and_the_answer():
    from gold_logprob import parts

    completion = "1: 7\n2: 14\n3: 21\nanswer: 21"
    got = parts(completion)
    assert len(got) == len(completion) + 1  # one per character, then the eos
    assert got == ["a"] * 5 + ["b"] * 6 + ["c"] * 6 + ["answer"] * 11  # + "answer: 21", eos


def test_greedy_tags_reads_lines_tags_and_the_first_broken_line():
    from greedy_tags import read_lines, tag_stats

    from sparserl_jax.data.arithmetic import solve

    # The task's own completion: every line well formed, none broken, tags as drawn.
    _, ideal = solve(
        7, "*", 24, scratchpad="repeat", tags=2, tag_copy=1.0, rng=np.random.default_rng(0)
    )
    r = read_lines("7*24=", ideal)
    assert r["broken_at"] is None and len(r["tags"]) == 24 and None not in r["tags"]
    stats = tag_stats([r])
    assert stats["copy_share"] == 1.0 and stats["well_formed_share"] == 1.0  # tag_copy 1.0
    assert stats["distinct_tags_mean"] <= 10 and stats["broken_fraction"] == 0.0
    # One pair copied down every line, then a wrong product on line 3.
    r = read_lines("7*4=", "\n1ww7\n2ww14\n3ww22\n4ww28\nanswer: 28")
    assert r["tags"] == ["ww"] * 4 and r["broken_at"] == 3
    s = tag_stats([r])
    assert s["modal_tag_share"] == 1.0 and s["distinct_tags_mean"] == 1
    assert s["broken_at_mean"] == 0.75 and s["copy_share"] is None  # no line 11
    # A malformed line, an answer too early, a line past the last, a stop before the end.
    assert read_lines("7*3=", "\n1ww7\n2: 14\n3ww21\nanswer: 21")["tags"][1] is None
    assert read_lines("7*3=", "\n1ww7\n2ww14\nanswer: 14")["broken_at"] == 3
    assert read_lines("7*2=", "\n1ww7\n2ww14\n3ww21\nanswer: 21")["broken_at"] == 3
    assert read_lines("7*3=", "\n1ww7\n2ww14")["broken_at"] == 3
    with pytest.raises(ValueError, match="not a repeat-task prompt"):
        read_lines("12+3=", "\n15")


def test_collapse_reads_the_dense_decoded_reward_and_the_training_trajectory():
    """Issue 31: a collapse is read on the full-cache held-out reward and on the training
    reward's trajectory, never on the reward decoded as trained (0 from the start at a small
    budget) nor on greedy alone (it falls under RL where sampling does not: the tagged task)."""
    from benchmarks.repro_sparse_rl import collapse

    base = {
        "dense_sampled_start": 0.45,
        "dense_sampled_final": 0.80,
        "dense_greedy_start": 0.94,
        "dense_greedy_final": 0.36,  # greedy fell, sampled rose: not a collapse
        "greedy_start": 0.0,
        "greedy_final": 0.0,
        "train_reward": [0.5, 0.6, 0.7, 0.8, 0.9, 0.9],
    }
    got = collapse(base)
    assert got == {
        "collapse_dense": False,
        "collapse_train": False,
        "greedy_fell": False,
        "collapsed": False,
    }
    assert collapse(base | {"dense_sampled_final": 0.2})["collapse_dense"]
    assert collapse(base | {"greedy_start": 0.9, "greedy_final": 0.4})["greedy_fell"]
    assert not collapse(base | {"greedy_start": 0.9, "greedy_final": 0.4})["collapsed"]
    # No sampled figure: greedy (full cache) decides.
    no_sampled = base | {"dense_sampled_start": None, "dense_sampled_final": None}
    assert collapse(no_sampled)["collapse_dense"]
    # The training reward rose to a trailing mean of 0.7 (steps 1-5 of 0.7), then fell: the
    # trailing mean of the last 5 steps (0.14) is below half of it.
    fall = base | {"train_reward": [0.7] * 5 + [0.1] * 5}
    assert collapse(fall)["collapse_train"] and collapse(fall)["collapsed"]
    # Half-way down is not a collapse; a non-finite update is.
    assert not collapse(base | {"train_reward": [0.7] * 5 + [0.4] * 5})["collapse_train"]
    assert collapse(base, nonfinite=True)["collapsed"]


def test_a_run_two_processes_need_is_run_once(tmp_path):
    """Two arms side by side that both need a run not yet done (the signature): the second
    waits on the run's lock instead of training in the same directory."""
    import subprocess
    import time

    from benchmarks.repro_sparse_rl import run_lock

    run = tmp_path / "signature" / "b8"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]);"
            "from pathlib import Path; from benchmarks.repro_sparse_rl import run_lock\n"
            "with run_lock(Path(sys.argv[2]), print):\n"
            "    print('held', flush=True); time.sleep(3)",
            str(ROOT),
            str(run),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    logs, start = [], time.monotonic()
    with run_lock(run, logs.append):
        waited = time.monotonic() - start
    holder.wait(timeout=30)
    assert logs == ["  [b8] another process runs it: waiting"] and waited > 1
    with run_lock(run, logs.append):  # free again: no wait
        pass
    assert len(logs) == 1
