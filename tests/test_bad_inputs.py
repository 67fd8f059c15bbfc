"""The last bad inputs (issue 27, item 4): each is one line naming what is wrong, raised before
the expensive work it would spoil."""

import gc
import json
import logging
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from sparserl_jax.checkpoint import CheckpointManager
from sparserl_jax.config import Config, ConfigError, from_dict, load_config, to_dict
from sparserl_jax.data import DataError
from sparserl_jax.models import CheckpointError, HFTokenizer, from_hf, to_hf
from sparserl_jax.rl import Learner, LearnerConfig
from sparserl_jax.rollout import RolloutConfig, RolloutEngine, dense_logprobs
from sparserl_jax.sync import Publisher
from sparserl_jax.testing import tiny_model
from sparserl_jax.testing.learner import make_batch
from sparserl_jax.testing.reference_sampler import generate as reference_generate
from sparserl_jax.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
FAST = ["data.batch_size=4", "sft.steps=0", "train.eval_examples=0"]


def _no_build(monkeypatch):
    """Building the model is an error: a check that passes this ran before any build."""

    def boom(*a, **k):
        raise AssertionError("the model was built before the inputs were checked")

    monkeypatch.setattr("sparserl_jax.train.build_model", boom)


# -- 1. a dtype set in both model.arch and the model section ------------------------------------


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.arch.dtype=bfloat16", "model.arch.dtype = 'bfloat16' but model.dtype = 'float32'"),
        (
            "model.arch.param_dtype=bfloat16",
            "model.arch.param_dtype = 'bfloat16' but model.param_dtype = 'float32'",
        ),
        ("model.arch.remat=true", "model.arch.remat = True but model.remat = False"),
    ],
)
def test_model_setting_in_arch_and_section_is_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, [override])


def test_model_setting_in_arch_equal_to_section_and_round_trip():
    cfg = load_config(TINY, ["model.arch.dtype=float32"])  # the same value: no conflict
    assert cfg.model.model_config().dtype == "float32"
    # The resolved arch carries the section's settings, so a saved config loads back as it was.
    cfg = load_config(TINY, ["model.dtype=bfloat16", "model.remat=true"])
    assert (cfg.model.arch.dtype, cfg.model.arch.remat) == ("bfloat16", True)
    assert from_dict(Config, to_dict(cfg)) == cfg


# -- 2-4. Hugging Face directories ------------------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path):
    from tokenizers import Tokenizer, models

    path = to_hf(tiny_model(), tmp_path / "hf")
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "[UNK]": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(path / "tokenizer.json"))
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, **changes)))


def test_unsupported_architectures_class_with_supported_model_type_is_refused(hf_dir):
    model_type = json.loads((hf_dir / "config.json").read_text())["model_type"]
    _edit_config(hf_dir, architectures=["Qwen2ForSequenceClassification"])
    match = rf"architectures \['Qwen2ForSequenceClassification'\] .*model_type '{model_type}'"
    with pytest.raises(CheckpointError, match=match):
        from_hf(hf_dir)
    _edit_config(hf_dir, architectures=[])  # no class named: model_type decides, as before
    assert from_hf(hf_dir).cfg.family == model_type


def test_integer_tensor_is_refused_by_name(hf_dir):
    file = hf_dir / "model.safetensors"
    with safe_open(file, framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors[
        "model.layers.1.mlp.up_proj.weight"
    ].astype(np.int8)
    save_file(tensors, str(file))
    with pytest.raises(
        CheckpointError,
        match=r"model.layers.1.mlp.up_proj.weight is stored as int8, not a float dtype",
    ) as info:
        from_hf(hf_dir)
    assert str(file) in str(info.value)


@pytest.mark.parametrize(
    "file, content, match",
    [
        ("config.json", {"eos_token_id": 7}, r"eos_token_id 7 \(config.json\)"),
        ("config.json", {"eos_token_id": [1, -2]}, r"eos_token_id -2 \(config.json\)"),
        ("generation_config.json", {"eos_token_id": 40}, r"eos_token_id 40 \(generation_config"),
        ("config.json", {"eos_token_id": "</s>"}, r"eos_token_id '</s>' \(config.json\)"),
    ],
)
def test_eos_outside_the_vocabulary_is_refused(hf_dir, file, content, match):
    if file == "config.json":
        _edit_config(hf_dir, **content)
    else:
        _edit_config(hf_dir, eos_token_id=None)
        (hf_dir / file).write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match=match + r".*vocabulary \[0, 4\)"):
        HFTokenizer.from_dir(hf_dir)


def test_stop_token_outside_the_model_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"stop_token_ids: 67 is outside the .*\[0, 67\)"):
        RolloutEngine(tiny_model(), RolloutConfig(num_slots=2, stop_token_ids=(2, 67)))


# -- 5. float token ids ------------------------------------------------------------------------

FLOAT = r"{what}: token ids are float\d+, not integers"


def test_float_token_ids_are_refused_at_every_entry():
    model = tiny_model(param_dtype="float32", dtype="float32")
    floats = np.arange(12, dtype=np.float32).reshape(2, 6)
    with pytest.raises(ValueError, match=FLOAT.format(what="tokens")):
        model(jnp.asarray(floats))
    engine = RolloutEngine(model, RolloutConfig(num_slots=2, max_prompt_len=4, max_new_tokens=2))
    with pytest.raises(ValueError, match=FLOAT.format(what="prompt 1")):
        engine.generate([[1, 2], [1.0, 2.5]])
    with pytest.raises(ValueError, match=FLOAT.format(what="prompts")):
        reference_generate(model, [[1.0, 3.0]], max_new_tokens=2)
    with pytest.raises(ValueError, match=FLOAT.format(what="dense_logprobs tokens_bt")):
        dense_logprobs(model, None, floats)
    learner = Learner(model, LearnerConfig())
    state = learner.init(model)
    with pytest.raises(ValueError, match=FLOAT.format(what="learner batch tokens_bt")):
        learner.logprobs(state.params, jnp.asarray(floats))
    batch = make_batch()
    batch = batch._replace(
        tokens_bt=np.asarray(batch.tokens_bt, np.float32), old_logp_bt=batch.sampler_logp_bt
    )
    with pytest.raises(ValueError, match=FLOAT.format(what="learner batch tokens_bt")):
        learner.train_on_batch(state, batch)
    graphdef, params = nnx.split(model)
    with pytest.raises(ValueError, match=FLOAT.format(what="dense_logprobs tokens_bt")):
        dense_logprobs(graphdef, nnx.to_pure_dict(params), floats.astype(np.float64))


# -- 6. a leaf whose shape changed between publishes --------------------------------------------


def test_publish_names_a_leaf_whose_shape_or_dtype_changed():
    publisher = Publisher()
    tree = {"a": np.zeros(4, np.float32), "b": {"w": np.ones((2, 3), np.float32)}}
    publisher.publish(tree)
    with pytest.raises(
        ValueError, match=r"\['b'\]\['w'\] is \(3, 2\) bfloat16 but was \(2, 3\) bfloat16"
    ):
        publisher.publish({"a": tree["a"], "b": {"w": np.ones((3, 2), np.float32)}})
    with pytest.raises(ValueError, match=r"\['a'\] is \(4,\) int32 but was \(4,\) bfloat16"):
        publisher.publish({"a": np.zeros(4, np.int32), "b": tree["b"]})
    assert publisher.version == 0  # nothing was published
    assert publisher.publish(tree).version == 1


# -- 7. device counts when the sampler split is the cause ---------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["mesh.data=2"], r"7 devices cannot be split .*train.sampler_devices=1"),
        ([], r"rows, must be a multiple .*7 devices: 8 less train.sampler_devices=1"),
    ],
)
def test_device_count_errors_name_the_sampler_split(tmp_path, monkeypatch, overrides, match):
    _no_build(monkeypatch)
    split = ["train.topology=split", "train.sampler_devices=1"]
    cfg = load_config(TINY, [f"run_dir={tmp_path}", *FAST, *split, *overrides])
    with pytest.raises(ValueError, match=match):
        train(cfg, log_fn=lambda m: None)


def test_mini_batches_that_do_not_split_the_rollout_batch(tmp_path, monkeypatch):
    _no_build(monkeypatch)  # refused with the other pre-flight checks, before any build
    cfg = load_config(TINY, [f"run_dir={tmp_path}", *FAST, "learner.num_mini_batches=3"])
    with pytest.raises(ValueError, match=r"multiple of learner.num_mini_batches \(3\) x "):
        train(cfg, log_fn=lambda m: None)


@pytest.mark.parametrize(
    "overrides, match",
    [
        # 4 slots over the sampler's 3 data shards (3 devices, tensor 1)
        (["train.sampler_devices=3"], r"num_slots=4 .*must divide over the mesh's data axis"),
        (
            ["train.sampler_devices=4", "rollout.num_pages=8"],
            r"data shard.s pool \(8 / 4 = 2 pages\)",
        ),
    ],
)
def test_rollout_slots_that_do_not_split_over_the_sampler_mesh(
    tmp_path, monkeypatch, overrides, match
):
    # Checked with the other pre-flight checks, before any model is built.
    _no_build(monkeypatch)
    cfg = load_config(TINY, [f"run_dir={tmp_path}", *FAST, "train.topology=split", *overrides])
    with pytest.raises(ValueError, match=match):
        train(cfg, log_fn=lambda m: None)


def test_sampler_tensor_must_divide_the_sampler_devices():
    with pytest.raises(ConfigError, match="must be >= 1 and divide by train.sampler_tensor=3 x"):
        load_config(TINY, ["train.sampler_devices=4", "train.sampler_tensor=3"])


# -- 8. the user's reward function on one real example, before the model is built --------------


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            def by_answer(prompt, completion, answer):
                return {"42": 1.0}[answer]

            def returns_none(prompt, completion, answer):
                return None
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "bad_rewards_mod"


def test_reward_fn_is_tried_on_a_real_example_before_the_model_is_built(
    tmp_path, monkeypatch, reward_module
):
    _no_build(monkeypatch)
    for name, match in [
        ("by_answer", r"failed on example arithmetic/train#\d+ \(prompt '\d\D\d='.*KeyError"),
        ("returns_none", r"returned None for .*arithmetic"),
    ]:
        spec = f"{reward_module}:{name}"
        cfg = load_config(TINY, [f"run_dir={tmp_path}", *FAST, f"data.reward_fn={spec}"])
        with pytest.raises(DataError, match=match) as info:
            train(cfg, log_fn=lambda m: None)
        assert f"reward_fn {spec!r}" in str(info.value)  # the function, by name
        assert "\n" not in str(info.value)
    assert not (tmp_path / "checkpoints").exists()


# -- 10. a restore that falls back past a damaged step leaves no traceback behind ---------------


def test_fallback_past_a_damaged_step_prints_no_traceback(tmp_path, monkeypatch, caplog):
    """Orbax closes its event loop when a read fails, with the other TensorStore reads still in
    flight; their callbacks then meet the closed loop (`RuntimeError: Event loop is closed`,
    printed as unraisable tracebacks by a run that otherwise exits 0)."""

    def state(seed):
        key = jax.random.key(seed)
        return {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (64, 32)) for i in range(20)}

    with CheckpointManager(tmp_path, keep=3) as ckpt:
        ckpt.save(1, state(1))
        ckpt.save(2, state(2))
    for path in (tmp_path / "checkpoints" / "2" / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path, keep=3) as ckpt:
        assert ckpt.restore_latest(state(0))[1]["step"] == 1
    time.sleep(1)  # the abandoned reads finish
    gc.collect()
    assert unraisable == []
    assert [r.name for r in caplog.records] == ["sparserl_jax.checkpoint"]  # the one line


@pytest.mark.parametrize(
    "override, needle",
    [("train.eval_examples=4", "train.eval_examples"), ("sft.steps=2", "sft.steps")],
)
def test_what_several_trainer_processes_cannot_do_is_refused_in_one_line(override, needle):
    from sparserl_jax.decoupled import processes

    cfg = load_config(TINY, [*FAST, override])
    with pytest.raises(ValueError, match=needle) as err:
        processes.refuse(cfg)
    assert "\n" not in str(err.value)
    processes.refuse(load_config(TINY, FAST))  # the rest passes


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["run_dir=ftp://host/run"], r"a local path, gs://bucket/dir or s3://bucket/dir"),
        (["run_dir=gs://bucket/run", "train.tensorboard=true"], r"tensorboard needs a local"),
    ],
)
def test_a_run_dir_url_nothing_can_reach_is_refused_before_the_model(monkeypatch, overrides, match):
    pytest.importorskip("gcsfs")
    _no_build(monkeypatch)
    cfg = load_config(TINY, [*FAST, *overrides])
    with pytest.raises(ValueError, match=match) as err:
        train(cfg, log_fn=lambda m: None)
    assert "\n" not in str(err.value)
