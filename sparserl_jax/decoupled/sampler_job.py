"""`sparserl sampler --id I`: a decoupled sampler job (docs/decoupled.md).

It owns its devices and mesh and holds nothing that needs a checkpoint. Its loop:

    1. read the trainer's heartbeat: `done` at `train.steps` -> exit 0 (a `done` short of it is
       a finished run's being relaunched: wait); `starting` -> wait (the trainer restores and
       warm-starts, beating); a new trainer incarnation (epoch) -> a fresh receiver on that
       epoch's sync prefix (it starts from the new anchor);
    2. catch up through PULSESync (every applied version verified bit-identical by the
       receiver's digests, else refused);
    3. claim the oldest open item its weights are new enough for (`min_version`), by a
       conditional create: of samplers racing for an item exactly one wins;
    4. generate, renewing the claim every `exchange.lease_s / 4` from a side thread; a claim
       lost (the trainer revoked it as expired) abandons the rollout between decode chunks;
    5. write the rollout blob and its READY marker (checksum), if the claim is still held,
       renewing it through the upload.

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
from flax import nnx

from sparserl_jax.build import build_model, build_tokenizer
from sparserl_jax.config import Config
from sparserl_jax.decoupled.config import refuse_adaptive_kv
from sparserl_jax.decoupled.exchange import Claim, Exchange, Rollout
from sparserl_jax.parallel import make_mesh
from sparserl_jax.rollout import RolloutAborted
from sparserl_jax.sampler import Sampler, sampler_shardings
from sparserl_jax.sync import Receiver, SyncError

__all__ = ["GAVE_UP", "run_sampler"]

GAVE_UP = 3  # exit status: no exchange or no trainer for `exchange.give_up_s`

# What a kvstore raises when it cannot be reached or read (tensorstore maps its errors to these).
_EXCHANGE_ERRORS = (ValueError, OSError, TimeoutError, RuntimeError)


class _Renewer(threading.Thread):
    """Renews a claim (and the sampler's pulse) every `period` seconds until stopped; `claim`
    is None once lost."""

    def __init__(self, ex: Exchange, claim: Claim, period: float, pulse: dict):
        super().__init__(daemon=True)
        self.ex, self.claim, self.period, self.pulse = ex, claim, period, pulse
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period) and self.claim is not None:
            # On an error the next renewal tries again; the trainer expires it if none gets in.
            with contextlib.suppress(*_EXCHANGE_ERRORS):
                self.claim = self.ex.renew(self.claim)
                if self.claim is not None:
                    pulse = {**self.pulse, "item": self.claim.item, "time": time.time()}
                    self.ex.put_pulse(f"samplers/{self.claim.sampler}", pulse)

    def lost(self) -> bool:
        return self.claim is None

    def stop(self) -> Claim | None:
        self._stop_event.set()
        self.join()
        return self.claim


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


def _open_item(ex: Exchange, version: int | None, sampler_id: str) -> tuple[Claim, object] | None:
    """Claim the oldest open item this sampler's weights are new enough for."""
    if version is None:
        return None
    for i in ex.open_ids():  # bounded by the items in flight, not by the run's length
        if ex.is_ready(i) or ex.claim_state(i)[0] is not None:
            continue
        item = ex.item(i)
        if item is None or item.min_version > version:
            continue
        claim = ex.claim(i, sampler_id)
        if claim is not None:
            return claim, item
    return None


def run_sampler(
    cfg: Config, sampler_id: str, *, url: str, log_fn=print, exchange: Exchange | None = None
) -> dict:
    """Serve rollouts until the trainer says it is done (or give up); returns a summary with
    `exit_code` (0, or `GAVE_UP`), the items done and the versions held."""
    refuse_adaptive_kv(cfg.rollout)
    xcfg, steps = cfg.exchange, cfg.train.steps
    sampler = _build(cfg)
    waiter = _Waiter(xcfg, log_fn)
    ex, epoch, transport, checked = exchange, None, None, False
    trainer_seen: tuple[bytes, float] | None = None
    done, versions, last_pulse = [], [], 0.0
    while True:
        try:
            if ex is None:
                ex = Exchange(url, retries=xcfg.retries)
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
                epoch, transport = hb["epoch"], ex.sync_transport(hb["epoch"])
                sampler.receiver = Receiver(sampler.receiver.sharding_of)
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
            got = _open_item(ex, sampler.version, sampler_id)
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
        if got is None:
            time.sleep(xcfg.poll_s)
            continue
        claim, item = got
        # Renewed from a side thread while it generates and while it uploads.
        renewer = _Renewer(ex, claim, xcfg.lease_s / 4, pulse)
        renewer.start()
        try:
            try:  # a claim lost (revoked by the trainer, or taken over) stops the work
                result = sampler.rollout(item.prompts, item.seeds, stop=renewer.lost)
            except RolloutAborted:
                log_fn(f"sampler {sampler_id}: lost the claim on item {item.id}; abandoned it")
                continue
            rollout = Rollout(
                item.id, sampler_id, epoch, sampler.version, sampler.receiver.state_digest, result
            )
            try:
                if renewer.claim is not None and ex.is_open(item.id):
                    ex.put_rollout(rollout)
                    done.append(item.id)
            except _EXCHANGE_ERRORS as e:  # the item's claim will lapse and it is re-issued
                log_fn(f"sampler {sampler_id}: could not write the rollout of item {item.id}: {e}")
        finally:
            renewer.stop()


def _summary(sampler_id: str, code: int, done: list[int], versions: list) -> dict:
    return {"sampler": sampler_id, "exit_code": code, "items": done, "versions": versions}
