"""Flax NNX decoder-only transformer for the Llama-3 / Qwen2 / Qwen3 family.

Axis letters as in the package docstring (`sparserl_jax`).

Two entry points share every weight and every projection:
- `model(tokens, positions=None, segment_ids=None)`: teacher forcing over whole (optionally
  packed) sequences, causal attention restricted to equal segment ids.
- `model.decode(tokens, cache, token_mask=None)`: incremental decoding on any cache that follows
  `sparserl_jax.models.cache.DecodeCache` (the dense reference cache or the paged cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from sparserl_jax.models.attention import causal_attention
from sparserl_jax.models.cache import DecodeCache
from sparserl_jax.models.config import ModelConfig
from sparserl_jax.models.flash import blocks, unblocks
from sparserl_jax.models.layers import RMSNorm, apply_rope, param, rope_inv_freq
from sparserl_jax.parallel.sharding import constrain

# Logical axes of the activations (`parallel.sharding.RULES`): rows over data x fsdp, heads and
# MLP columns over tensor, on the mesh the program is traced under (`constrain`).
ACT_BTD = ("batch", "length", "act_embed")
ACT_BTF = ("batch", "length", "act_mlp")
ACT_BTNH = ("batch", "length", "act_heads", None)
ACT_BTKH = ("batch", "length", "act_kv_heads", None)
ACT_BTV = ("batch", "length", "act_vocab")


def _in_proj(rngs: nnx.Rngs, cfg: ModelConfig, heads: int, axis: str) -> nnx.Param:
    """A q/k/v projection: `[D, heads * H]` when `cfg.fused_heads`, sharded by whole heads (as
    `[D, heads, H]` the TPU tiles the small (heads per chip, H) minor dims and every decode
    program carried a relayout of all layers' weights: 171 MiB per chip at 7B on v5e-8), else
    `[D, heads, H]` (64-wide heads: splitting a lane-dense product into them would relayout the
    activations instead, worse at 0.5B; docs/results.md)."""
    d, h, wd = cfg.hidden_size, cfg.head_dim, cfg.weight_dtype
    if cfg.fused_heads:
        return param(rngs, (d, heads * h), ("embed", axis), wd, fan_in=d, units=(1, h))
    return param(rngs, (d, heads, h), ("embed", axis, "head_dim"), wd, fan_in=d)


def _project_heads(x: Array, w: nnx.Param, head_dim: int, *, decoding: bool, parts: Parts) -> Array:
    """`x [B, T, D]` through a q/k/v projection (`_in_proj`), as `[B, T, heads, H]`. A fused
    weight is one matmul with a free split into lane-aligned heads when `decoding` (decode and
    prefill: the einsum there relayouts every layer's weight per program), else the einsum on
    its `[D, heads, H]` view (teacher forcing at long T: one matmul there cost the 7B learner
    step at 32K 0.91 GiB more temporaries per chip; docs/results.md)."""
    if w.ndim == 2 and decoding:
        return parts.dot("btd,dc->btc", x, w).reshape(x.shape[:-1] + (-1, head_dim))
    if w.ndim == 2:
        view = w[...].astype(x.dtype).reshape(w.shape[0], -1, head_dim)
        return jnp.einsum("btd,dnh->btnh", x, view)
    return parts.dot("btd,dnh->btnh", x, w)


def _value(w: nnx.Variable | Array) -> Array:
    return w[...] if isinstance(w, nnx.Variable) else w


def _einsum(spec: str, x: Array, w: nnx.Variable | Array) -> Array:
    return jnp.einsum(spec, x, _value(w).astype(x.dtype))


class Parts:
    """How `Transformer.decode` runs its embedding, layers, weight matmuls and head: on the
    weights as stored (this class), or from their fsdp parts (`rollout.shards.FsdpParts`).
    `shards`: how many shards' rows each of its matmuls takes (1: this one's)."""

    shards = 1

    def embed(self, model: Transformer, tokens_bt: Array) -> Array:
        return model.embed_tokens(tokens_bt)

    def layer(self, model: Transformer, i: int) -> Block:
        return model.layers[i]

    def logits(self, model: Transformer, h_btd: Array) -> Array:
        return model.logits(h_btd)

    def dot(self, spec: str, x: Array, w: nnx.Variable | Array) -> Array:  # in x's dtype
        return _einsum(spec, x, w)


AS_STORED = Parts()


class Attention(nnx.Module):
    """GQA self-attention with optional QKV bias (Qwen2) and per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        wd = cfg.weight_dtype
        self.cfg = cfg
        self.q_proj = _in_proj(rngs, cfg, n, "heads")
        self.k_proj = _in_proj(rngs, cfg, k, "kv_heads")
        self.v_proj = _in_proj(rngs, cfg, k, "kv_heads")
        self.o_proj = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), wd, fan_in=n * h)
        if cfg.qkv_bias:
            self.q_bias = param(None, (n, h), ("heads", "head_dim"), wd, init="zeros")
            self.k_bias = param(None, (k, h), ("kv_heads", "head_dim"), wd, init="zeros")
            self.v_bias = param(None, (k, h), ("kv_heads", "head_dim"), wd, init="zeros")
        if cfg.o_bias:
            self.o_bias_ = param(None, (d,), ("embed",), wd, init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, eps=cfg.rms_norm_eps, param_dtype=wd, axis_name="head_dim")
            self.k_norm = RMSNorm(h, eps=cfg.rms_norm_eps, param_dtype=wd, axis_name="head_dim")

    def project(
        self,
        x_btd: Float[Array, "B T D"],
        positions_bt: Int[Array, "B T"],
        *,
        decoding: bool,
        parts: Parts = AS_STORED,
    ) -> tuple[Float[Array, "B T N H"], Float[Array, "B T K H"], Float[Array, "B T K H"]]:
        """Queries (already scaled by 1/sqrt(H)), keys (after RoPE) and values; `decoding`
        picks the formulation of fused projections (`_project_heads`), not the result; `parts`
        runs the matmuls (`Parts.dot`)."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        x = x_btd.astype(dt)
        q, k, v = (
            _project_heads(x, w, cfg.head_dim, decoding=decoding, parts=parts)
            for w in (self.q_proj, self.k_proj, self.v_proj)
        )
        if cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dt)[None, None]
            k = k + self.k_bias[...].astype(dt)[None, None]
            v = v + self.v_bias[...].astype(dt)[None, None]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # A trace-time constant: XLA folds it, so it is not a parameter or a state variable.
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q = apply_rope(q, positions_bt, inv_freq)
        k = apply_rope(k, positions_bt, inv_freq)
        q = (q.astype(jnp.float32) * cfg.head_dim**-0.5).astype(dt)
        return constrain(q, ACT_BTNH), constrain(k, ACT_BTKH), constrain(v, ACT_BTKH)

    def output(
        self, o_btnh: Float[Array, "B T N H"], parts: Parts = AS_STORED
    ) -> Float[Array, "B T D"]:
        dt = self.cfg.compute_dtype
        o_btnh = constrain(o_btnh.astype(dt), ACT_BTNH)
        out = parts.dot("btnh,nhd->btd", o_btnh, self.o_proj)
        if self.cfg.o_bias:
            out = out + self.o_bias_[...].astype(dt)[None, None]
        return constrain(out, ACT_BTD)


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, over blocks of `cfg.mlp_chunk` tokens at long T."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, wd = cfg.hidden_size, cfg.intermediate_size, cfg.weight_dtype
        self.cfg = cfg
        self.gate_proj = param(rngs, (d, f), ("embed", "mlp"), wd, fan_in=d)
        self.up_proj = param(rngs, (d, f), ("embed", "mlp"), wd, fan_in=d)
        self.down_proj = param(rngs, (f, d), ("mlp", "embed"), wd, fan_in=f)
        if cfg.mlp_bias:
            self.gate_bias = param(None, (f,), ("mlp",), wd, init="zeros")
            self.up_bias = param(None, (f,), ("mlp",), wd, init="zeros")
            self.down_bias = param(None, (d,), ("embed",), wd, init="zeros")

    def __call__(
        self, x_btd: Float[Array, "B T D"], parts: Parts = AS_STORED
    ) -> Float[Array, "B T D"]:
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        if self.cfg.mlp_bias:
            weights += (self.gate_bias, self.up_bias, self.down_bias)
        chunk, dt = self.cfg.mlp_chunk, self.cfg.compute_dtype
        if parts is not AS_STORED:  # the engine's own matmuls (prefill groups bound T)
            return swiglu(x_btd, weights, dt, parts.dot)
        if not chunk or x_btd.shape[1] <= chunk:
            return swiglu(x_btd, weights, dt)
        return chunked_swiglu(x_btd, tuple(w[...] for w in weights), dt, chunk)


def swiglu(
    x_btd: Float[Array, "B T D"], weights: tuple, dtype, dot=_einsum
) -> Float[Array, "B T D"]:
    """`down(silu(x @ gate) * (x @ up))` in `dtype`; `weights` = (gate, up, down[, biases]),
    arrays or parameters; `dot(spec, x, w)` runs each matmul (`Parts.dot`)."""
    gate_w, up_w, down_w, *biases = weights
    biases = [_value(b).astype(dtype) for b in biases]
    x = x_btd.astype(dtype)
    gate = dot("btd,df->btf", x, gate_w)
    up = dot("btd,df->btf", x, up_w)
    if biases:
        gate, up = gate + biases[0][None, None], up + biases[1][None, None]
    act = constrain(jax.nn.silu(constrain(gate, ACT_BTF)) * constrain(up, ACT_BTF), ACT_BTF)
    out = dot("btf,fd->btd", act, down_w)
    if biases:
        out = out + biases[2][None, None]
    return constrain(out, ACT_BTD)


def chunked_swiglu(
    x_btd: Float[Array, "B T D"], weights: tuple, dtype, chunk: int
) -> Float[Array, "B T D"]:
    """`swiglu` over blocks of `chunk` tokens (T padded up to a multiple), one block at a time.

    Each block is rematerialised in the backward pass, so the `[B, T, F]` gate/up/activation
    arrays (F = 18944 for Qwen2.5-7B: 1.2 GB per array at T = 32768 in bf16) exist only one
    `[B, chunk, F]` block at a time, forward and backward. The weights enter the loop in their
    stored dtype and are cast inside it, so their gradients accumulate over blocks in that dtype
    (fp32 masters), not in the compute dtype. Under block remat (`cfg.remat`) the blocks'
    recompute is the one remat already pays; without it the MLP forward runs twice.
    """
    t = x_btd.shape[1]
    n = -(-t // chunk)
    x = jnp.pad(x_btd, ((0, 0), (0, n * chunk - t), (0, 0)))
    ys = jax.lax.map(
        jax.checkpoint(lambda x_bcd: swiglu(x_bcd, weights, dtype)), blocks(x, n, chunk)
    )
    return unblocks(ys)[:, :t]


class Block(nnx.Module):
    """Pre-norm decoder block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        wd = cfg.weight_dtype
        self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=wd)
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=wd)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(
        self,
        x_btd: Float[Array, "B T D"],
        positions_bt: Int[Array, "B T"],
        segment_ids_bt: Int[Array, "B T"] | None,
        evict_pos_bkt: Int[Array, "B K T"] | None = None,
    ) -> Float[Array, "B T D"]:
        """Teacher forcing: causal attention within segments (`models.attention`), replaying a
        sparse sampler's evictions when given."""
        cfg = self.attn.cfg
        q, k, v = self.attn.project(self.input_norm(x_btd), positions_bt, decoding=False)
        o = causal_attention(
            q,
            k,
            v,
            segment_ids_bt,
            impl=cfg.attention,
            block_q=cfg.attention_block,
            block_kv=cfg.attention_block,
            evict_pos_bkt=evict_pos_bkt,
        )
        x_btd = constrain(x_btd + self.attn.output(o).astype(x_btd.dtype), ACT_BTD)
        return constrain(x_btd + self.mlp(self.post_attn_norm(x_btd)).astype(x_btd.dtype), ACT_BTD)


def segment_positions(segment_ids_bt: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Positions restarting at 0 at every segment boundary (for packed sequences)."""
    t = segment_ids_bt.shape[1]
    idx_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids_bt.shape)
    starts_bt = jnp.concatenate(
        [
            jnp.ones_like(segment_ids_bt[:, :1], dtype=bool),
            segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1],
        ],
        axis=1,
    )
    start_idx_bt = jax.lax.cummax(jnp.where(starts_bt, idx_bt, 0), axis=1)
    return idx_bt - start_idx_bt


def check_token_ids(tokens, vocab_size: int, what: str = "tokens") -> None:
    """Raise ValueError naming the first id of `tokens` outside `[0, vocab_size)`, its position
    and the vocabulary size (an out-of-range id would silently embed as NaN or zeros), or the
    dtype of ids that are not integers (floats would be truncated to ids without a word).

    `tokens`: any integer array (numpy, a sequence, a `jax.Array`). A traced value (inside
    `jit`, `vmap`, `grad`) has its dtype checked, not its values: they are unknown there and a
    check would cost every step; the public entries (`Transformer.__call__`/`decode` called
    eagerly, `RolloutEngine.generate`, `dense_logprobs`, `Learner.logprobs`/`step`) check their
    inputs before they trace.
    """
    dtype = getattr(tokens, "dtype", None)
    if dtype is None and np.size(tokens):  # a sequence; an empty one has no ids to check
        dtype = np.asarray(tokens).dtype
    if dtype is not None and not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{what}: token ids are {np.dtype(dtype)}, not integers")
    if isinstance(tokens, jax.core.Tracer):
        return
    if isinstance(tokens, jax.Array) and not tokens.is_fully_addressable:
        lo, hi = (int(v) for v in jax.device_get((jnp.min(tokens), jnp.max(tokens))))
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"{what}: token id {lo if lo < 0 else hi} is outside the vocabulary "
                f"[0, {vocab_size})"
            )
        return
    ids = np.asarray(tokens)
    if ids.size == 0 or (ids.min() >= 0 and ids.max() < vocab_size):
        return
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    pos = tuple(int(i) for i in bad[0])
    raise ValueError(
        f"{what}: token id {int(ids[pos])} at position {pos[0] if len(pos) == 1 else pos} is "
        f"outside the vocabulary [0, {vocab_size}) ({len(bad)} such ids)"
    )


class Embedding(nnx.Module):
    """Token embedding table `[V, D]`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        shape = (cfg.vocab_size, cfg.hidden_size)
        # Untied: unit-variance rows. Tied, the table is also the output projection: scale by
        # 1/sqrt(D) so initial logits are O(1) (unit rows would start the loss near sqrt(D)).
        fan_in = cfg.hidden_size if cfg.tie_embeddings else 1
        self.embedding = param(rngs, shape, ("vocab", "embed"), cfg.weight_dtype, fan_in=fan_in)


class LMHead(nnx.Module):
    """Untied output projection `[D, V]`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        shape = (cfg.hidden_size, cfg.vocab_size)
        self.kernel = param(rngs, shape, ("embed", "vocab"), cfg.weight_dtype)


def head_logits(
    h_btd: Float[Array, "B T D"], w: jax.Array, *, tied: bool, dtype: jnp.dtype
) -> Float[Array, "B T V"]:
    """The LM head on hidden states: `h @ w^T` for a tied `w` (the embedding table `[V, D]`),
    `h @ w` for an untied kernel `[D, V]`; operands in the compute `dtype`, accumulated and
    returned in fp32. The one head projection: `Transformer.logits` and the chunked head of
    `rollout.logprobs` both call it."""
    h_btd = constrain(h_btd.astype(dtype), ACT_BTD)
    spec = "btd,vd->btv" if tied else "btd,dv->btv"
    logits = jnp.einsum(spec, h_btd, w.astype(dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ACT_BTV)


class Transformer(nnx.Module):
    """The decoder. `model(tokens)` returns fp32 logits `[B, T, V]`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        wd = cfg.weight_dtype
        self.embed = Embedding(cfg, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=wd)
        if not cfg.tie_embeddings:
            self.lm_head = LMHead(cfg, rngs=rngs)

    def embed_tokens(self, tokens_bt: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """Embedding rows of `tokens_bt`; concrete ids are checked first (`check_token_ids`)."""
        check_token_ids(tokens_bt, self.cfg.vocab_size)
        x = jnp.take(self.embed.embedding[...], tokens_bt, axis=0).astype(self.cfg.compute_dtype)
        return constrain(x, ACT_BTD)

    def head_weight(self) -> jax.Array:
        """The output projection's parameter as stored: tied, the embedding table `[V, D]`;
        untied, the LM head kernel `[D, V]` (see `head_logits`)."""
        if self.cfg.tie_embeddings:
            return self.embed.embedding[...]
        return self.lm_head.kernel[...]

    def logits(self, h_btd: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """The LM head (tied: `h @ E^T`), accumulated and returned in fp32."""
        return head_logits(
            h_btd, self.head_weight(), tied=self.cfg.tie_embeddings, dtype=self.cfg.compute_dtype
        )

    def hidden_states(
        self,
        tokens_bt: Int[Array, "B T"],
        positions_bt: Int[Array, "B T"] | None = None,
        segment_ids_bt: Int[Array, "B T"] | None = None,
        evict_pos_bykt: Int[Array, "B Y K T"] | None = None,
    ) -> Float[Array, "B T D"]:
        """Final-normed hidden states of a teacher-forced forward pass. The attention is
        `cfg.attention`'s (`models.attention.causal_attention`): only "dense" builds `[T, T]`.
        `evict_pos_bykt`: a sparse sampler's eviction record (`RolloutResult.evictions`; Y and
        K are the layers and KV heads, or 1 where its choice was shared): each layer attends
        only to what the sampler's cache held (`kvcache.evictions`)."""
        b, t = tokens_bt.shape
        if positions_bt is None:
            if segment_ids_bt is None:
                positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            else:
                positions_bt = segment_positions(segment_ids_bt)
        x = self.embed_tokens(tokens_bt)
        for y, layer in enumerate(self.layers):
            ev = None
            if evict_pos_bykt is not None:
                ev = evict_pos_bykt[:, y if evict_pos_bykt.shape[1] > 1 else 0]
            if self.cfg.remat:
                x = nnx.remat(lambda blk, x_, p_, s_, e_: blk(x_, p_, s_, e_))(
                    layer, x, positions_bt, segment_ids_bt, ev
                )
            else:
                x = layer(x, positions_bt, segment_ids_bt, ev)
        return self.final_norm(x)

    def __call__(
        self,
        tokens_bt: Int[Array, "B T"],
        positions: Int[Array, "B T"] | None = None,
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> Float[Array, "B T V"]:
        """Teacher-forced logits. `segment_ids` packs several sequences in a row: a token attends
        only to earlier tokens of its own segment, and positions restart per segment unless given.
        Ids outside the vocabulary are a ValueError when `tokens_bt` is concrete (called outside
        `jit`); traced, they are not checked (see `check_token_ids`).
        """
        return self.logits(self.hidden_states(tokens_bt, positions, segment_ids))

    def decode(
        self,
        tokens_bt: Int[Array, "B T"],
        cache: DecodeCache,
        token_mask_bt: Bool[Array, "B T"] | None = None,
        logits_at_bk: Int[Array, "B K"] | None = None,
        *,
        parts: Parts = AS_STORED,
    ) -> tuple[Float[Array, "B K V"], DecodeCache]:
        """Run T new tokens per row through the cache (prefill when T > 1, a decode step when 1).

        `token_mask_bt` marks real tokens (left-aligned); padding is neither stored nor attended.
        Returns fp32 logits and the updated cache: for every new token (`[B, T, V]`) when
        `logits_at_bk` is None, else only at those indices into the T new tokens of each row
        (`[B, K, V]`; a prefill needs only each prompt's last token, not `[B, T, V]`).
        `parts` runs the embedding, each layer and the head (`Parts`: on the weights as stored).
        """
        if token_mask_bt is None:
            token_mask_bt = jnp.ones(tokens_bt.shape, dtype=bool)
        cache, positions_bt = cache.begin_step(token_mask_bt)
        x = parts.embed(self, tokens_bt)
        for i in range(len(self.layers)):
            layer = parts.layer(self, i)
            h = layer.input_norm(x)
            q, k, v = layer.attn.project(h, positions_bt, decoding=True, parts=parts)
            o, cache = cache.attend(i, q, k, v)
            x = x + layer.attn.output(o, parts).astype(x.dtype)
            x = x + layer.mlp(layer.post_attn_norm(x), parts).astype(x.dtype)
        cache = cache.end_step()
        if logits_at_bk is not None:
            # The final norm and the head are per position: gather first, project K positions.
            x = jnp.take_along_axis(x, logits_at_bk[:, :, None], axis=1)
        return parts.logits(self, self.final_norm(x)), cache
