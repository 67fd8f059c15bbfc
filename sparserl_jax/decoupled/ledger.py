"""The decoupled trainer's ledger: `consumed.jsonl` (one row per work item the learner trained
on) and `dropped.jsonl` (items dropped as stale, expired, corrupt or abandoned) in the run
directory, and the check that they prove exactly-once.

Rows are appended (flushed and fsynced; to a URL run directory, once per step) by the trainer
only. A trainer checkpoint records how many rows each file had; a resumed trainer first cuts
both files back to that position (rows of steps it is about to redo), so a resume never
duplicates a row.

An old trainer still running (frozen, then woken) checks the exchange's fence before each
verdict, but check and append are two operations: one paused between them appends its row
after its successor started. So each row carries its incarnation (`epoch`), a resumed trainer
writes its epoch as a marker row (`{"ledger_epoch": e}`) in the same atomic replace that cuts
the files back, and a row of an older incarnation found after a newer one's marker is not
counted (`rows`; `check_exactly_once` reports how many as `superseded`). The fence is kept
by whoever reads the ledger, not only by the writer's check.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from sparserl_jax.decoupled.exchange import SupersededError
from sparserl_jax.storage import JsonlFile, run_path

__all__ = ["FILES", "MARK", "Ledger", "check_exactly_once"]

FILES = ("consumed", "dropped")
MARK = "ledger_epoch"  # the key of the marker row a trainer incarnation starts its rows with


def _split(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """(the rows that count, how many an incarnation wrote after a newer one's marker)."""
    floor, live, superseded = 0, [], 0
    for r in rows:
        if MARK in r:
            floor = max(floor, int(r[MARK]))
        elif int(r.get("epoch", floor)) < floor:
            superseded += 1
        else:
            live.append(r)
    return live, superseded


class Ledger:
    """Append-only JSONL files `<run_dir>/consumed.jsonl` and `<run_dir>/dropped.jsonl` (a
    local directory or a URL: `storage.JsonlFile`; call `flush` before a checkpoint counts the
    rows). The trainer opens it with its incarnation `epoch`: its rows are stamped with it and
    its `truncate` writes the marker; readers pass none."""

    def __init__(self, run_dir: str | Path, epoch: int | None = None):
        self.dir = run_path(run_dir)
        self.epoch = epoch
        self.files = {name: JsonlFile(self.dir / f"{name}.jsonl") for name in FILES}
        self._counts = {name: len(self.rows(name)) for name in FILES}

    def rows(self, name: str) -> list[dict[str, Any]]:
        """The rows of one file that count: complete (a torn last line, from a kill mid-write,
        is skipped), markers left out, and no row of an incarnation written after a newer one
        started (module docstring)."""
        return _split(self.files[name].rows())[0]

    def superseded(self) -> dict[str, int]:
        """Rows per file that a superseded incarnation wrote after its successor started."""
        return {name: _split(self.files[name].rows())[1] for name in FILES}

    def position(self) -> dict[str, int]:
        """Rows per file: what a checkpoint records."""
        return dict(self._counts)

    def truncate(self, position: dict[str, int]) -> None:
        """Keep the first `position[name]` rows that count of each file, followed by this
        incarnation's marker, in one atomic replace: an older incarnation's append lands
        before the replace (and is cut) or after the marker (and is not counted)."""
        mark = [] if self.epoch is None else [{MARK: self.epoch}]
        for name in FILES:
            raw = self.files[name].rows()
            newer = [r[MARK] for r in raw if self.epoch is not None and r.get(MARK, 0) > self.epoch]
            if newer:
                raise SupersededError(
                    f"trainer epoch {self.epoch}: the ledger already holds epoch {max(newer)}'s "
                    "rows; this one stops without cutting it"
                )
            keep = _split(raw)[0][: int(position.get(name, 0))]
            self.files[name].replace(keep + mark)
            self._counts[name] = len(keep)

    def append(self, name: str, row: dict[str, Any]) -> None:
        if self.epoch is not None:
            row = {**row, "epoch": row.get("epoch", self.epoch)}
        self.files[name].append([row])
        self._counts[name] += 1

    def flush(self) -> None:
        """Store the rows a URL run directory holds back (a no-op for a local one)."""
        for f in self.files.values():
            f.flush()


def check_exactly_once(run_dir: str | Path) -> dict[str, Any]:
    """Check what the ledger proves; returns counts, raises ValueError naming the first breach.

    - every consumed item id appears once, and no consumed item was also dropped;
    - each step trained on one whole data batch: its rows (one per work item) name one batch
      and their prompts (`first`, `prompts`) cover it once, in prompt order;
    - steps 1, 2, ... trained on consecutive data batches: the order trained is the data
      order (nothing reordered toward the groups that came back first);
    - the batches consumed, with those still pending when the trainer last stopped
      (`pending.json`), are 0..K-1 without a gap (a dropped item is re-issued in its batch;
      an abandoned one's batch comes again from the data state).

    Rows a superseded incarnation appended after its successor started do not count (module
    docstring); how many there were is returned as `superseded`.
    """
    ledger = Ledger(run_dir)
    consumed, dropped = ledger.rows("consumed"), ledger.rows("dropped")
    ids = Counter(r["item"] for r in consumed)
    twice = [i for i, n in ids.items() if n > 1]
    if twice:
        raise ValueError(f"items consumed more than once: {twice[:10]}")
    both = sorted(set(ids) & {r["item"] for r in dropped})
    if both:
        raise ValueError(f"items both consumed and dropped: {both[:10]}")
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in consumed:
        by_step.setdefault(r["step"], []).append(r)
    steps = sorted(by_step)
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(f"consumed rows are not of steps 1, 2, ...: {steps[:20]}")
    order = []
    for step in steps:
        rows = by_step[step]
        batch = {r["batch"] for r in rows}
        if len(batch) != 1:
            raise ValueError(f"step {step} trained on several data batches: {sorted(batch)}")
        at = 0
        for r in rows:  # in the order appended: the batch's prompt order
            if r.get("first", at) != at:
                raise ValueError(
                    f"step {step}: data batch {r['batch']} not trained whole and in order "
                    f"(item {r['item']} starts at prompt {r['first']}, expected {at})"
                )
            at += r.get("prompts", 0)
        if at != rows[0].get("batch_size", at):
            raise ValueError(
                f"step {step}: {at} of data batch {rows[0]['batch']}'s "
                f"{rows[0]['batch_size']} prompts trained"
            )
        order.append(batch.pop())
    if order and order != list(range(order[0], order[0] + len(order))):
        raise ValueError(f"data batches not trained in data order: {order[:20]}")
    batches = set(order)
    pending_path = run_path(run_dir) / "pending.json"
    pending = set(json.loads(pending_path.read_text())) if pending_path.exists() else set()
    covered = batches | pending
    issued = {r["batch"] for r in dropped if r["batch"] is not None} | covered
    gaps = sorted(set(range(max(issued, default=-1) + 1)) - covered)
    if gaps:
        raise ValueError(f"data batches neither trained on nor pending (lost): {gaps[:10]}")
    reasons = Counter(r["reason"] for r in dropped)
    return {
        "consumed": len(consumed),
        "steps": len(steps),
        "dropped": len(dropped),
        "reasons": dict(reasons),
        "superseded": sum(ledger.superseded().values()),
    }
