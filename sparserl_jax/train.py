"""`sparserl train`: the sampler-learner loop.

One RL step (`_Run.step`):

    1. prompts (grain) -> rollout with the sampler's published weights (dense or sparse KV)
    2. rewards -> group advantages
    3. pi_old: the dense policy with the same published weights, teacher forced on the trainer
       (bypass mode, `learner.correction.bypass`: the sampler's logprobs, no recompute)
    4. up to K DGG-gated passes of the Sparse-RL objective
    5. PULSESync: the publisher's patch is applied by the sampler, which proves it holds the
       published bits exactly (the receiver checks the full-state digest)
    6. one metrics row; the adaptive KV budget (`rollout.kv.adaptive`) picks the next step's
       budget from this step's `correction/rho_p5`; a checkpoint every `train.save_every` steps

Topologies (`sparserl_jax.sampler.make_meshes`): `colocated` (one mesh) and `split` (disjoint
trainer and sampler meshes, the patch applied onto the sampler mesh in-process). Both always go
through PULSESync.

Resume: checkpoints hold the learner state (master params, optimizer, DGG window, counters), the
data-iterator state, the sync version, the adaptive KV budget's state and the step; rollout keys
derive from `(train.seed, step)`, so a resumed run continues bit for bit. SIGTERM or SIGINT stops
a run at a safe point (`train`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from typing import Any

import jax
from tqdm import tqdm

from sparserl_jax.build import build_model, build_tokenizer
from sparserl_jax.checkpoint import STOP_SIGNALS, CheckpointManager, Preempted, PreemptionGuard
from sparserl_jax.config import Config, to_dict
from sparserl_jax.data import (
    PromptLimit,
    encode_prompts,
    eval_examples,
    iterator_state,
    make_reward_fn,
    prompt_dataset,
    resume_iterator,
    try_reward_fn,
)
from sparserl_jax.kvcache import BudgetController, BudgetState
from sparserl_jax.metrics import (
    MetricsWriter,
    evaluation_on_record,
    jsonable_row,
    plot_metrics,
    record_evaluation,
    step_metrics,
    summarise_rewards,
    truncate_metrics,
)
from sparserl_jax.parallel import batch_shards
from sparserl_jax.rl import Learner, LearnerState
from sparserl_jax.rollout import RolloutConfig
from sparserl_jax.sampler import (
    Sampler,
    make_meshes,
    sampler_shardings,
    step_seeds,
    trainer_devices,
)
from sparserl_jax.sft import drop_progress, run_warm_start
from sparserl_jax.step import learn_step, rl_batch
from sparserl_jax.storage import is_url, run_path, write_text
from sparserl_jax.sync import InProcessTransport, Publisher, new_run_id

__all__ = ["check_config", "rl_batch", "train"]

PLOTTED = (
    "critic/score/mean",
    "val/reward_mean",
    "val/greedy_reward_mean",
    "response_length/mean",
    "correction/masked_token_fraction",
    "dgg/z",
)


def check_config(cfg: Config) -> None:
    """What can be checked before anything is built (`train` calls it first): settings that
    contradict each other, the rollout batch against the learner's micro-batches and the
    trainer mesh, the user's reward function (imported, signature checked). Raises ValueError
    (or `DataError`, a ValueError) naming the settings to change."""
    rcfg = cfg.rollout
    run_path(cfg.run_dir)  # a path, or a URL whose scheme and package are there
    if cfg.train.tensorboard and is_url(cfg.run_dir):
        raise ValueError(f"train.tensorboard needs a local run_dir, not {cfg.run_dir}")
    if rcfg.temperature > 0 and rcfg.temperature != cfg.learner.loss.temperature:
        raise ValueError(
            f"rollout.temperature={rcfg.temperature} but learner.loss.temperature="
            f"{cfg.learner.loss.temperature}: the learner must score tokens with the sampler's "
            "temperature (the logprob contract); set both to the same value"
        )
    if cfg.learner.correction.bypass and rcfg.sparse:
        raise ValueError(
            f"learner.correction.bypass=true with a compressed KV cache (rollout.kv.policy="
            f"{rcfg.kv.policy!r}): bypass takes the sampler's logprobs as pi_old, so the "
            "Sparse-RL correction would see rho = 1 and never correct the sparse sampler's "
            "mismatch. Use bypass only with dense rollouts (rollout.kv.policy=none)"
        )
    if rcfg.n_samples < 2:
        raise ValueError(
            f"rollout.n_samples={rcfg.n_samples}: group advantages need at least 2 samples"
        )
    trainer_mesh, _ = make_meshes(cfg.mesh, cfg.train, jax.devices(), rollout=rcfg)
    shards = batch_shards(trainer_mesh)
    mini, micro = cfg.learner.num_mini_batches, cfg.learner.num_micro_batches
    rows, split = cfg.data.batch_size * rcfg.n_samples, mini * micro * shards
    if rows % split:
        fit = split // math.gcd(split, rcfg.n_samples)
        raise ValueError(
            f"the rollout batch, data.batch_size={cfg.data.batch_size} x rollout.n_samples="
            f"{rcfg.n_samples} = {rows} rows, must be a multiple of learner.num_mini_batches "
            f"({mini}) x learner.num_micro_batches ({micro}) x the trainer mesh's data*fsdp "
            f"shards ({shards} on {trainer_devices(cfg.train, len(jax.devices()))}): change "
            "data.batch_size, rollout.n_samples, the learner's mini- or micro-batches or "
            f"mesh.data/mesh.fsdp (e.g. data.batch_size={fit})"
        )
    if cfg.data.reward_fn is not None:
        make_reward_fn(cfg.data)  # imports it: a bad path fails now, not after the SFT stage


@dataclasses.dataclass
class _Run:
    """The pieces of a run and the RL step over them; `state` is the learner's, replaced by
    every step."""

    cfg: Config
    rollout: RolloutConfig
    tokenizer: Any
    learner: Learner
    state: LearnerState
    ckpt: CheckpointManager
    publisher: Publisher
    transport: InProcessTransport
    sampler: Sampler
    reward_fn: Any
    data_it: Any
    held_out: list  # the held-out examples (`train.eval_examples` of them)
    start_step: int
    resumed: bool
    pending_row: dict | None = None  # a metrics row whose evaluation a signal stopped
    budget: BudgetController | None = None  # the adaptive KV budget (`rollout.kv.adaptive`)
    budget_state: BudgetState | None = None

    def step(self, step: int, guard: PreemptionGuard) -> dict[str, Any]:
        """One RL step (the list in the module docstring); returns its metrics row. A signal
        during the rollout, rewards or pi_old drops the step (`Preempted`: nothing of the run's
        state has changed but the data iterator's position); from the update on it completes."""
        t_step = time.perf_counter()
        examples = next(self.data_it).examples
        prompts = encode_prompts(examples, self.tokenizer, max_len=self.rollout.max_prompt_len)
        with guard.abortable(f"rollout:{step}", f"the rollout of step {step}"):
            t0 = time.perf_counter()
            seeds = step_seeds(self.cfg.train.seed, step, len(prompts))
            result = self.sampler.rollout(prompts, seeds)
            t_gen = time.perf_counter() - t0
        out = learn_step(
            self.cfg,
            self.learner,
            self.state,
            self.publisher,
            self.reward_fn,
            self.tokenizer,
            examples=examples,
            result=result,
            step=step,
            preparing=guard.abortable(f"rewards:{step}", f"the rewards and pi_old of step {step}"),
            on_update=lambda: guard.mark(f"update:{step}", f"the update of step {step}"),
        )
        self.state = out.state
        t0 = time.perf_counter()
        events = self.sampler.sync(self.transport)
        t_sync = out.timings.pop("publish") + time.perf_counter() - t0
        row = (
            step_metrics(
                rewards=out.rewards,
                advantages=out.advantages,
                rollout=result,
                max_new_tokens=self.rollout.max_new_tokens,
                history=out.history,
                published=out.published,
                sync_events=events,
                timings={
                    "gen": t_gen,
                    **out.timings,
                    "sync": t_sync,
                    "step": time.perf_counter() - t_step,
                },
            )
            | out.extra
        )
        if self.sampler.kv_budget is not None:
            row["rollout/kv_budget"] = self.sampler.kv_budget  # the budget this rollout used
        if self.budget is not None:
            p5, rejected = row["correction/rho_p5"], row["correction/rejected_seq_fraction"]
            self.budget_state = self.budget.update(self.budget_state, p5, rejected)
            self.sampler.set_kv_budget(self.budget_state.budget)
        return row

    def save(self, step: int, guard: PreemptionGuard, pending_row: dict | None = None) -> None:
        """Checkpoint `step` (asynchronously). `pending_row`: the step's metrics row when its
        evaluation was stopped: the next run completes it with its first evaluation."""
        meta = {
            "data_state": iterator_state(self.data_it),
            "sync_version": self.publisher.version,
            "sync_run_id": self.publisher.run_id,
        }
        if self.budget_state is not None:
            meta["kv_budget"] = self.budget_state._asdict()
        if pending_row is not None:
            meta["pending_row"] = jsonable_row(pending_row)
        self.ckpt.save(step, {"learner": self.state}, meta)
        guard.mark(f"save:{step}", f"the save of checkpoint step {step}")


def _start(cfg: Config, log_fn, guard: PreemptionGuard) -> _Run:
    """Build everything; resume from the newest checkpoint, or warm-start (SFT) and save step 0;
    give the sampler its first weights. A signal during the SFT stage raises `Preempted` (no
    checkpoint is written: the next run starts the SFT stage again)."""
    tcfg = cfg.train
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    rcfg = cfg.rollout
    if rcfg.stop_token_ids == ():
        rcfg = dataclasses.replace(rcfg, stop_token_ids=tuple(tokenizer.eos_ids))
    # Every prompt is read (and a long one skipped or refused) before the model is built.
    limit = PromptLimit(tokenizer, rcfg.max_prompt_len)
    prompts, _ = prompt_dataset(cfg.data, limit=limit)
    try_reward_fn(cfg.data, prompts)
    held_out = eval_examples(cfg.data, tcfg.eval_examples, limit=limit)
    trainer_mesh, sampler_mesh = make_meshes(cfg.mesh, tcfg, jax.devices())
    model = build_model(cfg.model, trainer_mesh)
    learner = Learner(model, cfg.learner, mesh=trainer_mesh)
    ckpt = CheckpointManager(
        cfg.run_dir, keep=tcfg.keep_checkpoints, async_save=tcfg.async_checkpoint
    )
    start_step, data_state, sync_version, run_id = 0, None, 0, new_run_id()
    restored = None
    if tcfg.resume and ckpt.steps():
        restored = ckpt.restore_latest({"learner": learner.init(model)})
    if restored is not None:
        state, meta = restored[0]["learner"], restored[1]
        start_step, data_state = int(meta["step"]), meta.get("data_state")
        sync_version = int(meta.get("sync_version", 0))
        run_id = meta.get("sync_run_id", run_id)  # the sync run id survives a restart
        log_fn(f"resumed from {ckpt.directory} at step {start_step}")
    else:
        if cfg.sft.steps:
            run_warm_start(
                model, cfg.sft, cfg.data, tokenizer, cfg.run_dir, log=log_fn, guard=guard
            )
        state = learner.init(model)
        # Step 0 = after the warm start: a run killed later never repeats the SFT stage.
        ckpt.save(
            0, {"learner": state}, {"data_state": None, "sync_version": 0, "sync_run_id": run_id}
        )
        if cfg.sft.steps:
            ckpt.wait()
            drop_progress(cfg.run_dir)  # step 0 holds the warm start now
        guard.mark("save:0", "the save of checkpoint step 0")

    # The sync's baseline is bf16(master), re-derived exactly from the restored master; the
    # version numbering continues from the checkpoint (a new chain starts with an anchor).
    transport = InProcessTransport()
    publisher = Publisher(transport, config=cfg.sync, start_version=sync_version, run_id=run_id)
    sampler = Sampler.create(
        learner.model(state.params),
        state.params,
        rcfg,
        shardings=sampler_shardings(model, sampler_mesh or trainer_mesh),
        publish_dtype=cfg.sync.jnp_publish_dtype,
        mesh=sampler_mesh or trainer_mesh,
    )
    publisher.publish(state.params)
    sampler.sync(transport)
    budget = budget_state = None
    if rcfg.sparse and rcfg.kv.adaptive.enabled:
        budget = BudgetController.from_config(
            rcfg.kv, page_size=rcfg.page_size, max_len=rcfg.max_len
        )
        saved = restored[1].get("kv_budget") if restored is not None else None
        budget_state = budget.restore(saved) if saved else budget.init(rcfg.kv.budget)
        sampler.set_kv_budget(budget_state.budget)
    return _Run(
        cfg=cfg,
        rollout=rcfg,
        tokenizer=tokenizer,
        learner=learner,
        state=state,
        ckpt=ckpt,
        publisher=publisher,
        transport=transport,
        sampler=sampler,
        reward_fn=make_reward_fn(cfg.data),
        data_it=resume_iterator(prompts, data_state),
        held_out=held_out,
        start_step=start_step,
        resumed=restored is not None,
        pending_row=restored[1].get("pending_row") if restored is not None else None,
        budget=budget,
        budget_state=budget_state,
    )


def train(cfg: Config, *, log_fn=print, on_step=None) -> dict:
    """Run `sparserl train` for `cfg`; returns the summary.

    `log_fn(message)` receives progress messages; `on_step(step, metrics)` is called after each
    RL step with the row written to `metrics.jsonl` (for custom logging or early stopping).

    SIGTERM or SIGINT (Ctrl-C) stops the run with a consistent checkpoint (none during the SFT
    stage) and one `log_fn` line saying where (`_stopped`); a rollout or evaluation in progress
    is dropped (the next run redoes it), an update or a save is finished first. Running the same
    command again continues as if the run had never stopped.
    """
    run_dir = run_path(cfg.run_dir)  # a local directory or a URL (`storage`)
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    with PreemptionGuard(STOP_SIGNALS) as guard:
        check_config(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            run = _start(cfg, log_fn, guard)
        except Preempted:
            return _stopped(summary, guard, None, log_fn)
        # Written once the checkpoint (if any) matched this config: a mismatch changes nothing.
        write_text(run_dir / "config.json", json.dumps(to_dict(cfg), indent=1))
        summary["start_step"] = run.start_step
        try:
            step, rewards_seen, stopped = _loop(run, guard, summary, log_fn, on_step)
        finally:
            run.ckpt.wait()
            run.ckpt.close()
    if stopped:
        return _stopped(summary, guard, step, log_fn)
    summarise_rewards(summary, rewards_seen, run.rollout.temperature, run.start_step, step, log_fn)
    metrics = run_dir / "metrics.jsonl"
    summary.update(end_step=step, metrics=str(metrics))
    if cfg.train.plot and step > run.start_step and not is_url(cfg.run_dir):  # a local PNG
        summary["plot"] = str(
            plot_metrics(metrics, run_dir / "metrics.png", list(PLOTTED), skip_missing=True)
        )
    return summary


def _loop(run: _Run, guard: PreemptionGuard, summary, log_fn, on_step) -> tuple[int, list, bool]:
    """Evaluate, run the RL steps, evaluate. Returns the last step done, the steps' mean
    rewards, and whether a signal stopped the run (checkpoint `step` is then saved or saving)."""
    tcfg = run.cfg.train
    # Idempotent outputs: rows a killed run wrote after its last checkpoint are re-run, so they
    # are dropped; the "before" evaluation is written only if that step has no row yet.
    write_before, recorded, before_at = True, {}, run.start_step
    if run.resumed:
        kept = truncate_metrics(run.cfg.run_dir, run.start_step)
        before_at, recorded, row_written = evaluation_on_record(kept, run.start_step)
        write_before = not row_written
    evaluated = before_at == run.start_step and bool(recorded)  # this step's, on record
    writer = MetricsWriter(run.cfg.run_dir, tensorboard=tcfg.tensorboard)
    held_out = run.held_out
    held_prompts = encode_prompts(held_out, run.tokenizer, max_len=run.rollout.max_prompt_len)

    def evaluate(step: int, key: str, when: str) -> dict[str, float]:
        with guard.abortable(f"{key}:{step}", f"the held-out evaluation {when} step {step}"):
            how = tcfg.evaluation
            val = run.sampler.evaluate(held_out, held_prompts, run.tokenizer, run.reward_fn, **how)
        if key != "eval":
            record_evaluation(summary, val, step, when, log_fn)
        return val

    step = saved = run.start_step  # checkpoint `saved` is on disk (or being written)
    rewards_seen: list[float] = []
    bar, done = None, False
    try:
        val = before = recorded or evaluate(step, "eval-before", "before")
        if recorded:
            record_evaluation(summary, val, before_at, "before", log_fn)
        # A row whose evaluation a signal stopped is completed by this one (the same weights).
        if write_before and (val or run.pending_row):
            row = writer.write(step, {**(run.pending_row or {}), **val})
            evaluated = bool(val)
            if run.pending_row and on_step is not None:
                on_step(step, row)
        if tcfg.progress and tcfg.steps > step:
            bar = tqdm(total=tcfg.steps, initial=step, desc="train", unit="step", file=sys.stderr)
        while step < tcfg.steps and not guard.requested:
            data_state = iterator_state(run.data_it)
            try:
                metrics = run.step(step + 1, guard)
            except Preempted:  # the step is dropped: its batch comes first in the next run
                run.data_it.set_state(data_state)
                break
            step += 1
            rewards_seen.append(metrics["critic/score/mean"])
            if tcfg.eval_every and step % tcfg.eval_every == 0 and step < tcfg.steps:
                try:
                    metrics.update(evaluate(step, "eval", "at"))
                except Preempted:
                    run.save(step, guard, pending_row=metrics)
                    saved = step
                    break
            row = writer.write(step, metrics)
            if on_step is not None:
                on_step(step, row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}")
            if step % tcfg.save_every == 0 or step == tcfg.steps or guard.requested:
                run.save(step, guard)
                saved = step
        if not guard.requested:
            run.ckpt.wait()
            if step == before_at and before:  # no step ran: the same weights, same seeds
                val = before
                record_evaluation(summary, val, step, "after", log_fn)
            else:
                val = evaluate(step, "eval-after", "after")
            # Not twice for the same weights; a run stopped during this evaluation writes it now.
            if val and (step > run.start_step or not evaluated):
                writer.write(step, val)
            done = True
    except Preempted:  # an evaluation between steps: nothing to save
        pass
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    if not done and saved != step:
        run.save(step, guard)
    return step, rewards_seen, not done


def _stopped(summary: dict, guard: PreemptionGuard, step: int | None, log_fn) -> dict:
    """The one line (and the summary) of a run a signal stopped; `step`: its newest checkpoint
    (None: stopped before step 0 was saved, during the SFT stage)."""
    if step is None:
        outcome = "no checkpoint needed: the same command starts over with the SFT warm start"
    else:
        outcome = f"checkpoint step {step} is saved: the same command resumes from it"
    log_fn(f"stopped by {guard.signal_name} during {guard.stopped_where}; {outcome}")
    summary.update(stopped_by_signal=True, signal=guard.signal_name, end_step=step)
    summary["stopped_during"] = guard.stopped_where
    return summary
