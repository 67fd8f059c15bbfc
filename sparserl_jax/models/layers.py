"""Building blocks: parameters with logical axes, RMSNorm, RoPE, grouped-query attention.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (one name per dimension);
`sparserl_jax.parallel` maps those names to mesh axes with one rules table.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from sparserl_jax.models.config import RopeScaling


def param(
    rngs: nnx.Rngs | None,
    shape: tuple[int, ...],
    logical_axes: tuple[str | None, ...],
    dtype: jnp.dtype,
    *,
    init: str = "normal",
    fan_in: int | None = None,
    units: tuple[int, ...] | None = None,
) -> nnx.Param:
    """A parameter with logical axis names; `init` is normal (scaled by fan-in), zeros or ones.
    `units`: per dimension, how many consecutive elements a shard keeps together (a fused
    `heads * head_dim` dimension is sharded by whole heads; `parallel.logical_to_spec`)."""
    if len(shape) != len(logical_axes):
        raise ValueError(f"shape {shape} and logical axes {logical_axes} differ in rank")
    if init == "zeros":
        value = jnp.zeros(shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "normal":
        std = 1.0 / math.sqrt(fan_in or shape[0])
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    else:
        raise ValueError(f"unknown init {init!r}")
    if units is None:
        return nnx.Param(value, logical_axes=tuple(logical_axes))
    return nnx.Param(value, logical_axes=tuple(logical_axes), shard_units=tuple(units))


class RMSNorm(nnx.Module):
    """`x / sqrt(mean(x^2) + eps) * w`, normalised in fp32 (as Hugging Face Llama/Qwen do)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype, axis_name: str = "norm"):
        self.eps = eps
        self.weight = param(None, (dim,), (axis_name,), param_dtype, init="ones")

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # HF casts back to the input dtype before the weight multiply; keep that order.
        w = self.weight[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return w * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies `theta^(-2i/H)`, with Llama-3.1 or linear scaling applied."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between smoothed.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(
    x_btnh: Float[Array, "B T N H"], positions_bt: Int[Array, "B T"], inv_freq: jax.Array
) -> Float[Array, "B T N H"]:
    """Rotate-half RoPE (the Hugging Face convention), computed in fp32."""
    angles_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    angles_bth = jnp.concatenate([angles_bth, angles_bth], axis=-1)
    cos, sin = jnp.cos(angles_bth)[:, :, None, :], jnp.sin(angles_bth)[:, :, None, :]
    x32 = x_btnh.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x_btnh.dtype)


def gqa_attention(
    q_btnh: Float[Array, "B T N H"],
    k_bskh: Float[Array, "B S K H"],
    v_bskh: Float[Array, "B S K H"],
    mask_bts: Bool[Array, "B T S"],
) -> Float[Array, "B T N H"]:
    """Grouped-query attention of pre-scaled queries over masked keys, softmax in fp32.
    `mask_bts` may also be per KV head, `[B, K, T, S]`.

    Query head n uses kv head n // G (G = N // K), as Hugging Face's `repeat_kv` does. Rows whose
    mask is all False return zeros, never NaN. Returns fp32.
    """
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
    scores_bkgts = jnp.einsum(
        "btkgh,bskh->bkgts",
        q_btkgh,
        k_bskh.astype(q_btnh.dtype),
        preferred_element_type=jnp.float32,
    )
    mask_bkgts = mask_bts[:, None, None] if mask_bts.ndim == 3 else mask_bts[:, :, None]
    scores_bkgts = jnp.where(mask_bkgts, scores_bkgts, -jnp.inf)
    max_bkgt1 = jnp.max(scores_bkgts, axis=-1, keepdims=True)
    max_bkgt1 = jnp.where(jnp.isfinite(max_bkgt1), max_bkgt1, 0.0)
    p_bkgts = jnp.exp(scores_bkgts - max_bkgt1)
    denom_bkgt1 = jnp.sum(p_bkgts, axis=-1, keepdims=True)
    p_bkgts = p_bkgts / jnp.where(denom_bkgt1 > 0, denom_bkgt1, 1.0)
    out_btkgh = jnp.einsum(
        "bkgts,bskh->btkgh",
        p_bkgts.astype(v_bskh.dtype),
        v_bskh,
        preferred_element_type=jnp.float32,
    )
    return out_btkgh.reshape(b, t, n, h)
