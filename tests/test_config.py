"""Config schema: YAML presets, dotted overrides, clear errors."""

from pathlib import Path

import pytest

from sparserl_jax.config import (
    Config,
    ConfigError,
    ModelSpec,
    apply_overrides,
    from_dict,
    load_config,
    to_dict,
)
from sparserl_jax.models import model_preset

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert {p.stem for p in CONFIGS} >= {"demo", "tiny"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # The round trip through plain dicts is lossless.
    assert from_dict(Config, to_dict(cfg)) == cfg


def test_overrides_and_types():
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "model.arch.num_layers=3",
            "generate.temperature=0.7",
            "generate.prompts=[a, b, c]",
            "mesh.tensor=2",
            "model.arch.rope_theta=1e6",
        ],
    )
    assert cfg.model.arch.num_layers == 3
    assert cfg.generate.temperature == 0.7
    assert cfg.generate.prompts == ("a", "b", "c")
    assert cfg.mesh.tensor == 2
    assert cfg.model.arch.rope_theta == 1e6
    # A YAML-1.1 string like "1e-6" is accepted for a float field.
    assert load_config("configs/tiny.yaml", ["generate.top_p=5e-1"]).generate.top_p == 0.5
    assert to_dict(cfg)["model"]["arch"]["num_layers"] == 3


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"unknown key 'model.arch.hiden_size'.*'hidden_size'"):
        load_config("configs/tiny.yaml", ["model.arch.hiden_size=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'genrate'.*'generate'"):
        load_config("configs/tiny.yaml", ["genrate.max_new_tokens=3"])


def test_wrong_type_names_field_value_and_type():
    with pytest.raises(ConfigError, match=r"model.arch.num_layers = 'many' \(str\).*expected int"):
        load_config("configs/tiny.yaml", ["model.arch.num_layers=many"])
    with pytest.raises(ConfigError, match=r"generate.temperature = True \(bool\).*float"):
        load_config("configs/tiny.yaml", ["generate.temperature=true"])
    with pytest.raises(ConfigError, match=r"model.dtype = 'float31'.*did you mean 'float32'"):
        load_config("configs/tiny.yaml", ["model.dtype=float31"])
    with pytest.raises(ConfigError, match=r"generate.top_p must be in \(0, 1\], got 2.0"):
        load_config("configs/tiny.yaml", ["generate.top_p=2"])
    with pytest.raises(ConfigError, match=r"num_heads \(4\) must be a multiple of num_kv_heads"):
        load_config("configs/tiny.yaml", ["model.arch.num_kv_heads=3"])


def test_missing_and_malformed():
    with pytest.raises(ConfigError, match="missing required keys.*model"):
        load_config(None, [])
    with pytest.raises(ConfigError, match="exactly one of model.hf_dir and model.arch"):
        load_config("configs/tiny.yaml", ["model.hf_dir=/x"])
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides({}, ["model.dtype"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"run_dir": "x"}, ["run_dir.sub=1"])


def test_model_preset_and_arch_overrides():
    cfg = load_config("configs/tiny.yaml", ["model.preset=qwen2.5-0.5b"])
    assert cfg.model.preset == "qwen2.5-0.5b"
    assert cfg.model.arch == model_preset("qwen2.5-0.5b")
    # `arch` keys replace single fields of the preset; the rest stays the preset's.
    cfg = load_config("configs/tiny.yaml", ["model.preset=loco-small", "model.arch.num_layers=3"])
    assert cfg.model.arch == model_preset("loco-small", num_layers=3)
    spec = cfg.model.model_config()
    assert (spec.num_layers, spec.dtype, spec.vocab_size) == (3, "float32", 512)
    # A whole ModelConfig as arch, no preset, as before.
    spec = ModelSpec(arch=model_preset("char-tiny"), dtype="float32")
    assert spec.preset is None and spec.model_config().vocab_size == 96


def test_unknown_model_preset_names_closest():
    with pytest.raises(ConfigError, match=r"model.preset: unknown model preset 'qwen2.5-05b'; "
                       r"did you mean 'qwen2.5-0.5b'"):  # fmt: skip
        load_config("configs/tiny.yaml", ["model.preset=qwen2.5-05b"])
    with pytest.raises(
        ConfigError, match="exactly one of model.hf_dir and model.arch/model.preset"
    ):
        load_config("configs/qwen3-0.6b.yaml", ["model.preset=qwen3-0.6b"])
    with pytest.raises(ConfigError, match=r"model.arch = 5 \(int\) but expected a mapping"):
        load_config("configs/tiny.yaml", ["model.arch=5"])


def test_object_store_write_rate_is_checked():
    from sparserl_jax.decoupled.config import ExchangeConfig

    ExchangeConfig(url="gs://b/run/")  # the defaults: a beat per second, renewals every 15 s
    with pytest.raises(ValueError, match=r"pulse_s \(0.5\) and lease_s / 4 \(15.0.*must be >= 1"):
        ExchangeConfig(url="gs://b/run/", pulse_s=0.5)
    with pytest.raises(ValueError, match=r"lease_s / 4 \(0.5,"):
        ExchangeConfig(url="s3://b/run/", lease_s=2)
    ExchangeConfig(url="file:///tmp/x/", lease_s=2, pulse_s=0.1)  # a local store: no limit
