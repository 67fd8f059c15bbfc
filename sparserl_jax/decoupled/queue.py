"""The trainer's side of the work-item protocol: issuing items, judging rollouts, expiring
claims, re-issuing what was dropped, and the state a checkpoint needs to resume all of it.

The trainer is the only judge of an item: it consumes it or drops it (stale, expired, corrupt,
unverified, abandoned), writes the ledger row and closes the item in the exchange. Samplers only
ever claim items and add rollouts, so no verdict can race with another.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from sparserl_jax.data import encode_prompts
from sparserl_jax.decoupled.exchange import CorruptRolloutError, Exchange, Rollout, WorkItem
from sparserl_jax.decoupled.ledger import Ledger
from sparserl_jax.sampler import step_seeds

__all__ = ["WorkQueue"]


class WorkQueue:
    """Items issued and not yet judged (`outstanding`, in issue order) and prompts waiting to be
    re-issued. Item ids are never reused, even across trainer restarts; a re-issued item keeps
    its data batch number. Seeds are `step_seeds(seed, id + 1, n)`: with no drops item `k` is
    consumed at step `k + 1` and samples exactly as `sparserl train`'s step `k + 1`."""

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
        state: dict[str, Any] | None = None,
        log_fn=print,
    ):
        self.ex, self.ledger, self.data_it, self.tokenizer = exchange, ledger, data_it, tokenizer
        self.epoch, self.seed, self.max_prompt_len = epoch, seed, max_prompt_len
        self.max_staleness, self.lease_s, self.log = max_staleness, lease_s, log_fn
        state = state or {}
        self.next_item = int(state.get("next_item", 0))
        self.next_batch = int(state.get("next_batch", 0))
        self.outstanding: list[int] = list(state.get("outstanding", []))
        self.reissue: collections.deque[int] = collections.deque(state.get("reissue", []))
        self.items: dict[int, WorkItem] = {}
        self.counts = collections.Counter()
        self.judged: list[int] = []  # since the last `collect`
        self._claims: dict[int, tuple[bytes, float]] = {}
        for i in self.outstanding:
            item = exchange.item(i)
            if item is None:  # written before the checkpoint that lists it: only a wiped exchange
                raise RuntimeError(f"work item {i} of the checkpoint is missing from the exchange")
            self.items[i] = item
        # A dead incarnation may have judged some of these after its checkpoint: its verdicts
        # are void (its ledger rows were cut back), so the items are open again.
        for i in [*self.outstanding, *self.reissue]:
            exchange.reopen_item(i)
        # Items a dead incarnation issued after its last checkpoint: their batches come again
        # from the checkpointed data state, so they are closed, never consumed.
        later = [i for i in exchange.item_ids() if i >= self.next_item]
        for i in later:
            item = exchange.item(i)
            self._drop(i, "abandoned", step=None, batch=None if item is None else item.batch)
        self.next_item = max([self.next_item, *(i + 1 for i in later)])
        # What earlier incarnations judged before this checkpoint (and did not collect).
        live = {*self.outstanding, *self.reissue}
        self.judged += [
            i for i in exchange.ready_rollouts() if i < self.next_item and i not in live
        ]

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds (with the data iterator's own state beside it)."""
        return {
            "next_item": self.next_item,
            "next_batch": self.next_batch,
            "outstanding": list(self.outstanding),
            "reissue": list(self.reissue),
            "ledger": self.ledger.position(),
        }

    def pending_batches(self) -> list[int]:
        """Batches issued (or waiting for re-issue) and not consumed."""
        out = [self.items[i].batch for i in self.outstanding]
        return sorted(out + [self._old_item(i).batch for i in self.reissue])

    def _old_item(self, i: int) -> WorkItem:
        if i not in self.items:
            item = self.ex.item(i)
            if item is None:
                raise RuntimeError(f"dropped work item {i} is missing from the exchange")
            self.items[i] = item
        return self.items[i]

    # -- issuing ------------------------------------------------------------------------------

    def fill(self, version: int) -> None:
        """Issue items until `max_staleness + 1` are outstanding: the j-th (0-based) is planned
        for `j` versions from now and may be sampled with weights `max_staleness` older."""
        while len(self.outstanding) < self.max_staleness + 1:
            j = len(self.outstanding)
            reissue_of = self.reissue.popleft() if self.reissue else None
            if reissue_of is not None:
                old = self._old_item(reissue_of)
                examples, batch = old.examples, old.batch
            else:
                examples, batch = list(next(self.data_it).examples), self.next_batch
                self.next_batch += 1
            prompts = encode_prompts(examples, self.tokenizer, max_len=self.max_prompt_len)
            i = self.next_item
            item = WorkItem(
                id=i,
                batch=batch,
                epoch=self.epoch,
                prompts=prompts,
                seeds=step_seeds(self.seed, i + 1, len(prompts)),
                examples=list(examples),
                min_version=max(0, version + j - self.max_staleness),
                reissue_of=reissue_of,
            )
            self.ex.put_item(item)
            self.next_item += 1
            self.items[i] = item
            self.outstanding.append(i)

    # -- judging ------------------------------------------------------------------------------

    def _drop(self, i: int, reason: str, *, step, batch, reissue=False, **extra) -> None:
        # The verdict first: it checks the fence, so a superseded trainer appends no ledger row.
        self.ex.close_item(i, f"dropped:{reason}")
        self.ledger.append(
            "dropped", {"item": i, "step": step, "batch": batch, "reason": reason, **extra}
        )
        self.judged.append(i)
        self.counts[reason] += 1
        if i in self.outstanding:
            self.outstanding.remove(i)
        if reissue:
            self.reissue.append(i)

    def next_rollout(self, step: int, version: int, usable) -> tuple[WorkItem, Rollout] | None:
        """The oldest outstanding item with a usable READY rollout, or None. Rollouts that are
        corrupt or that `usable(rollout) -> (ok, reason, staleness)` refuses are dropped here
        (their prompts re-issued); so are items whose claim stopped being renewed."""
        ready = self.ex.ready_rollouts()
        # Expiry first: a lapsed claim must not wait for a moment when nothing else is ready.
        self._expire(step, ready)
        for i in list(self.outstanding):
            item = self.items[i]
            if i not in ready:
                continue
            try:
                rollout = self.ex.rollout(i)
            except CorruptRolloutError as e:
                self.log(f"item {i}: {e}; dropped and re-issued")
                self._drop(i, "corrupt", step=step, batch=item.batch, reissue=True)
                continue
            ok, reason, staleness = usable(rollout)
            if ok:
                return item, rollout
            self._drop(
                i,
                reason,
                step=step,
                batch=item.batch,
                reissue=True,
                sampler=rollout.sampler,
                weight_version=rollout.weight_version,
                staleness=staleness,
            )
        return None

    def _expire(self, step: int, ready: set[int]) -> None:
        """Drop (and re-issue) claimed items whose claim has not changed for `lease_s` seconds
        of this process's clock: the claimer stopped renewing it (killed, hung or cut off)."""
        now = time.monotonic()
        for i in list(self.outstanding):
            if i in ready:
                continue
            claim, gen = self.ex.claim_state(i)
            if claim is None:
                continue
            seen = self._claims.get(i)
            if seen is None or seen[0] != gen:
                self._claims[i] = (gen, now)
            elif now - seen[1] >= self.lease_s:
                self.log(f"item {i}: claim of sampler {claim['sampler']} expired; re-issued")
                self.ex.revoke(i, gen)  # a sampler still alive stops working on it
                self._drop(
                    i,
                    "expired",
                    step=step,
                    batch=self.items[i].batch,
                    reissue=True,
                    sampler=claim["sampler"],
                )

    def consumed(self, item: WorkItem, row: dict[str, Any]) -> None:
        self.ex.close_item(item.id, "consumed")  # fenced, before the ledger row (see `_drop`)
        self.ledger.append("consumed", {"item": item.id, "batch": item.batch, **row})
        self.outstanding.remove(item.id)
        self._claims.pop(item.id, None)
        self.judged.append(item.id)

    def collect(self) -> None:
        """Delete the rollouts and claims of the items judged so far: call it once a checkpoint
        holds their verdicts (a resumed trainer never looks at them again)."""
        for i in self.judged:
            self.ex.collect(i)
        self.judged.clear()
