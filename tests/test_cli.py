"""`sparserl generate` end to end on the tiny preset, and its config errors."""

import json

from sparserl_jax.cli import main


def test_generate_job(tmp_path, capsys):
    code = main(
        ["generate", "configs/tiny.yaml", f"run_dir={tmp_path}", "generate.max_new_tokens=4"]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["reload_max_abs_logit_diff"] == 0.0
    assert summary["generated_tokens"] == 8
    assert (tmp_path / "model" / "config.json").exists()


def test_config_error_exit_code(capsys):
    assert main(["generate", "configs/tiny.yaml", "model.arch.num_layerz=2"]) == 2
    assert "did you mean 'num_layers'" in capsys.readouterr().err


def test_decoupled_jobs_refuse_the_adaptive_budget(tmp_path, capsys):
    for job in (["trainer"], ["sampler", "--id", "s0"], ["launch", "--samplers", "1"]):
        argv = [*job, "configs/tiny.yaml", f"run_dir={tmp_path}"]
        assert main([*argv, "rollout.kv.adaptive.enabled=true"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert "rollout.kv.adaptive.enabled=true works with `sparserl train` only" in err


def test_decoupled_jobs_refuse_to_recompute_a_compressed_cache(tmp_path, capsys):
    for job in (["trainer"], ["sampler", "--id", "s0"], ["launch", "--samplers", "1"]):
        argv = [*job, "configs/tiny.yaml", f"run_dir={tmp_path}"]
        assert main([*argv, "async.partial_cache=recompute"]) == 2  # tiny: R-KV at budget 12
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert "async.partial_cache=recompute needs a dense cache, but" in err
    assert main(["trainer", "configs/tiny.yaml", "async.partial_cache=redo"]) == 2
    assert "partial_cache must be auto, recompute or keep" in capsys.readouterr().err


def test_a_superseded_trainer_exits_5_in_one_line(tmp_path, capsys, monkeypatch):
    from sparserl_jax import cli
    from sparserl_jax.decoupled.exchange import SupersededError

    def superseded(cfg, log_fn):
        raise SupersededError("trainer epoch 1 was superseded: a newer trainer registered epoch 2")

    monkeypatch.setattr(cli, "run_trainer", superseded)
    assert main(["trainer", "configs/tiny.yaml", f"run_dir={tmp_path}", "data.batch_size=4"]) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "sparserl: error: trainer epoch 1 was superseded: a newer trainer registered epoch 2"
    ]
