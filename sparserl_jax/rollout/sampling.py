"""Token sampling, per-request keys, and the sampler-logprob contract.

The logprob recorded for a sampled token is `log softmax(logits / T)` at that token, *without*
top-k / top-p truncation, so the learner can recompute it exactly by teacher forcing with the same
T. Greedy decoding (T = 0) records `log softmax(logits)` (T = 1).

Reproducibility: sample j of prompt i draws its t-th completion token with the key
`fold_in(k_ij, t)`, `k_ij = fold_in(fold_in(key(seed), i), j)` (or `fold_in(key(seeds[i]), j)`
for explicit per-prompt seeds), so its tokens do not depend on the slot, the batch or the chunk
it lands in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt32


def token_logprobs(
    logits_btv: Float[Array, "B T V"], tokens_bt: Int[Array, "B T"], temperature: float = 1.0
) -> Float[Array, "B T"]:
    """`log softmax(logits / T)[token]`, in fp32 (T = 0 is treated as 1)."""
    t = temperature if temperature > 0 else 1.0
    logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / t, axis=-1)
    return jnp.take_along_axis(logp_btv, tokens_bt[..., None], axis=-1)[..., 0]


def entropy_from_logits(
    logits_btv: Float[Array, "B T V"], *, temperature: float = 1.0
) -> Float[Array, "B T"]:
    """Entropy `H = -sum_v p_v log p_v` of `softmax(logits / T)`, computed as
    `logsumexp(z) - sum_v p_v z_v` (stable for large logits)."""
    z_btv = logits_btv.astype(jnp.float32) / temperature
    p_btv = jax.nn.softmax(z_btv, axis=-1)
    return jax.nn.logsumexp(z_btv, axis=-1) - jnp.sum(p_btv * z_btv, axis=-1)


def shifted_token_logprobs(
    logits_btv: Float[Array, "B T V"], tokens_bt: Int[Array, "B T"], *, temperature: float = 1.0
) -> Float[Array, "B T"]:
    """Teacher-forced logprob of every token given its prefix, aligned with `tokens_bt`.

    `logits_btv[:, t]` predicts `tokens_bt[:, t + 1]`; column 0 (no prefix) is 0. The learner's
    pi_old and pi_theta and `dense_logprobs` all use this, the sampler's contract shifted.
    """
    logp_bt = token_logprobs(logits_btv[:, :-1], tokens_bt[:, 1:], temperature)
    return jnp.pad(logp_bt, ((0, 0), (1, 0)))


def request_keys(
    seed_r: UInt32[Array, " R"],
    prompt_r: Int[Array, " R"],
    sample_r: Int[Array, " R"],
    per_prompt_seed_r: Bool[Array, " R"],
) -> UInt32[Array, "R 2"]:
    """Raw (uint32) keys of requests (sample `sample_r` of prompt `prompt_r`); jittable.

    `fold_in(fold_in(key(seed), i), j)` for the run seed, or `fold_in(key(seeds[i]), j)` where
    `per_prompt_seed_r` says `seed_r` is the prompt's own seed: a request's key depends only on
    these numbers, never on the slot or the batch it runs in.
    """
    root = jax.vmap(jax.random.key)(seed_r)
    by_prompt = jax.vmap(jax.random.fold_in)(root, prompt_r)
    base = jnp.where(
        per_prompt_seed_r[:, None], jax.random.key_data(root), jax.random.key_data(by_prompt)
    )
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(base), sample_r)
    return jax.random.key_data(keys)


def step_keys(keys_b2: UInt32[Array, "B 2"], index_b: Int[Array, " B"]) -> jax.Array:
    """The key of completion token `index_b[b]` of each row's request (typed keys `[B]`)."""
    keys = jax.random.wrap_key_data(keys_b2)
    return jax.vmap(jax.random.fold_in)(keys, index_b)


def sample(
    logits_bv: Float[Array, "B V"],
    key: jax.Array,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[Int[Array, " B"], Float[Array, " B"]]:
    """Sample one token per row; returns `(tokens, logprobs)` with the contract above.

    `key` is one key for the batch, or a typed key array `[B]` (one per row, see `step_keys`),
    in which case row b's token depends only on its logits and its key. `temperature == 0` is
    greedy. `top_k == 0` and `top_p == 1` disable truncation.
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
        if key.ndim == 0:
            tokens = jax.random.categorical(key, masked, axis=-1)
        else:
            tokens = jax.vmap(jax.random.categorical)(key, masked)
        tokens = tokens.astype(jnp.int32)
    logprobs = token_logprobs(logits[:, None, :], tokens[:, None], temperature)[:, 0]
    return tokens, logprobs
