"""The decode-path cache protocol, and the dense (contiguous) reference cache.

The model's decode path talks to a cache through three calls per forward step, so that the
paged, compressible cache (`sparserl_jax.kvcache`) plugs in without reshaping the model:

    cache, positions_bt = cache.begin_step(token_mask_bt)   # make room, give absolute positions
    for layer in layers:                                      # keys arrive *after* RoPE
        out_btnh, cache = cache.attend(layer, q_btnh, k_btkh, v_btkh)
    cache = cache.end_step()                                  # advance lengths / next positions

Contract:
- `token_mask_bt` marks the real new tokens of each row; they are left-aligned (row b has
  `sum(token_mask_bt[b])` real tokens at the front, padding after). Padding is never stored.
- `positions_bt[b, t]` is the absolute RoPE position of new token t of row b: the row's next
  absolute position plus t. It is *not* the number of tokens kept (eviction does not move it).
- `q_btnh` is already multiplied by the softmax scale; attention is `softmax(q · kᵀ) v` over the
  row's kept keys plus the causal prefix of the new keys, computed in fp32.
- Caches are pytrees (`jax.tree_util.register_dataclass`), so they pass through `jit` and
  `lax.while_loop`; `attend` must be pure. Layer indices are static Python ints.

Axis letters as in the package docstring (`sparserl_jax`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from sparserl_jax.models.layers import gqa_attention  # noqa: F401  (re-exported)


class DecodeCache(Protocol):
    """What `Transformer.decode` needs from a KV cache (see the module docstring)."""

    def begin_step(self, token_mask_bt: jax.Array) -> tuple[DecodeCache, jax.Array]: ...

    def attend(
        self, layer: int, q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array
    ) -> tuple[jax.Array, DecodeCache]: ...

    def end_step(self) -> DecodeCache: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """Contiguous per-layer K/V buffers `[Y, B, S, K, H]`: the dense reference cache.

    Every token stays, so the next absolute position of a row equals its length. Used for plain
    generation and as the reference the paged cache is tested against.
    """

    k_ybskh: jax.Array
    v_ybskh: jax.Array
    lengths_b: jax.Array  # int32 [B]: tokens stored per row
    new_counts_b: jax.Array  # int32 [B]: real tokens in the step in flight (0 between steps)

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
    ) -> DenseKVCache:
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        zeros_b = jnp.zeros((batch,), jnp.int32)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), zeros_b, zeros_b)

    @property
    def capacity(self) -> int:
        return self.k_ybskh.shape[2]

    def begin_step(self, token_mask_bt: jax.Array) -> tuple[DenseKVCache, jax.Array]:
        t = token_mask_bt.shape[1]
        new_counts_b = jnp.sum(token_mask_bt.astype(jnp.int32), axis=1)
        positions_bt = self.lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        return dataclasses.replace(self, new_counts_b=new_counts_b), positions_bt

    def attend(
        self, layer: int, q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array
    ) -> tuple[jax.Array, DenseKVCache]:
        t = q_btnh.shape[1]
        s = self.capacity

        # Write the T new rows at each row's length; rows past the real count are padding and
        # sit beyond the new length, so they are masked now and overwritten later. Scatter with
        # mode="drop" (not dynamic_update_slice, which clamps the start and would overwrite
        # earlier keys when padding runs past the capacity).
        def write(buf_skh, new_tkh, start):
            return buf_skh.at[start + jnp.arange(t)].set(new_tkh, mode="drop")

        write = jax.vmap(write)
        dtype = self.k_ybskh.dtype
        k_bskh = write(self.k_ybskh[layer], k_btkh.astype(dtype), self.lengths_b)
        v_bskh = write(self.v_ybskh[layer], v_btkh.astype(dtype), self.lengths_b)
        query_pos_bt = self.lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        key_pos_s = jnp.arange(s, dtype=jnp.int32)
        new_len_b = self.lengths_b + self.new_counts_b
        mask_bts = (key_pos_s[None, None, :] <= query_pos_bt[:, :, None]) & (
            key_pos_s[None, None, :] < new_len_b[:, None, None]
        )
        out_btnh = gqa_attention(q_btnh, k_bskh, v_bskh, mask_bts).astype(q_btnh.dtype)
        cache = dataclasses.replace(
            self,
            k_ybskh=self.k_ybskh.at[layer].set(k_bskh),
            v_ybskh=self.v_ybskh.at[layer].set(v_bskh),
        )
        return out_btnh, cache

    def end_step(self) -> DenseKVCache:
        return dataclasses.replace(
            self,
            lengths_b=self.lengths_b + self.new_counts_b,
            new_counts_b=jnp.zeros_like(self.new_counts_b),
        )
