"""Dense old-policy logprobs: the one teacher-forced recompute (π_old).

The learner's π_old is the sampler's weights with full attention: `log softmax(logits / T)` of
every given token under the teacher-forced forward pass, the same contract the sampler records
(`sampling.token_logprobs`), so with no compression and the same T they agree to float tolerance.

`teacher_forced_logprobs` is the pure computation; `Learner.logprobs` jits it with the learner's
micro-batching (pi_old, pi_ref) and `dense_logprobs` is the stand-alone jitted entry point.

`head_logprobs` is the one place where logprobs (and entropies) meet the LM head, for pi_old,
pi_ref and the learner's loss alike: it never holds `[B, T, V]` logits, only `[B, C, V]` for a
chunk of C positions at a time, recomputed in the backward pass.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from sparserl_jax.kvcache.evictions import checked_record
from sparserl_jax.models.config import ModelConfig
from sparserl_jax.models.transformer import check_token_ids, head_logits
from sparserl_jax.rollout.sampling import entropy_from_logits, token_logprobs

# Positions per chunk of the LM head (`head_logprobs`): [B, 512, V] fp32 logits at a time, e.g.
# 311 MB per row at Qwen's V = 151936, against 2.5 GB for the whole of a 4096-token row.
LOGITS_CHUNK_SIZE = 512


def split_micro_batches(x: jax.Array, m: int) -> jax.Array:
    """`[B, ...] -> [M, B/M, ...]` with micro-batch j = rows j, j + M, ...: a shard holding a
    contiguous block of rows keeps an equal share of every micro-batch, so no data moves."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def join_micro_batches(x: jax.Array) -> jax.Array:
    """The inverse of `split_micro_batches`: `[M, B/M, ...] -> [B, ...]`."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def head_logprobs(
    cfg: ModelConfig,
    head_w: jax.Array,
    h_btd: Float[Array, "B T D"],
    tokens_bt: Int[Array, "B T"],
    *,
    temperature: float,
    chunk_size: int = LOGITS_CHUNK_SIZE,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"] | None]:
    """Teacher-forced token logprobs (and entropies) from final hidden states, chunk by chunk.

    `head_w` is the head's parameter as `Transformer.head_weight` returns it (tied or not, per
    `cfg.tie_embeddings`; `cfg.compute_dtype` is the matmul dtype). Entry t is about token t
    given tokens `< t`, column 0 is 0: `log softmax(h[t-1] @ W / T)[tokens[t]]`, i.e.
    `shifted_token_logprobs(model.logits(h), tokens)`, and with `entropy` the entropy of that
    distribution (`entropy_from_logits`), else None. `entropy_grad=False` stops its gradient,
    so an entropy kept only as a metric costs no backward pass through the head.

    The T - 1 predicting positions go through the head `chunk_size` at a time (`lax.map`, the
    last chunk padded with zeros and its padding dropped): the LM head projection is inside the
    chunk, under `jax.checkpoint`, so neither pass ever holds more than `[B, chunk, V]` logits
    (the backward recomputes each chunk's logits). Values equal the unchunked computation to
    float rounding (the matmul is per position). The head gradient sums the chunks' in fp32.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, d = h_btd.shape
    n = t - 1
    if n == 0:
        zeros_bt = jnp.zeros((b, t), jnp.float32)
        return zeros_bt, (zeros_bt if entropy else None)
    c = min(chunk_size, n)
    k = -(-n // c)
    pad = k * c - n
    h_kbcd = jnp.pad(h_btd[:, :-1], ((0, 0), (0, pad), (0, 0))).reshape(b, k, c, d)
    tok_kbc = jnp.pad(tokens_bt[:, 1:], ((0, 0), (0, pad))).reshape(b, k, c)
    h_kbcd, tok_kbc = jnp.swapaxes(h_kbcd, 0, 1), jnp.swapaxes(tok_kbc, 0, 1)

    @jax.checkpoint
    def chunk(w, h_bcd, tok_bc):
        logits_bcv = head_logits(h_bcd, w, tied=cfg.tie_embeddings, dtype=cfg.compute_dtype)
        logp_bc = token_logprobs(logits_bcv, tok_bc, temperature)
        if not entropy:
            return logp_bc, None
        z_bcv = logits_bcv if entropy_grad else jax.lax.stop_gradient(logits_bcv)
        return logp_bc, entropy_from_logits(z_bcv, temperature=temperature)

    if k == 1:
        # No loop for a single chunk (a length-1 loop costs compile time, nothing else).
        out = jax.tree.map(lambda x: x[None], chunk(head_w, h_kbcd[0], tok_kbc[0]))
    else:
        out = jax.lax.map(lambda x: chunk(head_w, *x), (h_kbcd, tok_kbc))

    def unchunk(x_kbc):
        x_bt = jnp.swapaxes(x_kbc, 0, 1).reshape(b, k * c)[:, :n]
        return jnp.pad(x_bt, ((0, 0), (1, 0)))

    logp_kbc, ent_kbc = out
    return unchunk(logp_kbc), (None if ent_kbc is None else unchunk(ent_kbc))


def teacher_forced_logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    tokens_bt: Int[Array, "B T"],
    positions_bt: Int[Array, "B T"] | None = None,
    *,
    temperature: float,
    num_micro_batches: int = 1,
    chunk_size: int = LOGITS_CHUNK_SIZE,
    evict_pos_bykt: Int[Array, "B Y K T"] | None = None,
) -> Float[Array, "B T"]:
    """Teacher-forced `log softmax(logits / T)[token]` of every token, aligned with `tokens_bt`.

    Pure (jit it). `evict_pos_bykt`: the sampler's eviction record, replayed in the attention
    (`Transformer.hidden_states`): the logprobs of the sparse policy the sampler ran. Entry t
    is the logprob of token t given tokens `< t`; column 0 is 0.
    `positions_bt=None` lets the model number each row `0..T-1`. With `num_micro_batches` M > 1
    (a divisor of B) the rows are split as in `split_micro_batches` and the M forward passes run
    one after the other (`lax.map`). The head runs `chunk_size` positions at a time
    (`head_logprobs`), so at most `[B/M, chunk_size, V]` logits are held at once.
    """
    model = nnx.merge(graphdef, params)

    def rows(tok_bt, pos_bt, ev_bykt):
        h_btd = model.hidden_states(tok_bt, pos_bt, evict_pos_bykt=ev_bykt)
        logp_bt, _ = head_logprobs(
            model.cfg,
            model.head_weight(),
            h_btd,
            tok_bt,
            temperature=temperature,
            chunk_size=chunk_size,
        )
        return logp_bt

    if num_micro_batches == 1:
        return rows(tokens_bt, positions_bt, evict_pos_bykt)
    micro = jax.tree.map(
        lambda x: split_micro_batches(x, num_micro_batches),
        (tokens_bt, positions_bt, evict_pos_bykt),
    )
    return join_micro_batches(jax.lax.map(lambda x: rows(*x), micro))


_jitted = jax.jit(
    teacher_forced_logprobs,
    static_argnames=("graphdef", "temperature", "num_micro_batches", "chunk_size"),
)


def dense_logprobs(
    model: nnx.Module | nnx.GraphDef,
    params: Any,
    tokens_bt: Int[Array, "B T"],
    *,
    temperature: float = 1.0,
    positions_bt: Int[Array, "B T"] | None = None,
    micro_batch_size: int | None = None,
    logits_chunk_size: int = LOGITS_CHUNK_SIZE,
    evict_pos_bykt: Any = None,
) -> Float[Array, "B T"]:
    """Teacher-forced `log softmax(logits / T)[token]` of every token, aligned with `tokens_bt`.

    `tokens_bt` rows are left-aligned sequences (prompt ++ completion ++ padding, e.g.
    `RolloutResult.sequences()`); entry t is the logprob of token t given tokens `< t` (column 0,
    which has no prefix, is 0; entries on padding are meaningless: mask them). `model` is an NNX
    model or its graphdef; `params` an `nnx` pure dict of its state (None: the model's own, only
    when a model is given). `temperature` 0 means 1 (greedy sampling records T = 1 logprobs).
    `positions_bt` defaults to `0..T-1`. `micro_batch_size` bounds the `[b, T, V]` logits held at
    once (`teacher_forced_logprobs` over `ceil(B / micro_batch_size)` micro-batches, the rows
    padded to a multiple of it); `logits_chunk_size` the positions of the LM head per chunk
    (`head_logprobs`). `evict_pos_bykt` (`RolloutResult.evictions(T)`): the logprobs of the
    sparse policy the sampler ran, its evictions replayed in the attention (the engine's sparse
    contract). Jitted: same shapes and dtypes never recompile. An id outside the
    vocabulary is a ValueError (`models.check_token_ids`).
    """
    if isinstance(model, nnx.GraphDef):
        graphdef = model
        if params is None:
            raise ValueError("dense_logprobs needs params when given a graphdef")
    else:
        graphdef, state = nnx.split(model)
        if params is None:
            params = nnx.to_pure_dict(state)
    check_token_ids(tokens_bt, params["embed"]["embedding"].shape[0], "dense_logprobs tokens_bt")
    tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
    b = tokens_bt.shape[0]
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(
            jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape
        )
    positions_bt = jnp.asarray(positions_bt, jnp.int32)
    if logits_chunk_size < 1:
        raise ValueError(f"logits_chunk_size must be >= 1, got {logits_chunk_size}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be None or >= 1, got {micro_batch_size}")
    m = 1 if micro_batch_size is None else -(-b // micro_batch_size)
    pad = m * -(-b // m) - b
    if evict_pos_bykt is not None:
        evict_pos_bykt = checked_record(evict_pos_bykt, tokens_bt.shape)
    if pad:
        # Padding rows (token 0 at position 0) only fill the last micro-batches; dropped below.
        tokens_bt = jnp.pad(tokens_bt, ((0, pad), (0, 0)))
        positions_bt = jnp.pad(positions_bt, ((0, pad), (0, 0)))
        if evict_pos_bykt is not None:
            evict_pos_bykt = jnp.pad(evict_pos_bykt, ((0, pad), (0, 0), (0, 0), (0, 0)))
    t = float(temperature) if temperature > 0 else 1.0
    logp_bt = _jitted(
        graphdef,
        params,
        tokens_bt,
        positions_bt,
        temperature=t,
        num_micro_batches=m,
        chunk_size=logits_chunk_size,
        evict_pos_bykt=evict_pos_bykt,
    )
    return logp_bt[:b] if pad else logp_bt
