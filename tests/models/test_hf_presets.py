"""A new user's path: checkpoints shaped like the published Qwen2.5 / Qwen3 / Llama-3.2 configs
(every key they carry, sizes shrunk), stored in bf16 by `transformers`, run through the presets in
`configs/` with `sparserl generate ... model.hf_dir=...` and an HF `tokenizer.json`."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sparserl_jax.cli import main  # noqa: E402
from sparserl_jax.models import HFTokenizer, from_hf  # noqa: E402

pytestmark = pytest.mark.slow

SHRINK = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=300)

PUBLISHED = {
    # Keys as in the published config.json files; only the sizes above are shrunk.
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        attention_dropout=0.0,
        bos_token_id=151643,
        eos_token_id=151645,
        hidden_act="silu",
        initializer_range=0.02,
        max_position_embeddings=32768,
        max_window_layers=21,
        num_attention_heads=14 // 7 * 2,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        sliding_window=32768,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        use_cache=True,
        use_sliding_window=False,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=151643,
        eos_token_id=151645,
        head_dim=128 // 4,
        hidden_act="silu",
        initializer_range=0.02,
        max_position_embeddings=40960,
        max_window_layers=28,
        num_attention_heads=16 // 4,
        num_key_value_heads=8 // 4,
        rms_norm_eps=1e-6,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=None,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        use_cache=True,
        use_sliding_window=False,
    ),
    "llama3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        head_dim=64 // 4,
        hidden_act="silu",
        initializer_range=0.02,
        max_position_embeddings=131072,
        mlp_bias=False,
        num_attention_heads=32 // 8,
        num_key_value_heads=8 // 8,
        pretraining_tp=1,
        rms_norm_eps=1e-5,
        rope_scaling=dict(
            factor=32.0,
            high_freq_factor=4.0,
            low_freq_factor=1.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
        rope_theta=500000.0,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        use_cache=True,
    ),
}


def _write_checkpoint(preset, path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = dict(PUBLISHED[preset], **SHRINK)
    # Special ids must fit the shrunk vocabulary.
    eos = cfg["eos_token_id"]
    cfg.update(bos_token_id=1, eos_token_id=[2, 3] if isinstance(eos, list) else 2)
    hf_config = transformers.AutoConfig.for_model(
        **{k: v for k, v in cfg.items() if k != "architectures"}
    )
    hf_config.architectures = cfg["architectures"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).to(torch.bfloat16).eval()
    model.save_pretrained(path, safe_serialization=True)
    words = ["<pad>", "<s>", "</s>", "<eot>"] + [f"w{i}" for i in range(296)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return model


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_runs_on_local_checkpoint(preset, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    hf_model = _write_checkpoint(preset, ckpt)
    tok = HFTokenizer.from_dir(ckpt)
    assert tok.bos_id == 1 and tok.eos_ids[0] == 2

    # bf16 weights are loaded exactly; fp32 compute on them matches transformers in fp32.
    model = from_hf(ckpt, dtype="float32", param_dtype="float32")
    tokens = np.random.default_rng(0).integers(0, 300, (1, 19))
    # Reference: transformers loading the same directory in fp32 (`hf_model.float()` would keep
    # the RoPE inv_freq buffer rounded to bf16 by `.to(bfloat16)`).
    del hf_model
    reference = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        expected = reference.eval()(torch.from_numpy(tokens)).logits.numpy()
    assert np.max(np.abs(np.asarray(model(tokens)) - expected)) <= 1e-4

    code = main(
        [
            "generate",
            f"configs/{preset}.yaml",
            f"model.hf_dir={ckpt}",
            f"run_dir={tmp_path / 'run'}",
            "model.dtype=float32",
            "generate.prompts=[w5 w6 w7]",
            "generate.max_new_tokens=5",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["reload_max_abs_logit_diff"] == 0.0
    assert 1 <= summary["generated_tokens"] <= 5
