"""Reliability: idempotent run outputs after a kill, validation before the expensive work, and
one-line CLI errors."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from sparserl_jax.build import build_model, build_tokenizer
from sparserl_jax.checkpoint import (
    STOP_SIGNALS,
    TEST_SIGNAL_ENV,
    CheckpointManager,
    Preempted,
    PreemptionGuard,
)
from sparserl_jax.cli import main
from sparserl_jax.config import ModelSpec, load_config
from sparserl_jax.data import (
    DataError,
    Example,
    PromptLimit,
    RewardError,
    compute_rewards,
    encode_prompts,
    eval_examples,
    prompt_iterator,
)
from sparserl_jax.metrics import read_metrics, truncate_metrics
from sparserl_jax.models import CheckpointError, DenseKVCache, HFTokenizer, from_hf, to_hf
from sparserl_jax.rl import Learner, LearnerConfig
from sparserl_jax.rollout import RolloutConfig, RolloutEngine, dense_logprobs
from sparserl_jax.testing import assert_trees_equal, child_env, tiny_model
from sparserl_jax.testing.learner import make_batch
from sparserl_jax.testing.reference_sampler import generate as reference_generate
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
    # The same command once more, on a finished run: nothing to do, nothing written.
    before = (tmp_path / "metrics.jsonl").read_text()
    summary = train(cfg, log_fn=lambda m: None)
    assert summary["start_step"] == summary["end_step"] == 3
    assert (tmp_path / "metrics.jsonl").read_text() == before
    # Asked for a held-out evaluation the finished run lacks, it writes that one row, once.
    cfg = load_config(
        TINY, [f"run_dir={tmp_path}", *FAST, "train.steps=3", "train.eval_examples=2"]
    )
    for _ in range(2):
        summary = train(cfg, log_fn=lambda m: None)
        assert "val_reward_after" in summary
        assert summary["start_step"] == summary["end_step"] == 3
        rows = read_metrics(tmp_path)
        assert [r["step"] for r in rows] == [1, 2, 3, 3] and "val/reward_mean" in rows[-1]


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


def _gsm8k(tmp_path, lengths):
    """A gsm8k-style JSONL whose row i has a question of `lengths[i]` characters."""
    rows = [json.dumps({"question": "q" * n, "answer": str(i)}) for i, n in enumerate(lengths)]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return ["data.task=gsm8k", f"data.path={path}", f"data.eval_path={path}"]


def test_long_prompts_are_counted_and_skipped_at_start_up(tmp_path, caplog):
    # Rows 2 and 5 (lines 3 and 6) are longer than 8 tokens; every batch and the held-out set
    # leave them out, and one line names them, file and line.
    data = _gsm8k(tmp_path, [3, 4, 20, 5, 2, 30, 6, 3, 4])
    cfg = load_config(TINY, [*data, "data.batch_size=2", "data.shuffle=false", "data.num_epochs=1"])
    tok = build_tokenizer(cfg.tokenizer, cfg.model)
    limit = PromptLimit(tok, 8)
    with caplog.at_level("WARNING"):
        it = prompt_iterator(cfg.data, limit=limit)
        seen = [e.index for batch in it for e in batch.examples]
    assert seen == [0, 1, 3, 4, 6, 7]  # 7 fit; drop_remainder drops the 7th
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1
    assert re.search(r"skipped 2 of 9 prompts longer than rollout\.max_prompt_len=8", lines[0])
    assert "train.jsonl:3 (" in lines[0] and "train.jsonl:6 (" in lines[0]
    held = eval_examples(cfg.data, 4, limit=limit)
    assert [e.index for e in held] == [0, 1, 3, 4]
    # Nothing dropped: the very same batches (and iterator states) as without a limit.
    cfg = load_config(TINY, ["data.batch_size=2"])
    a = prompt_iterator(cfg.data)
    b = prompt_iterator(cfg.data, limit=PromptLimit(tok, 64))
    for _ in range(5):
        assert next(a).answers == next(b).answers and a.get_state() == b.get_state()


def test_long_prompts_refused_before_the_model_is_built(tmp_path, monkeypatch):
    _no_build(monkeypatch)
    data = _gsm8k(tmp_path, [3, 4, 20, 5, 6, 2])
    cfg = load_config(
        TINY,
        [f"run_dir={tmp_path}/run", *FAST, *data, "rollout.max_prompt_len=8"]
        + ["data.long_prompts=error"],
    )
    with pytest.raises(DataError, match=r"train prompt .*train\.jsonl:3 .* is \d+ tokens, more"):
        train(cfg, log_fn=lambda m: None)
    assert not (tmp_path / "run" / "checkpoints").exists()
    unknown = r"data.long_prompts = 'drop' is not one of 'skip', 'error'"
    with pytest.raises(ValueError, match=unknown):
        load_config(TINY, ["data.long_prompts=drop"])


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


# -- signals: a stop at any stage is consistent, and the same command resumes as if never stopped


def _spin():
    """Bytecode boundaries at which a pending Python signal handler runs."""
    for _ in range(10**6):
        pass
    raise AssertionError("the signal handler did not run")


def test_guard_stops_abortable_work_at_once_and_flags_the_rest():
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with PreemptionGuard(STOP_SIGNALS) as guard:
        guard.mark("update:1", "the update of step 1")
        os.kill(os.getpid(), signal.SIGTERM)  # outside a region: the flag only
        for _ in range(1000):
            pass
        assert guard.requested and guard.stopped_where == "the update of step 1"
        guard.mark("save:1", "the save of checkpoint step 1")
        entered = False
        with (
            pytest.raises(Preempted, match="SIGTERM during the update of step 1"),
            guard.abortable("rollout:2", "the rollout of step 2"),
        ):
            entered = True  # a region is not entered once a signal came
        assert not entered and guard.signal_name == "SIGTERM"
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before

    with PreemptionGuard(STOP_SIGNALS) as guard:
        with (
            pytest.raises(Preempted, match="SIGINT during the rollout of step 3"),
            guard.abortable("rollout:3", "the rollout of step 3"),
        ):
            os.kill(os.getpid(), signal.SIGINT)
            _spin()
        assert guard.requested and guard.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C twice: stop now
            os.kill(os.getpid(), signal.SIGINT)
            _spin()
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def test_guard_test_hook_signals_at_the_named_stage(monkeypatch):
    monkeypatch.setenv(TEST_SIGNAL_ENV, "sft:2")
    with (
        PreemptionGuard() as guard,
        pytest.raises(Preempted, match=r"during the SFT warm start \(2/3"),
        guard.abortable("sft:0", "the SFT warm start (0/3)"),
    ):
        for i in (1, 2):
            guard.mark(f"sft:{i}", f"the SFT warm start ({i}/3 steps done)")
        _spin()


# Every stage a signal can stop, in the order one run directory meets them; each stop is resumed
# by the next command: (test-hook stage, where the line says it stopped, checkpoints after it).
STOPS = [
    ("sft:2", r"the SFT warm start \(2/3 steps done\); no checkpoint needed", []),
    ("eval-before:0", r"the held-out evaluation before step 0; checkpoint step 0 ", [0]),
    ("rollout:2", r"the rollout of step 2; checkpoint step 1 ", [0, 1]),
    ("update:2", r"the update of step 2; checkpoint step 2 ", [0, 1, 2]),
    ("save:3", r"the save of checkpoint step 3; checkpoint step 3 ", [0, 1, 2, 3]),
    ("eval:4", r"the held-out evaluation at step 4; checkpoint step 4 ", [0, 1, 2, 3, 4]),
    (
        "eval-after:6",
        r"the held-out evaluation after step 6; checkpoint step 6 ",
        [0, 1, 2, 3, 4, 6],
    ),
]
SIGNAL_RUN = [
    "train.steps=6",
    "train.save_every=3",
    "train.eval_every=2",
    "train.eval_examples=2",
    "train.keep_checkpoints=10",
    "sft.steps=3",
]


def _cli_train(run_dir, stop_at=None):
    # The nine runs of one config share a compilation cache beside the run directories.
    env = child_env(run_dir.parent / "jax_cache")
    env.pop(TEST_SIGNAL_ENV, None)
    if stop_at is not None:
        env[TEST_SIGNAL_ENV] = stop_at
    cmd = [sys.executable, "-m", "sparserl_jax", "train", TINY, f"run_dir={run_dir}", *SIGNAL_RUN]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _final_state(run_dir, step):
    cfg = load_config(TINY, [f"run_dir={run_dir}"])
    model = build_model(cfg.model)
    mngr = CheckpointManager(run_dir, async_save=False)
    state, meta = mngr.restore(step, {"learner": Learner(model, cfg.learner).init(model)})
    mngr.close()
    return state, meta


def _rows(run_dir):
    """The metrics rows without the wall-clock fields (timings differ from run to run) and the
    patch sizes: each run publishes under its own random run id, which PULSESync's compressed
    header carries, so two runs' patches may differ by a byte (`sync/changed` stays)."""
    drop = ("timing_s/", "perf/", "wall_time_s", "sync/payload_bytes")
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in read_metrics(run_dir)]


@pytest.mark.slow
def test_sigterm_at_every_stage_then_resume_equals_an_uninterrupted_run(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    summary, _ = _cli_train(full)
    assert summary["end_step"] == 6 and "stopped_by_signal" not in summary
    for stage, where, saved in STOPS:
        summary, err = _cli_train(cut, stop_at=stage)
        stopped = [line for line in err.splitlines() if line.startswith("stopped by")]
        assert len(stopped) == 1 and err.count("stopped by") == 1, err
        assert re.fullmatch(f"stopped by SIGTERM during {where}.*", stopped[0]), stopped[0]
        assert summary["stopped_by_signal"] and summary["signal"] == "SIGTERM", summary
        assert CheckpointManager(cut, async_save=False).steps() == saved, stage
    summary, _ = _cli_train(cut)
    assert summary["end_step"] == 6 and "stopped_by_signal" not in summary

    assert _rows(cut) == _rows(full)
    assert [r["step"] for r in _rows(cut)] == [0, 1, 2, 3, 4, 5, 6, 6]
    assert "val/reward_mean" in _rows(cut)[4] and "critic/score/mean" in _rows(cut)[4]
    state_full, meta_full = _final_state(full, 6)
    state_cut, meta_cut = _final_state(cut, 6)
    assert_trees_equal(state_cut, state_full, what="learner state")
    assert meta_cut["data_state"] == meta_full["data_state"]
    assert meta_cut["sync_version"] == meta_full["sync_version"]


# -- token ids outside the vocabulary are an error at every public entry --------------------------

V = 67  # tiny_model's vocabulary
OOV = r"token id {id} at position {pos} is outside the vocabulary \[0, 67\)"


def _tokens(bad_at=None, value=V):
    tokens = np.arange(2 * 6, dtype=np.int32).reshape(2, 6) % V
    if bad_at is not None:
        tokens[bad_at] = value
    return tokens


def test_model_call_and_decode_check_concrete_token_ids():
    model = tiny_model()
    assert np.isfinite(np.asarray(model(jnp.asarray(_tokens())))).all()
    for value in (V, 10**6, -1):
        with pytest.raises(ValueError, match=OOV.format(id=value, pos=r"\(1, 4\)")):
            model(jnp.asarray(_tokens((1, 4), value)))
    with pytest.raises(ValueError, match=OOV.format(id=V, pos=r"\(0, 2\)")):
        model(_tokens((0, 2)))  # numpy input too
    cfg = model.cfg
    cache = DenseKVCache.create(
        num_layers=cfg.num_layers,
        batch=2,
        max_len=8,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )
    with pytest.raises(ValueError, match=OOV.format(id=V, pos=r"\(1, 0\)")):
        model.decode(jnp.asarray([[3], [V]], jnp.int32), cache)
    # Traced (inside jit) ids are not checked: the values are unknown there (documented).
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(_tokens((0, 0))))
    assert logits.shape == (2, 6, V)


def test_generate_checks_prompt_ids():
    model = tiny_model()
    engine = RolloutEngine(model, RolloutConfig(num_slots=2, max_prompt_len=4, max_new_tokens=2))
    with pytest.raises(ValueError, match=r"prompt 1: token id 67 at position 2 is outside"):
        engine.generate([[1, 2], [1, 2, V]])
    with pytest.raises(ValueError, match=r"prompts: token id -3 at position \(0, 1\)"):
        reference_generate(model, [[1, -3]], max_new_tokens=2)


def test_dense_logprobs_and_learner_check_token_ids():
    model = tiny_model(param_dtype="float32", dtype="float32")
    bad = _tokens((1, 5))
    match = OOV.format(id=V, pos=r"\(1, 5\)")
    with pytest.raises(ValueError, match="dense_logprobs tokens_bt: " + match):
        dense_logprobs(model, None, bad)
    graphdef, state = nnx.split(model)
    with pytest.raises(ValueError, match=match):
        dense_logprobs(graphdef, nnx.to_pure_dict(state), jnp.asarray(bad))
    learner = Learner(model, LearnerConfig())
    state = learner.init(model)
    with pytest.raises(ValueError, match="learner batch tokens_bt: " + match):
        learner.logprobs(state.params, bad)
    batch = make_batch()
    tokens = np.array(batch.tokens_bt)
    tokens[3, 7] = -1
    batch = batch._replace(tokens_bt=tokens, old_logp_bt=batch.sampler_logp_bt)
    with pytest.raises(ValueError, match=OOV.format(id=-1, pos=r"\(3, 7\)")):
        learner.train_on_batch(state, batch)


# -- a corrupt Hugging Face directory is a CheckpointError naming the file ----------------------


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny exported model and a word-level tokenizer.json, as a Hugging Face directory."""
    from tokenizers import Tokenizer, models

    path = to_hf(tiny_model(), tmp_path / "hf")
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "[UNK]": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(path / "tokenizer.json"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=1)))
    assert from_hf(path).cfg.vocab_size == V and HFTokenizer.from_dir(path).eos_ids == (1,)
    return path


def _safetensors(path):
    return path / "model.safetensors"


def _truncate(file, keep):
    data = file.read_bytes()
    file.write_bytes(data[: keep if keep >= 0 else len(data) + keep])


def _bad_header(file):
    data = bytearray(file.read_bytes())
    data[8:16] = b"{garbage"
    file.write_bytes(bytes(data))


def _rewrite_tensors(file, change):
    with safe_open(file, framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    change(tensors)
    save_file(tensors, str(file))


def _drop_keys(file, *keys):
    cfg = json.loads(file.read_text())
    file.write_text(json.dumps({k: v for k, v in cfg.items() if k not in keys}))


WEIGHT_FAULTS = [
    ("truncated", lambda p: _truncate(_safetensors(p), -100), "model.safetensors: not a readable"),
    ("short header", lambda p: _truncate(_safetensors(p), 20), "model.safetensors: not a readable"),
    ("empty", lambda p: _truncate(_safetensors(p), 0), "model.safetensors: not a readable"),
    ("bad header", lambda p: _bad_header(_safetensors(p)), r"model.safetensors: .*invalid JSON"),
    (
        "config not JSON",
        lambda p: _truncate(p / "config.json", 40),
        r"config.json: malformed JSON \(.* at line 1, column",
    ),
    (
        "config a list",
        lambda p: (p / "config.json").write_text("[1, 2]"),
        "config.json: expected a JSON object, got list",
    ),
    (
        "config without hidden_size",
        lambda p: _drop_keys(p / "config.json", "hidden_size"),
        "config.json: no 'hidden_size' key",
    ),
    (
        "missing tensor",
        lambda p: _rewrite_tensors(
            _safetensors(p), lambda t: t.pop("model.layers.1.mlp.up_proj.weight")
        ),
        r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]",
    ),
    (
        "wrong shape",
        lambda p: _rewrite_tensors(
            _safetensors(p), lambda t: t.update({"model.norm.weight": np.ones(5, np.float32)})
        ),
        r"model.safetensors: model.norm.weight: shape \(5,\) in the checkpoint",
    ),
]


@pytest.mark.parametrize("name, corrupt, match", WEIGHT_FAULTS, ids=[f[0] for f in WEIGHT_FAULTS])
def test_corrupt_hf_weights_and_config_name_the_file(hf_dir, name, corrupt, match):
    corrupt(hf_dir)
    with pytest.raises(CheckpointError, match=match) as info:
        from_hf(hf_dir)
    assert str(hf_dir) in str(info.value)
    if "config" in name:  # the config section reads config.json too
        spec = ModelSpec(hf_dir=str(hf_dir))
        with pytest.raises(CheckpointError, match=match):
            spec.model_config()


def test_corrupt_sharded_index_names_the_file(tmp_path):
    path = to_hf(tiny_model(), tmp_path / "sharded", max_shard_bytes=20_000)
    index = path / "model.safetensors.index.json"
    good = index.read_text()
    _truncate(index, 30)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: malformed JSON"):
        from_hf(path)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="index.json: no 'weight_map'"):
        from_hf(path)
    # The index sends a tensor to a shard that does not hold it.
    weight_map = json.loads(good)["weight_map"]
    shards = sorted(set(weight_map.values()))
    name = next(n for n, f in weight_map.items() if f == shards[0])
    weight_map[name] = shards[1]
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"{shards[1]}: cannot read tensor {name}"):
        from_hf(path)


TOKENIZER_FAULTS = [
    ("tokenizer.json", lambda p: _truncate(p / "tokenizer.json", 50), "not a readable tokenizer"),
    ("tokenizer.json", lambda p: (p / "tokenizer.json").write_text("{}"), "not a readable tok"),
    (
        "tokenizer_config.json",
        lambda p: (p / "tokenizer_config.json").write_text('{"eos_token": '),
        "malformed JSON",
    ),
    ("config.json", lambda p: _truncate(p / "config.json", 40), "malformed JSON"),
    (
        "generation_config.json",
        lambda p: (p / "generation_config.json").write_text('"eos"'),
        "expected a JSON object, got str",
    ),
]


@pytest.mark.parametrize("file, corrupt, match", TOKENIZER_FAULTS)
def test_corrupt_tokenizer_files_name_the_file(hf_dir, file, corrupt, match):
    corrupt(hf_dir)
    with pytest.raises(CheckpointError, match=f"{re.escape(str(hf_dir / file))}: {match}"):
        HFTokenizer.from_dir(hf_dir)
