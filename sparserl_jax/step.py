"""The learn half of an RL step, shared by `sparserl train` (`train._Run.step`) and the
decoupled trainer (`sparserl_jax.decoupled.trainer`): from a finished rollout to the published
weights of the next version."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from sparserl_jax.config import Config
from sparserl_jax.data import compute_rewards
from sparserl_jax.rl import (
    Learner,
    LearnerState,
    RLBatch,
    compute_advantages,
    kept_group_advantages,
    rejected_sequences,
    sparse_rl_weights,
)
from sparserl_jax.rollout import RolloutResult
from sparserl_jax.sampler import completion_texts, published_params
from sparserl_jax.sync import Published, Publisher

__all__ = ["Learned", "learn_step", "old_logp_recompute_reason", "rl_batch"]

log = logging.getLogger(__name__)
_logged: set[str] = set()


def rl_batch(
    result: RolloutResult, advantages_b: np.ndarray, seq_len: int, *, evictions: bool = False
) -> RLBatch:
    """The learner's batch: `result.sequences()` right-padded to the static width `seq_len`
    (so the learner compiles once), with the advantages of every row, the sampler's eviction
    record when `evictions` (for `learner.attention_mask=replay`), and which tokens it drew
    after its first eviction (a sparse rollout: the correction's rho percentiles)."""
    tokens, mask, logp = result.sequences()
    width = tokens.shape[1]
    if width > seq_len:
        raise ValueError(f"rollout rows are {width} tokens wide, more than seq_len {seq_len}")
    pad = ((0, 0), (0, seq_len - width))
    return RLBatch(
        tokens_bt=np.pad(tokens, pad),
        mask_bt=np.pad(mask, pad),
        advantages_b=np.asarray(advantages_b, np.float32),
        sampler_logp_bt=np.pad(logp, pad),
        evict_pos_bykt=result.evictions(seq_len) if evictions else None,
        after_eviction_bt=result.after_eviction(seq_len),
    )


def old_logp_recompute_reason(
    learner: Learner, publish_dtype, version: int, weight_version: np.ndarray
) -> str | None:
    """Why a batch's pi_old needs the separate teacher-forced recompute, or None when the
    update's first pass computes it (`Learner.first_pass`, saving one forward per batch).

    pi_old is the dense policy at the publisher's last published weights, bf16(master) by
    default, while the learner starts the batch from the fp32 master (which the publisher
    last published: `learn_step` publishes every update). The first pass's forward at the
    master is a forward at the published weights when
    - the learner allows it (`Learner.first_pass_fallback` is None);
    - every row was sampled with the published version (`weight_version`, per row): stale
      rollouts of the decoupled trainer keep the recompute;
    - the forward cannot tell the two apart: the weights are published as they are (fp32 or
      `keep`), or in the model's compute dtype: every parameter enters the forward cast to
      it, and `cast(cast(x)) == cast(x)`. An fp32-compute model with bf16 publishing (the
      tiny and demo configs) would compute its first pass at other weights than pi_old's.
    """
    if learner.first_pass_fallback is not None:
        return learner.first_pass_fallback
    if np.any(np.asarray(weight_version) != version):
        return "stale rollout: sampled with older weights than the published ones"
    if publish_dtype is not None and jnp.dtype(publish_dtype) not in (
        jnp.dtype(jnp.float32),
        learner.compute_dtype,
    ):
        return (
            f"the model computes in {learner.compute_dtype.name} at the fp32 master weights, "
            f"pi_old at the published {jnp.dtype(publish_dtype).name} weights"
        )
    return None


class Learned(NamedTuple):
    """What `learn_step` produced: the new learner state and the parts of the metrics row."""

    state: LearnerState
    rewards: np.ndarray
    advantages: np.ndarray
    history: list
    published: Published
    timings: dict[str, float]  # old_log_prob, update_actor, publish
    extra: dict[str, Any]


def learn_step(
    cfg: Config,
    learner: Learner,
    state: LearnerState,
    publisher: Publisher,
    reward_fn,
    tokenizer,
    *,
    examples,
    result: RolloutResult,
    step: int,
    preparing: contextlib.AbstractContextManager | None = None,
    on_update: Callable[[], None] | None = None,
) -> Learned:
    """Steps 2-4 of an RL step and the publication of step 5, on a finished rollout of
    `examples`: rewards, group advantages, pi_old (the dense policy with the publisher's last
    published weights: from the first pass's forward where `old_logp_recompute_reason` allows,
    else a separate recompute; the sampler's logprobs with `learner.correction.bypass`), the
    gated passes, then `publisher.publish` of the new master weights.

    `preparing` is entered around everything before the update (a region a signal may abort:
    nothing has changed yet), and `on_update()` is called when the update starts."""
    rcfg = cfg.rollout
    bypass = cfg.learner.correction.bypass
    why = None
    over_kept = cfg.train.advantages_over_kept and not bypass
    if not bypass:
        why = old_logp_recompute_reason(
            learner, cfg.sync.jnp_publish_dtype, publisher.version, result.weight_version
        )
        if why is None and over_kept:  # the rejections must be known before the advantages
            why = "train.advantages_over_kept: the correction runs before the update"
        if why is not None and why not in _logged and cfg.learner.old_logp_from_first_pass:
            _logged.add(why)  # once per reason and process
            log.warning("pi_old: a separate teacher-forced recompute (%s)", why)
    with preparing if preparing is not None else contextlib.nullcontext():
        texts = completion_texts(result, tokenizer)
        rewards = compute_rewards(reward_fn, examples, texts, group_size=rcfg.n_samples, step=step)
        adv = np.asarray(
            compute_advantages(
                jnp.asarray(rewards),
                group_size=rcfg.n_samples,
                estimator=cfg.train.advantage_estimator,
            )
        )
        replay = cfg.learner.attention_mask == "replay"
        batch = rl_batch(result, adv, rcfg.max_prompt_len + rcfg.max_new_tokens, evictions=replay)

        t0 = time.perf_counter()
        # With bypass the learner takes pi_old := mu; with `why` None, pass 1 computes it.
        if not bypass and why is not None:
            old_params = published_params(
                publisher.sent_bits, state.params, cfg.sync.jnp_publish_dtype
            )
            old = learner.logprobs(old_params, batch.tokens_bt, batch.evict_pos_bykt)
            batch = batch._replace(old_logp_bt=old)
        if over_kept:  # the group statistics over the sequences the correction keeps
            corr = sparse_rl_weights(
                batch.old_logp_bt,
                batch.sampler_logp_bt,
                batch.mask_bt,
                cfg.learner.correction,
                batch.after_eviction_bt,
            )
            kept = ~rejected_sequences(corr.loss_mask_bt, batch.mask_bt)
            adv = np.asarray(
                kept_group_advantages(
                    jnp.asarray(rewards),
                    kept,
                    group_size=rcfg.n_samples,
                    estimator=cfg.train.advantage_estimator,
                )
            )
            batch = batch._replace(advantages_b=adv)
        t_old = time.perf_counter() - t0
    if on_update is not None:
        on_update()

    t0 = time.perf_counter()
    state, history = learner.train_on_batch(state, batch)
    t_upd = time.perf_counter() - t0

    t0 = time.perf_counter()
    published = publisher.publish(state.params)
    timings = {"old_log_prob": t_old, "update_actor": t_upd, "publish": time.perf_counter() - t0}
    # bypassed 1: pi_old was the sampler's logprobs and `timing_s/old_log_prob` is ~0 (skipped);
    # from_first_pass 1: the update's first pass computed it (its time is in update_actor).
    extra = {
        "actor/old_log_prob_bypassed": int(bypass),
        "actor/old_log_prob_from_first_pass": int(not bypass and why is None),
    }
    return Learned(state, rewards, adv, history, published, timings, extra)
