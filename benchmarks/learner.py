"""Learner-step throughput on a synthetic rollout batch (used by `tools/bench_learner.py`), and
the time a batch's learner work takes with pi_old recomputed or taken from the first pass.

The model is a random-init one with a preset's architecture (no weights are read): a
`--preset` name of the tool, a `sparserl_jax.models.MODEL_PRESETS` name, or a `configs/` name.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sparserl_jax.kvcache.evictions import NEVER
from sparserl_jax.models import MODEL_PRESETS, ModelConfig, model_preset
from sparserl_jax.rl.advantages import grpo_advantages
from sparserl_jax.rl.config import LearnerConfig
from sparserl_jax.rl.learner import Learner, RLBatch

# `--preset` names -> `sparserl_jax.models.MODEL_PRESETS` names ("tiny" is configs/tiny.yaml's).
PRESETS = {"tiny": "char-tiny", "small": "learner-small", "qwen2.5-0.5b": "qwen2.5-0.5b"}


def model_config(preset: str, dtype: str, remat: bool) -> ModelConfig:
    """`preset`'s architecture computing in `dtype` over fp32 master weights.

    `preset` is a key of `PRESETS`, a registry name, or else a YAML config in `configs/` whose
    `model` section names an architecture (e.g. "demo" -> configs/demo.yaml).
    """
    name = PRESETS.get(preset, preset)
    if name in MODEL_PRESETS:
        arch = model_preset(name)
    else:
        from sparserl_jax.config import load_config  # only YAML presets need the config system

        arch = load_config(f"configs/{preset}.yaml").model.model_config()
    return arch.replace(dtype=dtype, param_dtype="float32", remat=remat)


def synthetic_batch(
    *, batch: int, seq_len: int, prompt_len: int, vocab: int, group_size: int, seed: int = 0
) -> RLBatch:
    """Random tokens, full-length responses after `prompt_len`, binary rewards in GRPO groups,
    and sampler logprobs to be offset from pi_old (see `benchmark_learner`)."""
    if not 0 < prompt_len < seq_len:
        raise ValueError(f"need 0 < prompt_len < seq_len, got {prompt_len=}, {seq_len=}")
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k1, (batch, seq_len), 0, vocab, dtype=jnp.int32)
    mask = jnp.broadcast_to(jnp.arange(seq_len) >= prompt_len, (batch, seq_len))
    rewards = jax.random.bernoulli(k2, 0.5, (batch,)).astype(jnp.float32)
    return RLBatch(
        tokens_bt=tokens,
        mask_bt=mask,
        advantages_b=grpo_advantages(rewards, group_size=group_size),
        sampler_logp_bt=0.05 * jax.random.normal(k3, (batch, seq_len)),
    )


def synthetic_evictions(
    batch: RLBatch, *, layers: int, kv_heads: int, budget: int, seed: int = 0
) -> RLBatch:
    """`batch` with an eviction record per layer and KV head (`kvcache.evictions`) for
    `learner.attention_mask=replay`: each key stays cached for a random span of up to
    `2 * budget` later queries, or to the end with probability `budget / T`. Replay's cost does
    not depend on which keys are evicted (the masked tiles are computed either way)."""
    b, t = batch.tokens_bt.shape
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    shape = (b, layers, kv_heads, t)
    span = jax.random.randint(k1, shape, 1, 2 * budget + 1, dtype=jnp.int32)
    ev = jnp.arange(t, dtype=jnp.int32) + span
    ev = jnp.where(jax.random.bernoulli(k2, budget / t, shape), NEVER, ev)
    return batch._replace(evict_pos_bykt=ev)


def benchmark_learner(
    model: nnx.Module,
    config: LearnerConfig,
    batch: RLBatch,
    *,
    steps: int,
    mesh: Mesh | None = None,
) -> dict:
    """Time `steps` learner updates after one compile step.

    Returns tokens/s over all `B * T` positions the step runs forward and backward, the
    response tokens/s (positions in the loss mask), step time, compile time and peak device
    memory when the backend reports it.
    """
    learner = Learner(model, config, mesh=mesh)
    state = learner.init(model)
    old = learner.logprobs(state.params, batch.tokens_bt, batch.evict_pos_bykt)
    batch = batch._replace(old_logp_bt=old, sampler_logp_bt=old + batch.sampler_logp_bt)
    passes = config.gating.max_passes

    start = time.perf_counter()
    state, metrics = learner.step(state, batch, 1)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start

    start = time.perf_counter()
    for i in range(steps):
        state, metrics = learner.step(state, batch, i % passes + 1)
    jax.block_until_ready((state, metrics))
    elapsed = time.perf_counter() - start

    b, t = batch.tokens_bt.shape
    response = int(np.asarray(batch.mask_bt).sum())
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "tokens_per_s": b * t * steps / elapsed,
        "response_tokens_per_s": response * steps / elapsed,
        "step_ms": 1e3 * elapsed / steps,
        "compile_s": compile_s,
        "steps": steps,
        "batch": b,
        "seq_len": t,
        "num_params": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "peak_bytes": stats.get("peak_bytes_in_use"),
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        # The same batch is reused for every step: late steps may have every token clipped.
        "clip_fraction": float(metrics["clip_fraction"]),
        "device": jax.devices()[0].device_kind,
        "num_devices": 1 if mesh is None else mesh.size,
    }


def _batch_work(learner: Learner, state, batch: RLBatch, passes: int, *, first_pass: bool):
    """One rollout batch's learner work as `Learner.train_on_batch` does it: pi_old (a
    separate recompute, or from the first pass) and `passes` updates, each pass's metrics read
    back to the host (the loop's reuse decision)."""
    k0 = 1
    if first_pass:
        state, metrics, old = learner.first_pass(state, batch)
        jax.device_get(metrics)
        k0 = 2
    else:
        old = learner.logprobs(state.params, batch.tokens_bt)
    batch = batch._replace(old_logp_bt=old)
    for k in range(k0, passes + 1):
        state, metrics = learner.step(state, batch, k)
        jax.device_get(metrics)
    jax.block_until_ready(state.params)
    return state


def benchmark_old_logp(
    model: nnx.Module,
    config: LearnerConfig,
    batch: RLBatch,
    *,
    passes: tuple[int, ...] = (1, 2, 4),
    batches: int = 5,
    mesh: Mesh | None = None,
) -> dict:
    """Time a rollout batch's learner work, pi_old plus K update passes (DGG reuse), with pi_old
    from a separate teacher-forced recompute and from the first pass's forward, for each K in
    `passes`: one learner (same hyperparameters and compiled programs), the two ways
    interleaved batch by batch, `batches` timed batches each after a compile batch.

    Returns per K the median (and the minimum) batch time of each way (ms), the time saved and
    its fraction, and the separate recompute's own median time (`old_logp_ms`, timed alone).
    """
    learner = Learner(model, config, mesh=mesh)
    if learner.first_pass_fallback is not None:
        raise ValueError(f"pi_old cannot come from the first pass: {learner.first_pass_fallback}")
    state = learner.init(model)
    old = learner.logprobs(state.params, batch.tokens_bt)
    batch = batch._replace(sampler_logp_bt=old + batch.sampler_logp_bt)

    start = time.perf_counter()
    for first in (False, True):  # compile: every program of both ways
        state = _batch_work(learner, state, batch, max(2, max(passes)), first_pass=first)
    compile_s = time.perf_counter() - start

    old_ms = []
    for _ in range(batches):
        start = time.perf_counter()
        jax.block_until_ready(learner.logprobs(state.params, batch.tokens_bt))
        old_ms.append(1e3 * (time.perf_counter() - start))
    rows = []
    for k in passes:
        ms = {False: [], True: []}
        for _ in range(batches):
            for first in (False, True):
                start = time.perf_counter()
                state = _batch_work(learner, state, batch, k, first_pass=first)
                ms[first].append(1e3 * (time.perf_counter() - start))
        recompute, first = float(np.median(ms[False])), float(np.median(ms[True]))
        rows.append(
            {
                "passes": k,
                "recompute_ms": recompute,
                "first_pass_ms": first,
                "saved_ms": recompute - first,
                "saved_fraction": (recompute - first) / recompute,
                # The fastest batch of each way: what a machine shared with other work (whose
                # load only ever adds time) gives most reliably.
                "recompute_ms_min": min(ms[False]),
                "first_pass_ms_min": min(ms[True]),
                "recompute_ms_all": ms[False],
                "first_pass_ms_all": ms[True],
            }
        )
    b, t = batch.tokens_bt.shape
    return {
        "old_logp": rows,
        "old_logp_ms": float(np.median(old_ms)),
        "compile_s": compile_s,
        "batches": batches,
        "batch": b,
        "seq_len": t,
        "num_params": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "device": jax.devices()[0].device_kind,
        "num_devices": 1 if mesh is None else mesh.size,
    }
