"""Dense old-policy logprobs: jitted, batched teacher-forced recompute (π_old, ARCHITECTURE §3).

The learner's π_old is the sampler's weights with full attention: `log softmax(logits / T)` of
every given token under the teacher-forced forward pass, the same contract the sampler records
(`sampling.token_logprobs`), so with no compression and the same T they agree to float tolerance.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from sparserl_jax.rollout.sampling import shifted_token_logprobs


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "micro_batch_size"))
def _dense_logprobs(graphdef, params, tokens_bt, positions_bt, *, temperature, micro_batch_size):
    model = nnx.merge(graphdef, params)

    def rows(x):
        tok_bt, pos_bt = x
        logits_btv = model(tok_bt, positions=pos_bt)
        return shifted_token_logprobs(logits_btv, tok_bt, temperature=temperature)

    if micro_batch_size is None:
        logp_bt = rows((tokens_bt, positions_bt))
    else:
        # One row at a time inside each micro-batch keeps the [b, T, V] logits bounded.
        logp_bt = jax.lax.map(
            lambda x: rows((x[0][None], x[1][None]))[0],
            (tokens_bt, positions_bt),
            batch_size=micro_batch_size,
        )
    return logp_bt


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
    once (`lax.map` over the rows). Jitted: same shapes and dtypes never recompile.
    """
    if isinstance(model, nnx.GraphDef):
        graphdef = model
        if params is None:
            raise ValueError("dense_logprobs needs params when given a graphdef")
    else:
        graphdef, state = nnx.split(model)
        if params is None:
            params = nnx.to_pure_dict(state)
    tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(
            jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape
        )
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be None or >= 1, got {micro_batch_size}")
    t = float(temperature) if temperature > 0 else 1.0
    return _dense_logprobs(
        graphdef,
        params,
        tokens_bt,
        jnp.asarray(positions_bt, jnp.int32),
        temperature=t,
        micro_batch_size=micro_batch_size,
    )
