"""Token sampling and the sampler-logprob contract (ARCHITECTURE.md §3).

The logprob recorded for a sampled token is `log softmax(logits / T)` at that token, *without*
top-k / top-p truncation, so the learner can recompute it exactly by teacher forcing with the same
T. Greedy decoding (T = 0) records `log softmax(logits)` (T = 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def token_logprobs(
    logits_btv: Float[Array, "B T V"], tokens_bt: Int[Array, "B T"], temperature: float = 1.0
) -> Float[Array, "B T"]:
    """`log softmax(logits / T)[token]`, in fp32 (T = 0 is treated as 1)."""
    t = temperature if temperature > 0 else 1.0
    logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / t, axis=-1)
    return jnp.take_along_axis(logp_btv, tokens_bt[..., None], axis=-1)[..., 0]


def sample(
    logits_bv: Float[Array, "B V"],
    key: jax.Array,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[Int[Array, " B"], Float[Array, " B"]]:
    """Sample one token per row; returns `(tokens, logprobs)` with the contract above.

    `temperature == 0` is greedy. `top_k == 0` and `top_p == 1` disable truncation.
    """
    logits = logits_bv.astype(jnp.float32)
    if temperature == 0:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        scaled = logits / temperature
        masked = scaled
        if top_k > 0:
            kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
            masked = jnp.where(scaled < kth, -jnp.inf, masked)
        if top_p < 1.0:
            sorted_desc = -jnp.sort(-masked, axis=-1)
            probs = jax.nn.softmax(sorted_desc, axis=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            before = jnp.cumsum(probs, axis=-1) - probs
            cutoff_idx = jnp.sum(before < top_p, axis=-1, keepdims=True) - 1
            cutoff = jnp.take_along_axis(sorted_desc, cutoff_idx, axis=-1)
            masked = jnp.where(masked < cutoff, -jnp.inf, masked)
        tokens = jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)
    logprobs = token_logprobs(logits[:, None, :], tokens[:, None], temperature)[:, 0]
    return tokens, logprobs
