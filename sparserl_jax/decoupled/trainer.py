"""`sparserl trainer`: the decoupled trainer job (docs/decoupled.md).

It owns the data pipeline, the learner, the checkpoints and the PULSESync publisher; it meets
the samplers only through the exchange. One step:

    1. keep `async.max_staleness + 1` batches in flight as work items of a few groups each,
       paced by the oldest weights each may be sampled with (`WorkQueue.fill`);
    2. wait until every item of the oldest batch has a usable READY rollout (idle time:
       `async/trainer_wait_s`); a rollout from weights outside this run's lineage, whose
       weights digest is not the one published for its version, or (pacing defeated) more
       than `max_staleness` versions behind, is dropped and its item re-issued with the same
       prompts and seeds; so are items whose claim lapsed;
    3. the learn half of `sparserl train`'s step (`step.learn_step`): rewards, advantages,
       pi_old = the trainer's current published weights (dense recompute), the gated passes,
       publication of the next version;
    4. a ledger row per item, a metrics row, a checkpoint every `train.save_every` steps.

Resume (the same command after kill -9): the checkpoint holds the learner state, the data
iterator state, the queue (next ids, the batches in flight and their items), the ledger position
and the sync version; the ledger is cut back to that position, a new incarnation (epoch) is
registered, and PULSESync restarts from an anchor of the checkpointed weights under the same run
id on the epoch's own key prefix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any

import jax
import numpy as np

from sparserl_jax.build import build_model, build_tokenizer
from sparserl_jax.checkpoint import CheckpointManager, PreemptionGuard
from sparserl_jax.config import Config, to_dict
from sparserl_jax.data import (
    PromptLimit,
    eval_examples,
    iterator_state,
    make_reward_fn,
    prompt_dataset,
    resume_iterator,
    try_reward_fn,
)
from sparserl_jax.decoupled import processes
from sparserl_jax.decoupled.config import check_partial_cache, refuse_adaptive_kv
from sparserl_jax.decoupled.evaluate import Evaluator
from sparserl_jax.decoupled.exchange import Exchange, Rollout
from sparserl_jax.decoupled.ledger import Ledger
from sparserl_jax.decoupled.pulse import Pulse
from sparserl_jax.decoupled.queue import WorkQueue
from sparserl_jax.decoupled.records import token_staleness
from sparserl_jax.metrics import (
    MetricsWriter,
    evaluation_on_record,
    record_evaluation,
    step_metrics,
    summarise_rewards,
    truncate_metrics,
)
from sparserl_jax.parallel import make_mesh
from sparserl_jax.rl import Learner
from sparserl_jax.rollout import RolloutResult
from sparserl_jax.sft import drop_progress, run_warm_start
from sparserl_jax.step import learn_step
from sparserl_jax.storage import is_url, run_path, write_text
from sparserl_jax.sync import Publisher, new_run_id
from sparserl_jax.train import check_config

__all__ = ["exchange_url", "run_trainer"]


def exchange_url(cfg: Config) -> str | dict:
    """`exchange.url`, or `<run_dir>/exchange/` (`file://` and absolute for a local run_dir); an
    `s3://` url with an
    `exchange.endpoint` as the kvstore spec that names the server."""
    xcfg = cfg.exchange
    if not xcfg.url:
        root = run_path(cfg.run_dir)
        return f"{root}/exchange/" if is_url(cfg.run_dir) else f"file://{root}/exchange/"
    if xcfg.endpoint is None:
        return xcfg.url
    bucket, _, path = xcfg.url.removeprefix("s3://").partition("/")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return {
        "driver": "s3",
        "bucket": bucket,
        "path": path,
        "endpoint": xcfg.endpoint,
        "aws_region": region,
    }


def _restore(cfg: Config, learner: Learner, model, tokenizer, ckpt, ex: Exchange, log_fn):
    """(state, meta) from the newest checkpoint of this run's lineage (`superseded_at`), or a
    warm start saved as step 0."""
    if cfg.train.resume and ckpt.steps():
        refuse = lambda meta: ex.superseded_at(meta.get("epoch"), int(meta["step"]))  # noqa: E731
        restored = ckpt.restore_latest({"learner": learner.init(model)}, refuse)
        if restored is not None:
            log_fn(f"resumed from {ckpt.directory} at step {restored[1]['step']}")
            return restored[0]["learner"], restored[1]
    if cfg.sft.steps:
        run_warm_start(model, cfg.sft, cfg.data, tokenizer, cfg.run_dir, log=log_fn)
    state = learner.init(model)
    meta = {"step": 0, "data_state": None, "sync_version": 0, "sync_run_id": new_run_id()}
    ckpt.save(0, {"learner": state}, meta)
    ckpt.wait()
    drop_progress(cfg.run_dir)  # step 0 holds the warm start now
    return state, meta


class _Usable:
    """The verdict on a rollout: (ok, drop reason, staleness). Usable iff its weights are in
    this run's lineage, at most `max_staleness` versions behind, and digest-identical to what
    the trainer published as that version."""

    def __init__(self, exchange: Exchange, epoch: int, max_staleness: int):
        self.max_staleness = max_staleness
        self.digests: dict[int, str] = {}
        self.version = 0
        # Version w of incarnation e is in the lineage iff every later incarnation started
        # from a version >= w (a restart keeps versions up to its checkpoint, no later ones).
        # (An incarnation superseded while starting has no start version: it published nothing.)
        records = {e: exchange.epoch_record(e) for e in exchange.epochs()}
        self.starts = {e: r["start_version"] for e, r in records.items() if "start_version" in r}
        self.epoch = epoch

    def __call__(self, r: Rollout) -> tuple[bool, str, int]:
        """Judged on every version it used (weights taken mid-rollout): the newest must be in
        the lineage, the oldest within `max_staleness`, each one's digest the published one."""
        used = r.used()
        staleness, newest = self.version - min(used), max(used)
        later = [v for e, v in self.starts.items() if r.epoch < e <= self.epoch]
        if newest > min(later, default=newest) or newest > self.version:
            return False, "orphaned", staleness
        if staleness > self.max_staleness:
            return False, "stale", staleness
        if any(self.digests.get(v) != d for v, d in used.items()):
            return False, "unverified", staleness
        return True, "", staleness


def run_trainer(cfg: Config, *, log_fn=print, exchange: Exchange | None = None) -> dict:
    """Run the decoupled trainer for `cfg` until `train.steps`; returns the summary."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, topology="colocated"))
    refuse_adaptive_kv(cfg.rollout)
    check_partial_cache(cfg.async_, cfg.rollout)
    check_config(cfg)
    if processes.multi_process():  # several processes: refused parts first, then the roles
        processes.refuse(cfg)
        if jax.process_index() != 0:
            return _run_follower(cfg, log_fn=log_fn)
    run_dir = run_path(cfg.run_dir)  # a local directory or a URL (`storage`)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "config.json", json.dumps(to_dict(cfg), indent=1))
    if exchange is None:
        exchange = Exchange(exchange_url(cfg), retries=cfg.exchange.retries)
    ex = exchange
    ex.check_conditional_writes()
    # Register this incarnation before reading the checkpoint, and fence the handle to it: a
    # trainer started earlier (or one that wakes up) stops at its next write.
    parts = jax.process_count() if processes.multi_process() else None
    epoch = ex.begin_epoch({"pid": os.getpid(), "starting": True, "sync_parts": parts})
    ex.fence(epoch)
    # Beat from the start: samplers see a trainer alive through the restore and the warm start
    # (and a relaunched run's new beat replaces the last one's `done`).
    pulse = Pulse(ex, cfg.exchange.lease_s, steps=cfg.train.steps, period=cfg.exchange.pulse_s)
    pulse.start()
    try:
        return _run(cfg, ex, epoch, pulse, log_fn)
    finally:
        pulse.finish(done=False)  # a no-op after the run's own last beat


def _run(cfg: Config, ex: Exchange, epoch: int, pulse: Pulse, log_fn) -> dict:
    tcfg, acfg, xcfg = cfg.train, cfg.async_, cfg.exchange
    run_dir = run_path(cfg.run_dir)
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    # Every prompt is read (and a long one skipped or refused) before the model is built.
    limit = PromptLimit(tokenizer, cfg.rollout.max_prompt_len)
    prompts, _ = prompt_dataset(cfg.data, limit=limit)
    try_reward_fn(cfg.data, prompts)
    held_out = (
        eval_examples(cfg.data, tcfg.eval_examples, limit=limit) if tcfg.eval_examples else []
    )
    mesh = make_mesh(cfg.mesh, jax.devices())
    model = build_model(cfg.model, mesh)
    learner = Learner(model, cfg.learner, mesh=mesh)
    ckpt = CheckpointManager(cfg.run_dir, keep=tcfg.keep_checkpoints, async_save=False)
    state, meta = _restore(cfg, learner, model, tokenizer, ckpt, ex, log_fn)
    start_step, version = int(meta["step"]), int(meta.get("sync_version", 0))
    qstate = meta.get("async")
    # Recorded (fenced) before the files are cut: a checkpoint an older epoch saves from now on
    # after this step is refused (`Exchange.superseded_at`), and a newer epoch stops this one.
    ex.update_epoch(
        epoch, {"start_version": version, "step": start_step, "pid": os.getpid(), "starting": False}
    )
    ledger = Ledger(run_dir, epoch=epoch)  # its rows stamped, its start marked
    ledger.truncate(qstate["ledger"] if qstate else {})
    kept = truncate_metrics(run_dir, start_step)
    if processes.multi_process():  # every process publishes its shards (`sync.parts`)
        run_id = meta.get("sync_run_id")
        processes.share_start(
            {"epoch": epoch, "step": start_step, "version": version, "run_id": run_id}
        )
        publisher = processes.publisher(ex, epoch, cfg, version, run_id)
    else:
        publisher = Publisher(
            ex.sync_transport(epoch),
            config=cfg.sync,
            start_version=version,
            run_id=meta.get("sync_run_id"),
        )
    publisher.publish(state.params)
    events = processes.Events(ex, epoch)
    usable = _Usable(ex, epoch, acfg.max_staleness)
    usable.digests = {int(k): v for k, v in meta.get("digests", {}).items()}
    usable.digests[publisher.version] = publisher.state_digest
    usable.version = publisher.version
    queue = WorkQueue(
        ex,
        ledger,
        resume_iterator(prompts, meta.get("data_state")),
        tokenizer,
        epoch=epoch,
        seed=tcfg.seed,
        max_prompt_len=cfg.rollout.max_prompt_len,
        max_staleness=acfg.max_staleness,
        lease_s=xcfg.lease_s,
        groups_per_item=acfg.groups_per_item,
        state=qstate,
        log_fn=log_fn,
    )
    reward_fn = make_reward_fn(cfg.data)
    writer = MetricsWriter(run_dir, tensorboard=tcfg.tensorboard)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "start_step": start_step}
    args = (cfg, learner, model, state.params, mesh, tokenizer, reward_fn, held_out)
    evaluator = Evaluator(*args) if tcfg.eval_examples else None

    def evaluate(step: int, when: str | None) -> dict[str, Any]:
        val = evaluator(publisher.transport) if evaluator is not None else {}
        if when is not None:
            record_evaluation(summary, val, step, when, log_fn)
        return val

    pulse.follow(epoch, start_step, publisher.version)
    log_fn(f"trainer: epoch {epoch}, step {start_step}, version {version}, exchange {ex.url}")
    # Resumed where an evaluation is on record (`evaluation_on_record`): taken, not decoded.
    before_at, before, row_written = evaluation_on_record(kept, start_step)
    row_missing = not row_written
    if on_record := bool(before):
        record_evaluation(summary, before, before_at, "before", log_fn)
    elif (before := evaluate(start_step, "before")) and row_missing:
        writer.write(start_step, before)
    written = bool(before) and before_at == start_step and (on_record or row_missing)

    def save(step: int) -> None:
        ex.check_fence()  # a superseded trainer writes no checkpoint
        aside = processes.older_checkpoint(ckpt, step, epoch)
        events.save(step, aside)
        if aside:
            log_fn(f"checkpoint step {step}: {ckpt.move_aside(step)} (a superseded trainer's)")
        keep = range(publisher.version - acfg.max_staleness, publisher.version + 1)
        meta = {
            "epoch": epoch,
            "data_state": iterator_state(queue.data_it),
            "sync_version": publisher.version,
            "sync_run_id": publisher.run_id,
            "async": queue.state(),
            "digests": {str(v): d for v, d in usable.digests.items() if v in keep},
        }
        ledger.flush()  # the rows the checkpoint counts are stored before it
        ckpt.save(step, {"learner": state}, meta)
        ckpt.wait()
        saved.append(step)
        queue.collect()  # the checkpoint holds their verdicts

    step, staleness_seen, rewards_seen, saved = start_step, [], [], [start_step]
    # SIGTERM and SIGINT (`launch` forwards Ctrl-C): finish the step, checkpoint, stop.
    with PreemptionGuard((signal.SIGTERM, signal.SIGINT)) as guard:
        while step < tcfg.steps and not guard.requested:
            t_step = time.perf_counter()
            got, t_wait = None, 0.0
            while got is None and not guard.requested:
                pulse.check()  # superseded: stop here, before any write
                queue.fill(publisher.version)
                got = queue.ready_batch(step + 1, publisher.version, usable)
                if got is None:
                    time.sleep(xcfg.poll_s)
                    t_wait = time.perf_counter() - t_step
            if got is None:
                break
            step += 1
            items, rollouts = got
            result = RolloutResult.concat([r.result for r in rollouts])
            staleness_i = [publisher.version - r.weight_version for r in rollouts]
            tokens = token_staleness(result, publisher.version)
            events.step(step, items, rollouts)
            out = learn_step(
                cfg,
                learner,
                state,
                publisher,
                reward_fn,
                tokenizer,
                examples=[e for item in items for e in item.examples],
                result=result,
                step=step,
            )
            state = out.state
            pulse.step, pulse.version = step, publisher.version
            usable.version = publisher.version
            usable.digests[publisher.version] = publisher.state_digest
            staleness_seen += staleness_i
            rewards_seen.append(float(out.rewards.mean()))
            queue.consumed(
                [
                    {
                        "step": step,
                        "sampler": r.sampler,
                        "weight_version": r.weight_version,
                        "staleness": s,
                        "verified": True,
                        "epoch": epoch,
                        "rollout_epoch": r.epoch,
                    }
                    for r, s in zip(rollouts, staleness_i, strict=True)
                ]
            )
            t_total = time.perf_counter() - t_step
            row = step_metrics(
                rewards=out.rewards,
                advantages=out.advantages,
                rollout=result,
                max_new_tokens=cfg.rollout.max_new_tokens,
                history=out.history,
                published=out.published,
                sync_events=[],
                timings={"wait": t_wait, **out.timings, "step": t_total},
            )
            row.update(out.extra)
            if cfg.rollout.sparse:
                row["rollout/kv_budget"] = cfg.rollout.kv.budget  # fixed: `refuse_adaptive_kv`
            row.update(
                {
                    "sync/verified": True,  # the rollout's weights digest matched (`_Usable`)
                    "async/staleness": float(np.mean(staleness_i)),
                    **tokens,
                    "async/staleness_mean": float(np.mean(staleness_seen)),
                    "async/staleness_max": int(max(staleness_seen)),
                    "async/dropped_stale": queue.counts["stale"],
                    "async/expired_claims": queue.counts["expired"],
                    "async/dropped": sum(queue.counts.values()),
                    "async/trainer_wait_s": t_wait,
                    "async/samplers_alive": pulse.samplers_alive(),
                    "async/samplers": len({r.sampler for r in rollouts}),
                    "async/items": len(rollouts),
                    "perf/steps_per_s": 1.0 / max(t_total, 1e-9),
                }
            )
            # The correction's metrics again under the staleness they were measured at.
            split = "correction_fresh/" if max(staleness_i) == 0 else "correction_stale/"
            row.update({split + k[11:]: v for k, v in row.items() if k.startswith("correction/")})
            if tcfg.eval_every and step % tcfg.eval_every == 0 and step < tcfg.steps:
                row.update(evaluate(step, None))
            writer.write(step, row)
            ledger.flush()
            if step % tcfg.save_every == 0 or step == tcfg.steps or guard.requested:
                save(step)
    if saved[-1] != step:  # stopped by a signal while waiting for a rollout
        save(step)
    events.stop(step)
    write_text(run_dir / "pending.json", json.dumps(queue.pending_batches()))
    done = not guard.requested
    if done:
        if step == before_at and before:  # no step ran: the same weights
            record_evaluation(summary, val := before, step, "after", log_fn)
        else:
            val = evaluate(step, "after")
        if val and (step > start_step or not written):  # not twice for the same weights
            writer.write(step, val)
    pulse.finish(done)
    writer.close()
    ckpt.close()
    summary |= {
        "end_step": step,
        "epoch": epoch,
        "sync_version": publisher.version,
        "dropped": dict(queue.counts),
        "metrics": str(writer.path),
    }
    summarise_rewards(summary, rewards_seen, cfg.rollout.temperature, start_step, step, log_fn)
    if staleness_seen:
        summary["staleness_mean"] = float(np.mean(staleness_seen))
    if not done:
        log_fn(f"stopped by signal at step {step}; checkpoint saved")
        summary["stopped_by_signal"] = True
    return summary


def _run_follower(cfg: Config, *, log_fn=print) -> dict[str, Any]:
    """A trainer process other than 0: the leader's steps, checkpoints and publishes, in step
    (`processes.py`)."""
    ex = Exchange(exchange_url(cfg), retries=cfg.exchange.retries)
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    mesh = make_mesh(cfg.mesh, jax.devices())
    model = build_model(cfg.model, mesh)
    learner = Learner(model, cfg.learner, mesh=mesh)
    ckpt = CheckpointManager(cfg.run_dir, keep=cfg.train.keep_checkpoints, async_save=False)
    state, _ = _restore(cfg, learner, model, tokenizer, ckpt, ex, log_fn)
    start = processes.share_start(None)
    ex.fence(start["epoch"])  # a newer trainer's start stops this one at its next event
    pub = processes.publisher(ex, start["epoch"], cfg, start["version"], start["run_id"])
    pub.publish(state.params)
    reward_fn = make_reward_fn(cfg.data)
    xcfg = cfg.exchange
    events = processes.Events(ex, start["epoch"], poll_s=xcfg.poll_s, lease_s=xcfg.lease_s)
    me, step = jax.process_index(), start["step"]
    log_fn(f"trainer process {me}: epoch {start['epoch']}, step {step}, following process 0")
    while (ev := events.next())["kind"] != "stop":
        if ev["kind"] == "save":
            if ev.get("aside"):
                ckpt.move_aside(ev["step"])
            ckpt.save(ev["step"], {"learner": state}, {})  # the leader's meta is the one kept
            ckpt.wait()
            continue
        items = [ex.item(i) for i in ev["items"]]
        rollouts = [ex.rollout(i, sha256=s) for i, s in zip(ev["items"], ev["sha256"], strict=True)]
        if None in rollouts:
            raise RuntimeError(f"the rollouts of items {ev['items']} are no longer all there")
        step = ev["step"]
        state = learn_step(
            cfg,
            learner,
            state,
            pub,
            reward_fn,
            tokenizer,
            examples=[e for item in items for e in item.examples],
            result=RolloutResult.concat([r.result for r in rollouts]),
            step=step,
        ).state
    ckpt.close()
    return {"process": me, "end_step": step, "sync_version": pub.version}
