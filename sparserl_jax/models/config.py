"""Architecture config for the decoder family (Llama-3, Qwen2/2.5, Qwen3)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("auto", "dense", "chunked", "cudnn", "splash")
RopeType = Literal["default", "llama3", "linear"]


def dtype_name(dtype: object) -> str:
    """Canonical name of a dtype given as a string, numpy or jax dtype."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError as e:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}") from e
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {DTYPES}")
    return name


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as in Hugging Face `rope_scaling` / `rope_parameters`.

    `llama3`: Llama-3.1 wavelength-dependent scaling (factor, low/high frequency factors and the
    original context length). `linear`: positions divided by `factor`. `default`: none.
    """

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("default", "llama3", "linear"):
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; expected default, llama3 or linear"
            )
        if self.factor <= 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer: GQA, RoPE, RMSNorm, SwiGLU.

    Attributes:
      vocab_size: V.
      hidden_size: D, the residual width.
      num_layers: number of decoder blocks.
      num_heads: N query heads.
      num_kv_heads: K key/value heads (GQA); N must be a multiple of K.
      head_dim: H; defaults to D // N.
      intermediate_size: F, the SwiGLU width.
      rope_theta: RoPE base.
      rope_scaling: optional frequency scaling (Llama-3.1 `llama3`, `linear`).
      rms_norm_eps: epsilon inside every RMSNorm.
      tie_embeddings: the LM head reuses the token embedding (`E^T`).
      qkv_bias: biases on q/k/v projections (Qwen2/2.5).
      o_bias: bias on the output projection (Llama `attention_bias=True` sets both).
      mlp_bias: biases on the SwiGLU projections (Llama `mlp_bias`).
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
      max_position_embeddings: the context the checkpoint was trained for (kept for export).
      param_dtype: dtype the parameters are stored in (fp32 master weights by default).
      dtype: compute dtype of matmuls (bf16 for speed, fp32 for tests); logits are fp32.
      remat: rematerialise each block in the backward pass.
      attention: teacher-forcing attention (`models.attention.causal_attention`): "auto" (splash
        on TPU, cuDNN on GPU, chunked elsewhere), "dense" (the `[T, T]` reference), "chunked"
        (online softmax in XLA), "cudnn" or "splash"; a kernel that cannot take the shapes
        falls back to chunked with one log line. Decoding never uses it.
      attention_block: query/key block of the chunked path and splash (tokens).
      mlp_chunk: teacher forcing runs the SwiGLU over blocks of this many tokens when a sequence
        is longer (each block rematerialised in the backward pass), so no `[T, F]` activation
        exists at long T; 0 runs it over the whole sequence.
      family: which Hugging Face architecture this came from / exports to.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: bool = False
    attention: Literal["auto", "dense", "chunked", "cudnn", "splash"] = "auto"
    attention_block: int = 512
    mlp_chunk: int = 4096
    family: Literal["llama", "qwen2", "qwen3"] = "qwen2"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads "
                    f"({self.num_heads}); set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.family not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"family {self.family!r} unknown; expected llama, qwen2 or qwen3")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r} unknown; expected one of {ATTENTION}")
        if not isinstance(self.attention_block, int) or self.attention_block <= 0:
            raise ValueError(
                f"attention_block must be a positive int, got {self.attention_block!r}"
            )
        if not isinstance(self.mlp_chunk, int) or self.mlp_chunk < 0:
            raise ValueError(f"mlp_chunk must be an int >= 0, got {self.mlp_chunk!r}")
        object.__setattr__(self, "param_dtype", dtype_name(self.param_dtype))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def fused_heads(self) -> bool:
        """Whether the q/k/v projections are stored `[D, heads * H]` (heads a whole number of
        the TPU's 128-lane tiles wide: the product splits into heads for free) rather than
        `[D, heads, H]` (narrower heads, which XLA lays out per head either way)."""
        return self.head_dim % 128 == 0

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        n, k, v = self.num_heads, self.num_kv_heads, self.vocab_size
        attn = d * h * (n + 2 * k) + n * h * d
        attn += (n + 2 * k) * h if self.qkv_bias else 0
        attn += d if self.o_bias else 0
        attn += 2 * h if self.qk_norm else 0
        mlp = 3 * d * f + ((2 * f + d) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_embeddings else d * v
        return v * d + self.num_layers * per_layer + d + head
