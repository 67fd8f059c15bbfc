"""Supervised warm start: next-token cross-entropy on (prompt, ideal completion) pairs.

A model trained from scratch never samples a correct answer, so GRPO has no signal; a short SFT
stage on the task's reference completions (the arithmetic scratchpads, say) gives it a policy
that is right some of the time, which RL then improves. `sparserl train` runs it first when
`sft.steps > 0`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from sparserl_jax.checkpoint import CheckpointManager, PreemptionGuard
from sparserl_jax.data import DataConfig, sft_batch, sft_pairs
from sparserl_jax.kvcache.evictions import NEVER
from sparserl_jax.rl.config import decay_mask
from sparserl_jax.storage import remove_tree, run_path


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """The optional warm-start stage (`steps: 0` skips it).

    Attributes:
      steps: optimizer steps of AdamW on the masked cross-entropy of completion tokens.
      batch_size: (prompt, completion) pairs per step.
      learning_rate: peak lr of a warm-up + cosine schedule.
      warmup_steps: linear warm-up steps.
      weight_decay: AdamW decay of weight matrices.
      max_len: token length of `prompt + completion + eos` rows; longer pairs are an error.
      num_examples: distinct training pairs (cycled through in order, reshuffled each epoch).
      seed: shuffling seed.
      corrupt_answers: fraction of the demonstrations whose final answer (the last integer of
        the completion) is replaced by a wrong one, the rest of the completion kept. It
        simulates noisy SFT data: the warm-started model then often writes a wrong answer after
        a right derivation, a mistake a verifiable reward can teach it out of (the CPU demo).
      corrupt_offset: 0 (default): a corrupted answer is off by a random 1..10 either way, so
        the right answer stays the likeliest and greedy decoding mostly writes it. Non-zero:
        every corrupted answer is off by exactly this much (a labeller's systematic mistake);
        with `corrupt_answers` > 0.5 the wrong answer is then the likeliest one, greedy
        decoding writes it, and only sampling finds the right one: what RL has to fix.
      window_fraction: the fraction of each batch's rows trained with a windowed view: each
        token attends only to the first `window_sinks` positions and the last `window`
        positions up to itself, what a StreamingLLM cache of `window_sinks + window` entries
        keeps (`streaming_evict_pos`, through the eviction-replay attention). The model then
        learns to compute from what a KV budget keeps, not only from full context. 0 (default):
        every row sees its whole context.
      window: the recent positions a windowed row sees (>= 1 when `window_fraction` > 0).
      window_sinks: the leading positions a windowed row always sees (the prompt, say).
    """

    steps: int = 0
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_len: int = 160
    num_examples: int = 4096
    seed: int = 0
    corrupt_answers: float = 0.0
    corrupt_offset: int = 0
    window_fraction: float = 0.0
    window: int = 0
    window_sinks: int = 0

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"sft.steps must be >= 0, got {self.steps}")
        if self.batch_size < 1 or self.num_examples < self.batch_size:
            raise ValueError(
                f"sft needs 1 <= batch_size <= num_examples, got {self.batch_size}, "
                f"{self.num_examples}"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"sft.learning_rate must be > 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"sft.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_len < 2:
            raise ValueError(f"sft.max_len must be >= 2, got {self.max_len}")
        if not 0.0 <= self.corrupt_answers < 1.0:
            raise ValueError(f"sft.corrupt_answers must be in [0, 1), got {self.corrupt_answers}")
        if not 0.0 <= self.window_fraction <= 1.0:
            raise ValueError(f"sft.window_fraction must be in [0, 1], got {self.window_fraction}")
        if self.window_fraction and self.window < 1:
            raise ValueError(f"sft.window must be >= 1 with window_fraction > 0, got {self.window}")
        if self.window_sinks < 0:
            raise ValueError(f"sft.window_sinks must be >= 0, got {self.window_sinks}")


_LAST_INT = re.compile(r"-?\d+(?!.*\d)", re.DOTALL)


def corrupt_answer(completion: str, rng: np.random.Generator, offset: int = 0) -> str:
    """`completion` with its last integer replaced by a different one: off by `offset` when
    non-zero, else by a random 1..10 either way."""
    m = _LAST_INT.search(completion)
    if m is None:
        return completion
    delta = offset or int(rng.choice([-1, 1])) * int(rng.integers(1, 11))
    wrong = int(m.group(0)) + delta
    return completion[: m.start()] + str(wrong) + completion[m.end() :]


def sft_loss(
    logits_btv: Float[Array, "B T V"], tokens_bt: Int[Array, "B T"], mask_bt: Bool[Array, "B T"]
) -> Float[Array, ""]:
    """Mean cross-entropy of the masked targets: `logits[:, t]` predicts `tokens[:, t + 1]`,
    counted where `mask[:, t + 1]` (completion tokens and the eos)."""
    logp_btv = jax.nn.log_softmax(logits_btv[:, :-1].astype(jnp.float32), axis=-1)
    target_bt = tokens_bt[:, 1:]
    nll_bt = -jnp.take_along_axis(logp_btv, target_bt[..., None], axis=-1)[..., 0]
    m_bt = mask_bt[:, 1:].astype(jnp.float32)
    return jnp.sum(nll_bt * m_bt) / jnp.maximum(jnp.sum(m_bt), 1.0)


def _optimizer(cfg: SFTConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1)
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


def streaming_evict_pos(t: int, window: int, sinks: int) -> np.ndarray:
    """int32 `[t]`: for each position j, the first query position that no longer sees its key
    (`kvcache.evictions`) under a StreamingLLM view: the first `sinks` positions are never
    evicted, any other j is seen by queries j .. j + window - 1."""
    j = np.arange(t, dtype=np.int64)
    return np.where(j < sinks, NEVER, np.minimum(j + window, NEVER)).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "tx"), donate_argnums=(0, 1))
def _step(params, opt_state, tokens_bt, mask_bt, evict_pos_bykt=None, *, graphdef, tx):
    def loss_fn(p):
        model = nnx.merge(graphdef, p)
        if evict_pos_bykt is None:
            logits_btv = model(tokens_bt)
        else:
            logits_btv = model.logits(model.hidden_states(tokens_bt, evict_pos_bykt=evict_pos_bykt))
        return sft_loss(logits_btv, tokens_bt, mask_bt)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def progress_dir(run_dir: str | Path) -> Any:
    """Where a run's SFT warm start keeps its progress until the run saves its step 0 (a local
    path or a URL, as `run_dir`)."""
    return run_path(run_dir) / "sft_progress"


def drop_progress(run_dir: str | Path) -> None:
    """Remove the warm start's progress: call once the run's step 0 (after it) is on disk."""
    remove_tree(progress_dir(run_dir))


def sft_warm_start(
    model: nnx.Module,
    cfg: SFTConfig,
    data: DataConfig,
    tokenizer,
    *,
    on_step: Callable[[int, float], None] | None = None,
    log: Callable[[str], None] | None = None,
    checkpoint_dir: str | Path | None = None,
) -> list[float]:
    """Train `model` in place for `cfg.steps` steps on `data`'s reference completions; returns
    the loss of every step. Deterministic for a given config (batches come in a seeded order).
    `log` gets a progress line (loss, seconds so far) after every tenth of the steps.

    `checkpoint_dir` (a run's `progress_dir`): where the warm start saves its progress after
    every tenth of its steps (parameters, optimizer state, losses, the batch order and its RNG
    states; Orbax, verified on restore) and resumes from when called again, bit for bit where
    it stopped. The caller removes it once it has saved the result (`drop_progress`). A
    checkpoint of another SFT config there is refused in one line."""
    if cfg.steps == 0:
        return []
    pairs = sft_pairs(data, cfg.num_examples)
    if cfg.corrupt_answers:
        noise = np.random.default_rng([cfg.seed, 1])
        pairs = [
            (
                p,
                corrupt_answer(c, noise, cfg.corrupt_offset)
                if noise.random() < cfg.corrupt_answers
                else c,
            )
            for p, c in pairs
        ]
    full = sft_batch(pairs, tokenizer, max_len=cfg.max_len)
    graphdef, state = nnx.split(model)
    # A copy: the step donates its inputs, and the model keeps valid arrays if training fails.
    params = jax.tree.map(jnp.copy, nnx.to_pure_dict(state))
    tx = _optimizer(cfg)
    opt_state = tx.init(params)
    rng = np.random.default_rng(cfg.seed)
    views = np.random.default_rng([cfg.seed, 2])  # which rows see through the window
    windowed = streaming_evict_pos(full.tokens_bt.shape[1], cfg.window, cfg.window_sinks)
    order = np.empty(0, np.int64)
    losses, t0, start = [], time.perf_counter(), 0
    every = max(cfg.steps // 10, 1)
    ckpt, fingerprint = None, json.loads(json.dumps(dataclasses.asdict(cfg)))
    with contextlib.ExitStack() as stack:  # the checkpoint manager is closed however it ends
        if checkpoint_dir is not None:
            ckpt = stack.enter_context(CheckpointManager(checkpoint_dir, keep=1, async_save=False))
            restored = ckpt.restore_latest({"params": params, "opt_state": opt_state})
            if restored is not None:
                (tree, meta), held = restored, restored[1]["config"]
                if held != fingerprint:
                    diff = sorted(
                        k for k in set(held) | set(fingerprint) if held.get(k) != fingerprint.get(k)
                    )
                    raise ValueError(
                        f"{ckpt.directory} holds an SFT warm start of another config (differs in "
                        f"{', '.join(diff)}): use another run_dir, or delete {checkpoint_dir}"
                    )
                params, opt_state = tree["params"], tree["opt_state"]
                start, losses = int(meta["step"]), [float(x) for x in meta["losses"]]
                rng.bit_generator.state, views.bit_generator.state = meta["rng"], meta["views"]
                order = np.asarray(meta["order"], np.int64)
                if log is not None:
                    log(f"SFT resumed from {ckpt.directory} at step {start}/{cfg.steps}")
        for i in range(start, cfg.steps):
            if len(order) < cfg.batch_size:
                order = np.concatenate([order, rng.permutation(len(pairs))])
            idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
            ev = None
            if cfg.window_fraction:
                rows = views.random(len(idx)) < cfg.window_fraction
                ev = np.where(rows[:, None], windowed[None, :], NEVER)[:, None, None, :]
                ev = jnp.asarray(ev.astype(np.int32))
            params, opt_state, loss = _step(
                params,
                opt_state,
                jnp.asarray(full.tokens_bt[idx]),
                jnp.asarray(full.loss_mask_bt[idx]),
                ev,
                graphdef=graphdef,
                tx=tx,
            )
            losses.append(float(loss))
            if on_step is not None:
                on_step(i + 1, losses[-1])
            if (i + 1) % every == 0 and i + 1 < cfg.steps:
                if ckpt is not None:
                    meta = {
                        "losses": losses,
                        "rng": rng.bit_generator.state,
                        "views": views.bit_generator.state,
                        "order": order.tolist(),
                        "config": fingerprint,
                    }
                    ckpt.save(i + 1, {"params": params, "opt_state": opt_state}, meta)
                if log is not None:
                    dt = time.perf_counter() - t0
                    log(f"SFT step {i + 1}/{cfg.steps}: loss {losses[-1]:.3f}, {dt:.0f}s")
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return losses


def run_warm_start(
    model: nnx.Module,
    cfg: SFTConfig,
    data: DataConfig,
    tokenizer,
    run_dir: str | Path,
    *,
    log: Callable[[str], None],
    guard: PreemptionGuard | None = None,
) -> None:
    """A run's SFT warm start (`cfg.steps` > 0), resumable from `progress_dir(run_dir)`, its
    result logged in one line. With a `guard`, a stop signal ends it between two steps."""
    t0 = time.perf_counter()

    def mark(i: int, _) -> None:
        if guard is not None:
            guard.mark(f"sft:{i}", f"the SFT warm start ({i}/{cfg.steps} steps done)")

    where = f"the SFT warm start (0/{cfg.steps} steps done)"
    with guard.abortable("sft:0", where) if guard is not None else contextlib.nullcontext():
        losses = sft_warm_start(
            model,
            cfg,
            data,
            tokenizer,
            on_step=mark,
            log=log,
            checkpoint_dir=progress_dir(run_dir),
        )
    dt, a, b = time.perf_counter() - t0, losses[0], losses[-1]
    log(f"SFT warm start: {cfg.steps} steps, loss {a:.3f} -> {b:.3f} in {dt:.1f}s")
