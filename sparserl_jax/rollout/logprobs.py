"""Dense old-policy logprobs: the one teacher-forced recompute (π_old).

The learner's π_old is the sampler's weights with full attention: `log softmax(logits / T)` of
every given token under the teacher-forced forward pass, the same contract the sampler records
(`sampling.token_logprobs`), so with no compression and the same T they agree to float tolerance.

`teacher_forced_logprobs` is the pure computation; `Learner.logprobs` jits it with the learner's
micro-batching (pi_old, pi_ref) and `dense_logprobs` is the stand-alone jitted entry point.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from sparserl_jax.models.transformer import check_token_ids
from sparserl_jax.rollout.sampling import shifted_token_logprobs


def split_micro_batches(x: jax.Array, m: int) -> jax.Array:
    """`[B, ...] -> [M, B/M, ...]` with micro-batch j = rows j, j + M, ...: a shard holding a
    contiguous block of rows keeps an equal share of every micro-batch, so no data moves."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def join_micro_batches(x: jax.Array) -> jax.Array:
    """The inverse of `split_micro_batches`: `[M, B/M, ...] -> [B, ...]`."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def teacher_forced_logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    tokens_bt: Int[Array, "B T"],
    positions_bt: Int[Array, "B T"] | None = None,
    *,
    temperature: float,
    num_micro_batches: int = 1,
) -> Float[Array, "B T"]:
    """Teacher-forced `log softmax(logits / T)[token]` of every token, aligned with `tokens_bt`.

    Pure (jit it). Entry t is the logprob of token t given tokens `< t`; column 0 is 0.
    `positions_bt=None` lets the model number each row `0..T-1`. With `num_micro_batches` M > 1
    (a divisor of B) the rows are split as in `split_micro_batches` and the M forward passes run
    one after the other (`lax.map`), so only `[B/M, T, V]` logits are held at once.
    """
    model = nnx.merge(graphdef, params)

    def rows(tok_bt, pos_bt):
        logits_btv = model(tok_bt, positions=pos_bt)
        return shifted_token_logprobs(logits_btv, tok_bt, temperature=temperature)

    if num_micro_batches == 1:
        return rows(tokens_bt, positions_bt)
    micro = jax.tree.map(
        lambda x: split_micro_batches(x, num_micro_batches), (tokens_bt, positions_bt)
    )
    return join_micro_batches(jax.lax.map(lambda x: rows(*x), micro))


_jitted = jax.jit(
    teacher_forced_logprobs, static_argnames=("graphdef", "temperature", "num_micro_batches")
)


def dense_logprobs(
    model: nnx.Module | nnx.GraphDef,
    params: Any,
    tokens_bt: Int[Array, "B T"],
    *,
    temperature: float = 1.0,
    positions_bt: Int[Array, "B T"] | None = None,
    micro_batch_size: int | None = None,
) -> Float[Array, "B T"]:
    """Teacher-forced `log softmax(logits / T)[token]` of every token, aligned with `tokens_bt`.

    `tokens_bt` rows are left-aligned sequences (prompt ++ completion ++ padding, e.g.
    `RolloutResult.sequences()`); entry t is the logprob of token t given tokens `< t` (column 0,
    which has no prefix, is 0; entries on padding are meaningless: mask them). `model` is an NNX
    model or its graphdef; `params` an `nnx` pure dict of its state (None: the model's own, only
    when a model is given). `temperature` 0 means 1 (greedy sampling records T = 1 logprobs).
    `positions_bt` defaults to `0..T-1`. `micro_batch_size` bounds the `[b, T, V]` logits held at
    once (`teacher_forced_logprobs` over `ceil(B / micro_batch_size)` micro-batches, the rows
    padded to a multiple of it). Jitted: same shapes and dtypes never recompile. An id outside
    the vocabulary is a ValueError (`models.check_token_ids`).
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
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be None or >= 1, got {micro_batch_size}")
    m = 1 if micro_batch_size is None else -(-b // micro_batch_size)
    pad = m * -(-b // m) - b
    if pad:
        # Padding rows (token 0 at position 0) only fill the last micro-batches; dropped below.
        tokens_bt = jnp.pad(tokens_bt, ((0, pad), (0, 0)))
        positions_bt = jnp.pad(positions_bt, ((0, pad), (0, 0)))
    t = float(temperature) if temperature > 0 else 1.0
    logp_bt = _jitted(graphdef, params, tokens_bt, positions_bt, temperature=t, num_micro_batches=m)
    return logp_bt[:b] if pad else logp_bt
