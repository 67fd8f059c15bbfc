"""Learner test doubles: a tiny rollout batch, the config and a pure full-batch reference step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparserl_jax.rl import (
    aggregate_loss,
    grpo_advantages,
    lm_head_grad_energy,
    lm_head_grad_energy_gram,
    ppo_clip_loss,
    shifted_token_logprobs,
    sparse_rl_weights,
)
from sparserl_jax.rl.config import LearnerConfig, LossConfig, OptimizerConfig
from sparserl_jax.rl.learner import RLBatch

B, T, PROMPT = 8, 10, 3


def make_batch(seed=0, vocab=67):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k1, (B, T), 0, vocab)
    lengths = np.array([7, 5, 0, 3, 7, 6, 1, 4])  # row 2 is an empty completion
    pos = np.arange(T)[None, :]
    mask = (pos >= PROMPT) & (pos < PROMPT + lengths[:, None])
    rewards = jax.random.bernoulli(k2, 0.5, (B,)).astype(jnp.float32)
    noise = 0.3 * jax.random.normal(k3, (B, T))
    return RLBatch(
        tokens_bt=tokens,
        mask_bt=jnp.asarray(mask),
        advantages_b=grpo_advantages(rewards, group_size=4) + 0.1,
        sampler_logp_bt=noise,  # shifted by the old logprobs in `with_old`
    )


def with_old(learner, state, batch):
    old = learner.logprobs(state.params, batch.tokens_bt)
    return batch._replace(old_logp_bt=old, sampler_logp_bt=old + batch.sampler_logp_bt)


def config(**kw):
    base = dict(
        loss=LossConfig.dapo(),
        optimizer=OptimizerConfig(learning_rate=1e-3, weight_decay=0.01),
        num_micro_batches=2,
    )
    base.update(kw)
    return LearnerConfig(**base)


def host(tree):
    return jax.tree.map(lambda x: np.array(x), jax.device_get(tree))


@functools.partial(jax.jit, static_argnums=(1, 3, 4))
def reference(params, graphdef, batch, cfg, tied):
    """Full batch, no micro-batching, written with the public pure functions."""

    def loss_from_logits(logits):
        logp = shifted_token_logprobs(logits, batch.tokens_bt)
        corr = sparse_rl_weights(batch.old_logp_bt, batch.sampler_logp_bt, batch.mask_bt)
        pg = ppo_clip_loss(
            logp,
            batch.old_logp_bt,
            batch.advantages_b,
            eps_low=cfg.loss.eps_low,
            eps_high=cfg.loss.eps_high,
        )
        return aggregate_loss(pg * corr.weights_bt, corr.loss_mask_bt, mode=cfg.loss.aggregation)

    def loss_fn(p):
        return loss_from_logits(nnx.merge(graphdef, p)(batch.tokens_bt))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    model = nnx.merge(graphdef, params)
    h = model.hidden_states(batch.tokens_bt)
    dlogits = jax.grad(loss_from_logits)(model.logits(h))
    if tied:
        energy = lm_head_grad_energy_gram(h, dlogits)
    else:
        energy = lm_head_grad_energy(grads["lm_head"]["kernel"])
    return loss, optax.tree.norm(grads), energy
