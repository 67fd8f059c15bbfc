"""The registry of named architectures: every preset is a valid model, the published shapes have
their published parameter counts, and a typo names the closest presets."""

import jax
import pytest
from flax import nnx

from sparserl_jax.models import MODEL_PRESETS, ModelConfig, Transformer, model_preset

# Parameter counts of the published checkpoints (tied embeddings counted once).
PUBLISHED = {
    "qwen2.5-0.5b": 494_032_768,  # "0.49B"
    "qwen2.5-1.5b": 1_543_714_304,  # "1.54B"
    "qwen2.5-7b": 7_615_616_512,  # "7.61B", 6.53B non-embedding
    "qwen2.5-32b": 32_763_876_352,  # "32.5B"; 65,527,752,704 bytes of bf16 safetensors
    "qwen3-0.6b": 596_049_920,  # "0.6B", 0.44B non-embedding
    "llama3.2-1b": 1_235_814_400,  # "1.24B"
}
SMALL = [name for name, cfg in MODEL_PRESETS.items() if cfg.num_params() < 50_000_000]


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_is_a_valid_config(name):
    cfg = model_preset(name)
    assert isinstance(cfg, ModelConfig)
    # Rebuilding from its own fields passes validation and changes nothing.
    assert ModelConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}) == cfg
    assert model_preset(name, dtype="bfloat16").replace(dtype="float32") == cfg


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes_have_published_parameter_counts(name):
    assert model_preset(name).num_params() == PUBLISHED[name]
    # The count of the parameters the model really creates (shapes only, nothing allocated).
    shapes = jax.eval_shape(lambda: nnx.state(Transformer(model_preset(name), rngs=nnx.Rngs(0))))
    assert sum(x.size for x in jax.tree.leaves(shapes)) == PUBLISHED[name]


@pytest.mark.parametrize("name", SMALL)
def test_small_presets_build(name):
    model = Transformer(model_preset(name), rngs=nnx.Rngs(0))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == model.cfg.num_params()


def test_overrides_apply_and_validate():
    cfg = model_preset("test-tiny", num_layers=1, tie_embeddings=True)
    assert (cfg.num_layers, cfg.tie_embeddings, cfg.vocab_size) == (1, True, 67)
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        model_preset("test-tiny", num_kv_heads=3)


def test_unknown_name_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown model preset 'qwen2.5-05b'; did you mean "
                       r"'qwen2.5-0.5b'.*known presets: \["):  # fmt: skip
        model_preset("qwen2.5-05b")
    with pytest.raises(ValueError, match=r"'llama3.2-1b'"):
        model_preset("llama-3.2-1b")
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt2'; known presets"):
        model_preset("gpt2")


def test_registry_is_read_only():
    with pytest.raises(TypeError):
        MODEL_PRESETS["mine"] = model_preset("test-tiny")  # type: ignore[index]
