"""Static-batch generation on the dense cache: the simple reference sampler, a test oracle.

The product's sampler is `sparserl_jax.rollout.RolloutEngine`; this one is small enough to read
in one sitting and is what the engine is checked against.

One jitted program: prefill of left-aligned, padded prompts, then a `lax.scan` of decode steps.
Rows stop at a stop token or at `max_new_tokens`; finished rows emit padding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparserl_jax.models.cache import DenseKVCache
from sparserl_jax.models.transformer import Transformer, check_token_ids
from sparserl_jax.rollout.sampling import sample


@dataclasses.dataclass(frozen=True)
class Generation:
    """Per row: completion ids `[B, max_new]` (pad after the end), their sampler logprobs, the
    completion mask and lengths (stop token included)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-aligned `[B, P]` prompt ids (int32, or the prompts' own dtype when that is wider,
    so float ids are not truncated before they are checked) and their lengths."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    dtype = np.result_type(np.int32, *(np.asarray(p).dtype for p in prompts))
    out = np.full((len(prompts), width), pad_id, dtype)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, np.array([len(p) for p in prompts], np.int32)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p")
)
def _generate(
    graphdef,
    state,
    prompts_bp,
    lengths_b,
    key,
    stop_ids,
    *,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    pad_id,
):
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    b, p = prompts_bp.shape
    cache = DenseKVCache.create(
        num_layers=cfg.num_layers,
        batch=b,
        max_len=p + max_new_tokens,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=cfg.compute_dtype,
    )
    mask_bp = jnp.arange(p)[None, :] < lengths_b[:, None]
    logits_bpv, cache = model.decode(prompts_bp, cache, mask_bp)
    last_bv = jnp.take_along_axis(logits_bpv, (lengths_b - 1)[:, None, None], axis=1)[:, 0]

    def step(carry, step_key):
        cache, logits_bv, done_b = carry
        tok_b, logp_b = sample(
            logits_bv, step_key, temperature=temperature, top_k=top_k, top_p=top_p
        )
        tok_b = jnp.where(done_b, pad_id, tok_b)
        emitted_b = ~done_b
        done_b = done_b | jnp.isin(tok_b, stop_ids)
        logits_b1v, cache = model.decode(tok_b[:, None], cache, emitted_b[:, None])
        return (cache, logits_b1v[:, 0], done_b), (
            tok_b,
            jnp.where(emitted_b, logp_b, 0.0),
            emitted_b,
        )

    keys = jax.random.split(key, max_new_tokens)
    init = (cache, last_bv, jnp.zeros((b,), bool))
    _, (tok_tb, logp_tb, mask_tb) = jax.lax.scan(step, init, keys)
    return tok_tb.T, logp_tb.T, mask_tb.T


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Generation:
    """Generate completions for token-id prompts (greedy when `temperature == 0`)."""
    prompts_bp, lengths_b = pad_prompts(prompts, pad_id)
    check_token_ids(prompts_bp, model.cfg.vocab_size, "prompts")
    prompts_bp = prompts_bp.astype(np.int32)
    graphdef, state = nnx.split(model)
    stop = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
    tok, logp, mask = _generate(
        graphdef,
        state,
        jnp.asarray(prompts_bp),
        jnp.asarray(lengths_b),
        jax.random.key(seed),
        stop,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        pad_id=pad_id,
    )
    mask = np.asarray(mask)
    return Generation(np.asarray(tok), np.asarray(logp), mask, mask.sum(axis=1).astype(np.int32))
