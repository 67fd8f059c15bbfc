"""`sparserl sampler --id I`: a decoupled sampler job (docs/decoupled.md).

It owns its devices and mesh and holds nothing that needs a checkpoint. Its loop:

    1. read the trainer's heartbeat: `done` at `train.steps` -> exit 0 (a `done` short of it is
       a finished run's being relaunched: wait); `starting` -> wait (the trainer restores and
       warm-starts, beating); a new trainer incarnation (epoch) -> a fresh receiver on that
       epoch's sync prefix (it starts from the new anchor);
    2. catch up through PULSESync (every applied version verified bit-identical by the
       receiver's digests, else refused);
    3. claim the oldest open items its weights are new enough for (`min_version`), its fair
       share of them (`async.sampler_groups`), each by a conditional create: of samplers
       racing for an item exactly one wins;
    4. roll them out together (one engine call), renewing the claims every
       `exchange.lease_s / 4` from a side thread; with every claim lost (the trainer revoked
       them as expired) the rollout is abandoned between decode chunks;
    5. write each item's rollout blob and READY marker (checksum), if its claim is still
       held, renewing the claims through the upload.

When the exchange cannot be reached, or the trainer's heartbeat has not changed (counted from
its latest beat), for `exchange.give_up_s` seconds it exits with status 3, logging why every
`exchange.log_every_s`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time

import jax
import numpy as np
from flax import nnx

from sparserl_jax.build import build_model, build_tokenizer
from sparserl_jax.config import Config
from sparserl_jax.decoupled.config import check_partial_cache, refuse_adaptive_kv
from sparserl_jax.decoupled.exchange import Claim, Exchange, Rollout, SamplerWatch, WorkItem
from sparserl_jax.parallel import make_mesh
from sparserl_jax.rollout import RolloutAborted
from sparserl_jax.sampler import Sampler, sampler_shardings
from sparserl_jax.sync import Receiver, SyncError
from sparserl_jax.sync.parts import PartsReceiver

__all__ = ["GAVE_UP", "run_sampler"]

GAVE_UP = 3  # exit status: no exchange or no trainer for `exchange.give_up_s`

# What a kvstore raises when it cannot be reached or read (tensorstore maps its errors to these).
_EXCHANGE_ERRORS = (ValueError, OSError, TimeoutError, RuntimeError)


class _Renewer(threading.Thread):
    """Renews claims (and the sampler's pulse) every `period` seconds until stopped; a lost
    claim becomes None in `claims`."""

    def __init__(self, ex: Exchange, claims: list[Claim], period: float, pulse: dict):
        super().__init__(daemon=True)
        self.ex, self.period, self.pulse = ex, period, pulse
        self.claims: list[Claim | None] = list(claims)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period) and not self.lost():
            for k, claim in enumerate(self.claims):
                if claim is None:
                    continue
                # On an error the next renewal tries again; the trainer expires it if none
                # gets in.
                with contextlib.suppress(*_EXCHANGE_ERRORS):
                    self.claims[k] = self.ex.renew(claim)
            held = [c for c in self.claims if c is not None]
            if held:
                items = [c.item for c in held]
                pulse = {**self.pulse, "items": items, "time": time.time()}
                with contextlib.suppress(*_EXCHANGE_ERRORS):
                    self.ex.put_pulse(f"samplers/{held[0].sampler}", pulse)

    def lost(self) -> bool:
        """Every claim lost: nothing left worth generating."""
        return all(c is None for c in self.claims)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


class _Waiter:
    """Says, every `log_every_s`, why the sampler is waiting; gives up after `give_up_s` of the
    same trouble (any progress resets it)."""

    def __init__(self, cfg, log_fn):
        self.cfg, self.log = cfg, log_fn
        self.since: float | None = None
        self._logged = self._noted = 0.0

    def ok(self) -> None:
        self.since = None

    def note(self, why: str) -> None:
        """Say, every `log_every_s`, why the sampler waits with no trouble counted."""
        now = time.monotonic()
        if now - self._noted >= self.cfg.log_every_s:
            self._noted = now
            self.log(f"sampler: waiting: {why}")

    def trouble(self, why: str) -> bool:
        """Record a failed look; True when it is time to give up."""
        now = time.monotonic()
        if self.since is None:
            self.since, self._logged = now, 0.0
        waited = now - self.since
        if now - self._logged >= self.cfg.log_every_s or self._logged == 0.0:
            self._logged = now
            self.log(
                f"sampler: waiting {waited:.0f}s (gives up at {self.cfg.give_up_s:.0f}s): {why}"
            )
        return waited >= self.cfg.give_up_s


def _build(cfg: Config) -> Sampler:
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    rcfg = cfg.rollout
    if rcfg.stop_token_ids == ():
        rcfg = dataclasses.replace(rcfg, stop_token_ids=tuple(tokenizer.eos_ids))
    mesh = make_mesh(cfg.mesh, jax.devices())
    model = build_model(cfg.model, mesh)
    params = nnx.to_pure_dict(nnx.state(model))
    return Sampler.create(
        model,
        params,
        rcfg,
        shardings=sampler_shardings(model, mesh),
        publish_dtype=cfg.sync.jnp_publish_dtype,
        mesh=mesh,
    )


class _Claimer:
    """Claims a sampler's share of the open items: the oldest its weights are new enough for
    (`min_version`), from batches whose items are all open (never a batch half issued), at
    most `limit` of them, or with `limit` 0 its fair share: the items in flight divided by
    the samplers alive (a sampler is alive while its pulse changes within `lease_s` of this
    clock), at most a batch's, so N samplers split a batch N ways and one sampler alone takes
    a batch at a time (the next with newer weights, while the trainer learns)."""

    def __init__(self, ex: Exchange, sampler_id: str, limit: int, lease_s: float):
        self.ex, self.sampler_id, self.limit = ex, sampler_id, limit
        self.items: dict[int, WorkItem] = {}  # items never change: read each once
        self.watch = SamplerWatch(ex, lease_s)

    def __call__(self, version: int | None) -> list[tuple[Claim, WorkItem]]:
        if version is None:
            return []
        open_ids = self.ex.open_ids()  # bounded by the items in flight, not the run's length
        self.items = {i: self.items[i] for i in open_ids if i in self.items}  # judged: forget
        by_batch: dict[int, list[WorkItem]] = {}
        for i in open_ids:
            if i not in self.items and (item := self.ex.item(i)) is not None:
                self.items[i] = item
            if i in self.items:
                by_batch.setdefault(self.items[i].batch, []).append(self.items[i])
        open_ids = [i for i in open_ids if i in self.items]
        whole = {b for b, its in by_batch.items() if _covers(its)}
        # Oldest batch first, in prompt order: a re-issued item (a new, higher id) of the head
        # batch goes before the later batches' items.
        free = [
            item
            for i in sorted(open_ids, key=lambda i: (self.items[i].batch, self.items[i].first))
            if (item := self.items[i]).batch in whole
            and item.min_version <= version
            and not self.ex.is_ready(i)
            and self.ex.claim_state(i)[0] is None
        ]
        if not free:
            return []
        in_flight = sum(len(its) for b, its in by_batch.items() if b in whole)
        batch = max(len(its) for b, its in by_batch.items() if b in whole)
        alive = len(self.watch.alive() | {self.sampler_id})
        share = self.limit or min(-(-in_flight // alive), batch)
        got = []
        for item in free:
            try:
                claim = self.ex.claim(item.id, self.sampler_id)
            except _EXCHANGE_ERRORS:
                if got:  # roll out what is held (else it would wait for its claims to lapse)
                    break
                raise
            if claim is not None:
                got.append((claim, item))
                if len(got) == share:
                    break
        return got


def _covers(items: list[WorkItem]) -> bool:
    """Whether `items` are all of their batch's prompts (a batch being issued, or an item of it
    dropped and not yet re-issued, is not claimed from: its rollouts would be split apart)."""
    return sum(len(item.prompts) for item in items) == items[0].batch_size


def follow_epoch(ex: Exchange, epoch: int, sampler: Sampler):
    """Give `sampler` a new receiver for trainer incarnation `epoch`'s weights; returns what its
    `sync` takes. A trainer of several processes publishes parts (its epoch record says how
    many, `sync_parts`): a `PartsReceiver` assembles them on the sampler's shardings."""
    record = ex.epoch_record(epoch) or {}
    if record.get("sync_parts"):
        sampler.receiver = PartsReceiver(sampler.receiver.sharding_of)
        return ex.sync_location(epoch)
    sampler.receiver = Receiver(sampler.receiver.sharding_of)
    return ex.sync_transport(epoch)


def run_sampler(
    cfg: Config, sampler_id: str, *, url: str, log_fn=print, exchange: Exchange | None = None
) -> dict:
    """Serve rollouts until the trainer says it is done (or give up); returns a summary with
    `exit_code` (0, or `GAVE_UP`), the items done and the versions held."""
    refuse_adaptive_kv(cfg.rollout)
    check_partial_cache(cfg.async_, cfg.rollout)
    xcfg, steps = cfg.exchange, cfg.train.steps
    sampler = _build(cfg)
    claimer = None
    waiter = _Waiter(xcfg, log_fn)
    ex, epoch, transport, checked = exchange, None, None, False
    trainer_seen: tuple[bytes, float] | None = None
    done, versions, last_pulse = [], [], 0.0
    while True:
        try:
            if ex is None:
                ex = Exchange(url, retries=xcfg.retries)
            if claimer is None:
                claimer = _Claimer(ex, sampler_id, cfg.async_.sampler_groups, xcfg.lease_s)
            if not checked:  # an unsafe store is refused at once (not retried)
                ex.check_conditional_writes()
                checked = True
            hb, gen = ex.pulse("trainer/heartbeat")
        except _EXCHANGE_ERRORS as e:
            if waiter.trouble(f"cannot reach the exchange {url}: {' '.join(str(e).split())}"):
                return _summary(sampler_id, GAVE_UP, done, versions)
            time.sleep(xcfg.poll_s)
            continue
        now = time.monotonic()
        if trainer_seen is None or trainer_seen[0] != gen:
            trainer_seen = (gen, now)
        # A `done` beat of a run shorter than this one (a finished run relaunched with more
        # steps) is the last run's: wait for the relaunched trainer's beat.
        finished = hb is not None and hb.get("done") and hb.get("step", 0) >= steps
        if finished:
            log_fn(f"sampler {sampler_id}: the trainer is done; {len(done)} items rolled out")
            return _summary(sampler_id, 0, done, versions)
        if (
            hb is None
            or hb.get("done")
            or now - trainer_seen[1] > min(xcfg.lease_s, xcfg.give_up_s)
        ):
            why = (
                "no trainer heartbeat yet" if hb is None
                else f"the trainer finished at step {hb['step']} of {steps}" if hb.get("done")
                else "the trainer's heartbeat stopped"
            )  # fmt: skip
            if waiter.trouble(f"{why} on {url}"):
                return _summary(sampler_id, GAVE_UP, done, versions)
            time.sleep(xcfg.poll_s)
            continue
        if hb.get("epoch") is None:  # starting: restoring, warm-starting; alive, so no give-up
            waiter.ok()
            waiter.note(f"the trainer is starting (step {hb.get('step', 0)})")
            time.sleep(xcfg.poll_s)
            continue
        try:
            if hb["epoch"] != epoch:  # a (re)started trainer: follow its new sync chain
                epoch, transport = hb["epoch"], follow_epoch(ex, hb["epoch"], sampler)
                log_fn(f"sampler {sampler_id}: following trainer epoch {epoch}")
            for e in sampler.sync(transport):
                state = "verified bit-identical" if e.error is None else f"refused: {e.error}"
                log_fn(f"sampler {sampler_id}: {e.kind} {e.version} {state}")
                if e.error is None:
                    versions.append((epoch, e.version))
            pulse = {"version": sampler.version, "epoch": epoch, "pid": os.getpid()}
            if now - last_pulse >= xcfg.pulse_s:
                last_pulse = now
                ex.put_pulse(f"samplers/{sampler_id}", {**pulse, "time": time.time()})
            got = claimer(sampler.version)
        except SyncError as e:  # e.g. the anchor not written yet: look again
            if waiter.trouble(f"cannot sync weights: {e}"):
                return _summary(sampler_id, GAVE_UP, done, versions)
            time.sleep(xcfg.poll_s)
            continue
        except _EXCHANGE_ERRORS as e:
            if waiter.trouble(f"exchange error: {' '.join(str(e).split())}"):
                return _summary(sampler_id, GAVE_UP, done, versions)
            time.sleep(xcfg.poll_s)
            continue
        waiter.ok()
        if not got:
            time.sleep(xcfg.poll_s)
            continue
        partial = cfg.async_.partial_rollouts and cfg.async_.max_staleness > 0
        refresh = _Refresh(sampler, ex, transport, epoch, xcfg.poll_s, log_fn) if partial else None
        _roll_out(sampler, ex, got, sampler_id, epoch, pulse, cfg, done, log_fn, refresh)


class _Refresh:
    """Between decode chunks (at most every `poll_s`): when the trainer's heartbeat names a
    newer version of the epoch followed (one small read), sync it, so the sequences in flight
    continue with it (partial rollouts). Remembers every version used and its digest; a failed
    look (exchange, sync) keeps the weights held."""

    def __init__(self, sampler: Sampler, ex: Exchange, transport, epoch: int, poll_s, log_fn):
        self.sampler, self.ex, self.transport, self.epoch = sampler, ex, transport, epoch
        self.poll_s, self.log, self._last = poll_s, log_fn, time.monotonic()
        self.used = {sampler.version: sampler.receiver.state_digest}

    def __call__(self) -> bool:
        if time.monotonic() - self._last < self.poll_s:
            return False
        self._last = time.monotonic()
        before = self.sampler.version
        try:
            hb, _ = self.ex.pulse("trainer/heartbeat")
            if hb is None or hb.get("epoch") != self.epoch or hb.get("version", -1) <= before:
                return False
            events = self.sampler.sync(self.transport)
        except (SyncError, *_EXCHANGE_ERRORS):
            return False
        for e in events:
            state = "verified bit-identical" if e.error is None else f"refused: {e.error}"
            self.log(f"sampler: mid-rollout {e.kind} {e.version} {state}")
        if self.sampler.version == before:
            return False
        self.used[self.sampler.version] = self.sampler.receiver.state_digest
        return True


def _roll_out(sampler, ex, got, sampler_id, epoch, pulse, cfg, done, log_fn, refresh) -> None:
    """Roll out the claimed items together and write each one's rollout while its claim holds;
    the claims are renewed from a side thread while it generates and while it uploads."""
    renewer = _Renewer(ex, [claim for claim, _ in got], cfg.exchange.lease_s / 4, pulse)
    mode = cfg.async_.partial_cache
    recompute = mode == "recompute" or (mode == "auto" and not sampler.engine.config.sparse)
    renewer.start()
    try:
        items = [item for _, item in got]
        prompts = [p for item in items for p in item.prompts]
        seeds = [s for item in items for s in item.seeds]
        try:  # every claim lost (revoked by the trainer, or taken over) stops the work
            result = sampler.rollout(
                prompts, seeds, stop=renewer.lost, refresh=refresh, recompute_cache=recompute
            )
        except RolloutAborted:
            log_fn(f"sampler {sampler_id}: lost the claims on items {[i.id for i in items]}")
            return
        n, lo = sampler.engine.config.n_samples, 0
        for k, item in enumerate(items):
            part = result.rows(lo, lo + n * len(item.prompts))
            lo += n * len(item.prompts)
            oldest, used = int(part.weight_version.min()), None
            digest = sampler.receiver.state_digest  # no refresh: the weights held throughout
            if refresh is not None:  # the versions this item's tokens came from
                tokens = np.unique(part.token_version[part.completion_mask])
                used = {int(v): refresh.used[int(v)] for v in tokens}
                digest = used[oldest]
            rollout = Rollout(item.id, sampler_id, epoch, oldest, digest, part, used)
            try:
                if renewer.claims[k] is not None and ex.is_open(item.id):
                    ex.put_rollout(rollout)
                    done.append(item.id)
            except _EXCHANGE_ERRORS as e:  # the item's claim will lapse and it is re-issued
                log_fn(f"sampler {sampler_id}: could not write the rollout of item {item.id}: {e}")
    finally:
        renewer.stop()


def _summary(sampler_id: str, code: int, done: list[int], versions: list) -> dict:
    return {"sampler": sampler_id, "exit_code": code, "items": done, "versions": versions}
