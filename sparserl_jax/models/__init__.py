"""Decoder-only transformers (Llama-3, Qwen2/2.5, Qwen3), Hugging Face I/O, tokenizers and the
registry of named architectures (`model_preset`)."""

from sparserl_jax.models.cache import DecodeCache, DenseKVCache
from sparserl_jax.models.config import ModelConfig, RopeScaling
from sparserl_jax.models.hf import CheckpointError, config_from_hf, from_hf, to_hf
from sparserl_jax.models.presets import MODEL_PRESETS, model_preset
from sparserl_jax.models.tokenizer import CharTokenizer, HFTokenizer
from sparserl_jax.models.transformer import Transformer, check_token_ids

__all__ = [
    "CharTokenizer",
    "CheckpointError",
    "DecodeCache",
    "DenseKVCache",
    "HFTokenizer",
    "MODEL_PRESETS",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "check_token_ids",
    "config_from_hf",
    "from_hf",
    "model_preset",
    "to_hf",
]
