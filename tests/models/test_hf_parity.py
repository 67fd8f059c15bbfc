"""Logits parity with Hugging Face `transformers` (PyTorch CPU) on tiny random checkpoints."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sparserl_jax.models import hf as hf_io  # noqa: E402
from sparserl_jax.models import model_preset  # noqa: E402
from sparserl_jax.models.hf import CheckpointError, from_hf, to_hf  # noqa: E402

pytestmark = pytest.mark.slow

# Prime-ish sizes so a transposed or mis-split tensor cannot line up by accident. Only these keys
# are given: each case's config class supplies the rest (Qwen3's default head_dim included).
ARCH = model_preset("hf-parity-tiny")
BASE = dict(
    vocab_size=ARCH.vocab_size,
    hidden_size=ARCH.hidden_size,
    intermediate_size=ARCH.intermediate_size,
    num_hidden_layers=ARCH.num_layers,
    num_attention_heads=ARCH.num_heads,
    num_key_value_heads=ARCH.num_kv_heads,
    max_position_embeddings=ARCH.max_position_embeddings,
    rms_norm_eps=ARCH.rms_norm_eps,
)

CASES = {
    "qwen2_gqa_untied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2_gqa_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3_gqa_untied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(tie_word_embeddings=False, head_dim=12),
    ),
    "qwen3_gqa_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "llama3_gqa_untied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama_mha_tied_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    ),
}


def _hf_model(case: str, seed: int = 0):
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**BASE, **extra})
    model = getattr(transformers, model_cls)(config).eval().to(torch.float32)
    # Random init leaves biases and norm weights at 0/1: perturb every tensor so each one matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def _tokens(seed: int = 1, b: int = 2, t: int = 23) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], (b, t)).astype(np.int32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf_model = _hf_model(case)
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = _tokens(t=40)  # longer than original_max_position_embeddings of the llama3 case
    expected = _hf_logits(hf_model, tokens)

    model = from_hf(tmp_path / "hf", dtype="float32")
    got = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens)))
    assert np.max(np.abs(got - expected)) <= 1e-4

    # Round trip: to_hf -> transformers loads it -> same logits.
    to_hf(model, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float32
    ).eval()
    assert np.max(np.abs(_hf_logits(reloaded, tokens) - expected)) <= 1e-4


def test_sharded_checkpoint_and_bf16(tmp_path):
    hf_model = _hf_model("qwen2_gqa_untied")
    tokens = _tokens()
    expected = _hf_logits(hf_model, tokens)
    model = from_hf(_save(hf_model, tmp_path / "a"), dtype="float32")
    to_hf(model, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    sharded = from_hf(tmp_path / "sharded")
    assert np.max(np.abs(np.asarray(sharded(jnp.asarray(tokens))) - expected)) <= 1e-4
    # bf16 storage: the loaded weights are the bf16 rounding of the fp32 ones, bit for bit.
    to_hf(model, tmp_path / "bf16", dtype="bfloat16")
    m16 = from_hf(tmp_path / "bf16", param_dtype="bfloat16", dtype="bfloat16")
    assert m16.embed.embedding[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(m16.embed.embedding[...]),
        np.asarray(model.embed.embedding[...].astype(jnp.bfloat16)),
    )


def _save(hf_model, path):
    hf_model.save_pretrained(path, safe_serialization=True)
    return path


def test_clear_errors(tmp_path):
    path = _save(_hf_model("qwen2_gqa_untied"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())

    bad = dict(cfg, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="unsupported architecture.*GPT2LMHeadModel"):
        from_hf(path)

    (path / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=64)))
    with pytest.raises(
        CheckpointError,
        match=r"mlp\.(gate|up|down)_proj\.weight: shape \(\d+, \d+\) in the checkpoint",
    ):
        from_hf(path)

    (path / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    with pytest.raises(CheckpointError, match=r"missing tensors.*model.layers.2"):
        from_hf(path)

    (path / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=1)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model.layers.1"):
        from_hf(path)

    (path / "config.json").write_text(json.dumps(dict(cfg, rope_scaling={"rope_type": "yarn"})))
    with pytest.raises(CheckpointError, match="yarn"):
        from_hf(path)

    with pytest.raises(CheckpointError, match="config.json not found"):
        from_hf(tmp_path / "nowhere")


def test_rope_parameters_new_style_config():
    hf = dict(
        BASE,
        architectures=["LlamaForCausalLM"],
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    cfg = hf_io.config_from_hf(hf)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 32.0
