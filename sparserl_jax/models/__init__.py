"""Decoder-only transformers (Llama-3, Qwen2/2.5, Qwen3), Hugging Face I/O and tokenizers."""

from sparserl_jax.models.cache import DecodeCache, DenseKVCache
from sparserl_jax.models.config import ModelConfig, RopeScaling
from sparserl_jax.models.transformer import Transformer
