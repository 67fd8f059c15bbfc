"""Reliability: idempotent run outputs after a kill, validation before the expensive work, and
one-line CLI errors."""

import json
from pathlib import Path

import pytest

from sparserl_jax.build import build_tokenizer
from sparserl_jax.cli import main
from sparserl_jax.config import load_config
from sparserl_jax.data import DataError, Example, RewardError, compute_rewards, encode_prompts
from sparserl_jax.metrics import read_metrics, truncate_metrics
from sparserl_jax.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# 4 prompts x 2 samples = 8 rows: divides the 8 fake devices' data*fsdp shards.
FAST = ["data.batch_size=4", "sft.steps=0", "train.eval_examples=0"]


def test_truncate_metrics_drops_later_rows_and_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "x": s} for s in (0, 1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "x"')
    kept = truncate_metrics(tmp_path, 2)
    assert [r["step"] for r in kept] == [0, 1, 2]
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows[:3])
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


@pytest.mark.slow
def test_resume_never_duplicates_metrics_rows(tmp_path):
    cfg = load_config(TINY, [f"run_dir={tmp_path}", *FAST, "train.steps=2"])
    train(cfg, log_fn=lambda m: None)
    # What a run killed after writing step 3 (and half of step 4) but before saving leaves.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "stale": True}) + "\n" + '{"step": 4, "crit')
    cfg = load_config(TINY, [f"run_dir={tmp_path}", *FAST, "train.steps=3"])
    summary = train(cfg, log_fn=lambda m: None)
    assert summary["start_step"] == 2
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert not any("stale" in r for r in rows)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line) for line in lines)


def _no_build(monkeypatch):
    """Make building the model an error: a check that passes this ran before any build."""

    def boom(*a, **k):
        raise AssertionError("the model was built before the config was validated")

    monkeypatch.setattr("sparserl_jax.train.build_model", boom)


def test_batch_vs_mesh_checked_before_model_is_built(tmp_path, monkeypatch):
    _no_build(monkeypatch)
    cfg = load_config(TINY, [f"run_dir={tmp_path}"])  # 2 x 2 = 4 rows on 8 shards
    with pytest.raises(ValueError, match=r"data\.batch_size=2 x rollout\.n_samples=2 = 4 rows"):
        train(cfg, log_fn=lambda m: None)
    assert not (tmp_path / "checkpoints").exists()


def test_bad_reward_fn_checked_before_model_is_built(tmp_path, monkeypatch):
    _no_build(monkeypatch)
    for spec, match in [
        ("no_such_module_xyz:reward", "cannot import module"),
        ("json:no_such_fn", "has no attribute"),
        ("math:sqrt", r"fn\(prompt, completion, answer\)"),
    ]:
        cfg = load_config(TINY, [f"run_dir={tmp_path}", *FAST, f"data.reward_fn={spec}"])
        with pytest.raises(ValueError, match=match):
            train(cfg, log_fn=lambda m: None)
    assert not (tmp_path / "checkpoints").exists()


def test_long_prompt_is_named_when_encoded():
    cfg = load_config(TINY)
    tok = build_tokenizer(cfg.tokenizer, cfg.model)
    ok = Example(task="arithmetic", prompt="1+2=", answer="3", source="a#0", index=0)
    long = Example(
        task="arithmetic", prompt="123456789+1=", answer="0", source="file.jsonl:7", index=7
    )
    assert len(encode_prompts([ok], tok, max_len=8)[0]) <= 8
    with pytest.raises(DataError, match=r"prompt 1 .*file\.jsonl:7.*rollout\.max_prompt_len=8"):
        encode_prompts([ok, long], tok, max_len=8)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["train", TINY, "rollout.n_samples=1"], "at least 2 samples"),
        (["train", "BAD_YAML"], "while parsing"),
        (["train", str(ROOT / "configs")], "Is a directory"),
        (["train", TINY, "train.topology=split", "train.sampler_devices=8"], "sampler_devices=8"),
        (["generate", TINY, "model.arch.num_layerz=2"], "did you mean 'num_layers'"),
    ],
)
def test_cli_usage_errors_are_one_line_exit_2(tmp_path, capsys, monkeypatch, argv, match):
    _no_build(monkeypatch)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\nrun_dir: x\n")
    argv = [str(bad) if a == "BAD_YAML" else a for a in argv]
    argv += [f"run_dir={tmp_path}"] if argv[0] == "train" and argv[1] != str(bad) else []
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparserl: error: ") and err.count("\n") == 1, err
    assert match in err
    assert "Traceback" not in err
    with pytest.raises(Exception, match=match):
        main(["--debug", *argv])


def test_cli_runtime_failure_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("disk full\nsecond line")

    monkeypatch.setattr("sparserl_jax.cli.train", fail)
    assert main(["train", TINY, f"run_dir={tmp_path}", *FAST]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sparserl: error: disk full second line") and err.count("\n") == 1
    with pytest.raises(RuntimeError, match="disk full"):
        main(["train", "--debug", TINY, f"run_dir={tmp_path}", *FAST])


def test_reward_fn_error_names_step_example_and_prompt():
    examples = [
        Example(task="arithmetic", prompt=f"{i}+1=", answer=str(i + 1), source=f"a#{i}", index=i)
        for i in range(3)
    ]

    def reward(example, completion):
        if example.index == 2:
            raise KeyError("boom")
        return 1.0

    with pytest.raises(RewardError, match=r"step 5, example 2 .*a#2.*'2\+1='.*KeyError") as info:
        compute_rewards(reward, examples, ["x"] * 6, group_size=2, step=5)
    assert isinstance(info.value.__cause__, KeyError)
