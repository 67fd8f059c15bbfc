"""The trainer's side of the work-item protocol: issuing items, judging rollouts, expiring
claims, re-issuing what was dropped, and the state a checkpoint needs to resume all of it.

A work item is a few prompts' groups (`async.groups_per_item`), not a batch. The trainer keeps
at most `max_staleness + 1` batches in flight, in data order, and trains on the oldest once
every one of its items has a usable rollout: batches are assembled in issue order, never from
whichever groups came back first (that would train more often on fast, easy prompts).

Pacing: the batch `j` places from the head is trained at `j` versions from now, so its items
may be sampled with weights at most `max_staleness` older than that (`min_version`); a sampler
claims only items its weights are new enough for, so no rollout arrives stale.

The trainer is the only judge of an item: it consumes it or drops it (expired, corrupt,
unverified, orphaned, abandoned; stale only if pacing was defeated), writes the ledger row and
closes the item in the exchange. Samplers only ever claim items and add rollouts, so no verdict
can race with another. A dropped item is re-issued at once with the same prompts and seeds, in
the same place of its batch.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from sparserl_jax.data import encode_prompts
from sparserl_jax.decoupled.exchange import CorruptRolloutError, Exchange, Rollout, WorkItem
from sparserl_jax.decoupled.ledger import Ledger
from sparserl_jax.sampler import step_seeds

__all__ = ["WorkQueue"]


class WorkQueue:
    """Batches in flight (`batches`, in data order: each its data batch number and the ids of
    its items in prompt order). Item ids are never reused, even across trainer restarts. Data
    batch `b`'s prompts sample with `step_seeds(seed, b + 1, batch_size)`, the seeds of
    `sparserl train`'s step `b + 1`, which trains on the same batch."""

    def __init__(
        self,
        exchange: Exchange,
        ledger: Ledger,
        data_it,
        tokenizer,
        *,
        epoch: int,
        seed: int,
        max_prompt_len: int,
        max_staleness: int,
        lease_s: float,
        groups_per_item: int = 1,
        state: dict[str, Any] | None = None,
        log_fn=print,
    ):
        self.ex, self.ledger, self.data_it, self.tokenizer = exchange, ledger, data_it, tokenizer
        self.epoch, self.seed, self.max_prompt_len = epoch, seed, max_prompt_len
        self.max_staleness, self.lease_s, self.log = max_staleness, lease_s, log_fn
        self.groups_per_item = groups_per_item
        state = state or {}
        if state and "batches" not in state:
            raise ValueError(
                "the checkpoint's work queue is from an older release (one work item per "
                "batch): finish that run with the release that started it, or use a new run_dir"
            )
        self.next_item = int(state.get("next_item", 0))
        self.next_batch = int(state.get("next_batch", 0))
        self.batches: list[dict[str, Any]] = [
            {"batch": int(b["batch"]), "items": [int(i) for i in b["items"]]}
            for b in state.get("batches", [])
        ]
        self.items: dict[int, WorkItem] = {}
        self.got: dict[int, Rollout] = {}  # in-flight items' rollouts judged usable so far
        self.counts = collections.Counter()
        self.judged: list[int] = []  # since the last `collect`
        self._claims: dict[int, tuple[bytes, float]] = {}
        self._unclaimed: dict[int, float] = {}  # in flight, nobody's claim seen: since when
        for i in self.in_flight():
            item = exchange.item(i)
            if item is None:  # written before the checkpoint that lists it: only a wiped exchange
                raise RuntimeError(f"work item {i} of the checkpoint is missing from the exchange")
            self.items[i] = item
            # A dead incarnation may have judged it after its checkpoint: its verdicts are void
            # (its ledger rows were cut back), so the item is open again.
            exchange.reopen_item(i)
        # Items a dead incarnation issued after its last checkpoint (new batches, or re-issues):
        # their batches come again from the checkpointed data state or are still in flight
        # under their checkpointed ids, so they are closed, never consumed.
        later = [i for i in exchange.item_ids() if i >= self.next_item]
        for i in later:
            item = exchange.item(i)
            self._drop(i, "abandoned", step=None, batch=None if item is None else item.batch)
        self.next_item = max([self.next_item, *(i + 1 for i in later)])
        # What earlier incarnations judged before this checkpoint (and did not collect).
        live = set(self.in_flight())
        self.judged += [
            i for i in exchange.ready_rollouts() if i < self.next_item and i not in live
        ]

    def in_flight(self) -> list[int]:
        """Items of the batches in flight, in issue order (batch, then place in the batch)."""
        return [i for b in self.batches for i in b["items"]]

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds (with the data iterator's own state beside it)."""
        return {
            "next_item": self.next_item,
            "next_batch": self.next_batch,
            "batches": [{"batch": b["batch"], "items": list(b["items"])} for b in self.batches],
            "ledger": self.ledger.position(),
        }

    def pending_batches(self) -> list[int]:
        """Data batches issued and not consumed."""
        return [b["batch"] for b in self.batches]

    # -- issuing ------------------------------------------------------------------------------

    def _min_version(self, version: int, place: int) -> int:
        """The batch `place` from the head trains at `version + place`: its rollouts may be
        at most `max_staleness` older."""
        return max(0, version + place - self.max_staleness)

    def _issue(self, item: WorkItem) -> int:
        item = dataclasses.replace(item, id=self.next_item, epoch=self.epoch)
        self.ex.put_item(item)
        self.next_item += 1
        self.items[item.id] = item
        return item.id

    def fill(self, version: int) -> None:
        """Issue batches until `max_staleness + 1` are in flight, each as items of
        `groups_per_item` prompts."""
        g = self.groups_per_item
        while len(self.batches) < self.max_staleness + 1:
            place, b = len(self.batches), self.next_batch
            examples = list(next(self.data_it).examples)
            self.next_batch += 1
            prompts = encode_prompts(examples, self.tokenizer, max_len=self.max_prompt_len)
            seeds = step_seeds(self.seed, b + 1, len(prompts))
            entry = {"batch": b, "items": []}
            self.batches.append(entry)
            for first in range(0, len(prompts), g):
                item = WorkItem(
                    id=-1,
                    batch=b,
                    epoch=self.epoch,
                    prompts=prompts[first : first + g],
                    seeds=seeds[first : first + g],
                    examples=examples[first : first + g],
                    min_version=self._min_version(version, place),
                    first=first,
                    batch_size=len(prompts),
                )
                entry["items"].append(self._issue(item))

    def _reissue(self, i: int, version: int) -> None:
        """Item `i` again under a new id, in its place: same prompts and seeds."""
        for place, entry in enumerate(self.batches):
            if i in entry["items"]:
                old = self.items[i]
                floor = max(old.min_version, self._min_version(version, place))
                new = dataclasses.replace(old, min_version=floor, reissue_of=i)
                entry["items"][entry["items"].index(i)] = self._issue(new)
                return

    # -- judging ------------------------------------------------------------------------------

    def _drop(self, i: int, reason: str, *, step, batch, version=None, **extra) -> None:
        """Close item `i` as dropped; re-issue it when `version` is given."""
        # The verdict first: it checks the fence, so a superseded trainer appends no ledger row.
        self.ex.close_item(i, f"dropped:{reason}")
        self.ledger.append(
            "dropped", {"item": i, "step": step, "batch": batch, "reason": reason, **extra}
        )
        self.judged.append(i)
        self.counts[reason] += 1
        self.got.pop(i, None)
        self._claims.pop(i, None)
        self._unclaimed.pop(i, None)
        if version is not None:
            self._reissue(i, version)
        self.items.pop(i, None)  # judged: a resume reads what it needs from the exchange

    def ready_batch(
        self, step: int, version: int, usable
    ) -> tuple[list[WorkItem], list[Rollout]] | None:
        """The oldest batch in flight once every item of it has a usable READY rollout: its
        items and their rollouts in prompt order; else None. Rollouts that are corrupt or that
        `usable(rollout) -> (ok, reason, staleness)` refuses are dropped here, in any batch in
        flight (their items re-issued at once); so are items whose claim stopped being renewed."""
        ready = self.ex.ready_rollouts()
        # Expiry first: a lapsed claim must not wait for a moment when nothing else is ready.
        self._expire(step, version, ready)
        for i in self.in_flight():
            if i not in self.got and i in ready:
                try:
                    self._judge(i, self.ex.rollout(i), step, version, usable)
                except CorruptRolloutError as e:
                    self.log(f"item {i}: {e}; dropped and re-issued")
                    self._drop(i, "corrupt", step=step, batch=self.items[i].batch, version=version)
        if not self.batches:
            return None
        head = list(self.batches[0]["items"])
        if any(i not in self.got for i in head):
            return None
        # Judged again at the version it trains at (pacing makes this hold; never assume it).
        for i in head:
            self._judge(i, self.got[i], step, version, usable)
        if any(i not in self.got for i in head):
            return None
        return [self.items[i] for i in head], [self.got[i] for i in head]

    def _judge(self, i: int, rollout: Rollout, step: int, version: int, usable) -> None:
        ok, reason, staleness = usable(rollout)
        if ok:
            self.got[i] = rollout
            return
        self._drop(
            i,
            reason,
            step=step,
            batch=self.items[i].batch,
            version=version,
            sampler=rollout.sampler,
            weight_version=rollout.weight_version,
            staleness=staleness,
        )

    def _expire(self, step: int, version: int, ready: set[int]) -> None:
        """Drop (and re-issue) claimed items whose claim has not changed for `lease_s` seconds
        of this process's clock: the claimer stopped renewing it (killed, hung or cut off).
        An item nobody has claimed for `lease_s` is read once per `lease_s`: if it is closed,
        a superseded trainer's verdict came late (docs/decoupled.md), so it is opened again."""
        now = time.monotonic()
        claimed = self.ex.claimed_ids()
        for i in self.in_flight():
            if i in ready:
                continue
            if i not in claimed:
                if now - self._unclaimed.setdefault(i, now) >= self.lease_s:
                    self._unclaimed[i] = now
                    if not self.ex.is_open(i):
                        self.log(f"item {i}: closed by a superseded trainer; opened again")
                        self.ex.reopen_item(i)
                continue
            self._unclaimed.pop(i, None)
            claim, gen = self.ex.claim_state(i)
            if claim is None:
                continue
            seen = self._claims.get(i)
            if seen is None or seen[0] != gen:
                self._claims[i] = (gen, now)
            elif now - seen[1] >= self.lease_s:
                self.log(f"item {i}: claim of sampler {claim['sampler']} expired; re-issued")
                self.ex.revoke(i, gen)  # a sampler still alive stops working on it
                batch = self.items[i].batch
                sampler = claim["sampler"]
                self._drop(i, "expired", step=step, batch=batch, version=version, sampler=sampler)

    def consumed(self, rows: list[dict[str, Any]]) -> None:
        """The head batch was trained on: one ledger row per item (`rows`, in item order)."""
        entry = self.batches.pop(0)
        for i, row in zip(entry["items"], rows, strict=True):
            item = self.items[i]
            self.ex.close_item(i, "consumed")  # fenced, before the ledger row (see `_drop`)
            self.ledger.append(
                "consumed",
                {
                    "item": i,
                    "batch": item.batch,
                    "first": item.first,
                    "prompts": len(item.prompts),
                    "batch_size": item.batch_size,
                    **row,
                },
            )
            self.got.pop(i, None)
            self._claims.pop(i, None)
            self._unclaimed.pop(i, None)
            self.items.pop(i, None)
            self.judged.append(i)

    def collect(self) -> None:
        """Delete the rollouts and claims of the items judged so far: call it once a checkpoint
        holds their verdicts (a resumed trainer never looks at them again)."""
        for i in self.judged:
            self.ex.collect(i)
        self.judged.clear()
