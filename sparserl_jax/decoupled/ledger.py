"""The decoupled trainer's ledger: `consumed.jsonl` (one row per work item the learner trained
on) and `dropped.jsonl` (items dropped as stale, expired, corrupt or abandoned) in the run
directory, and the check that they prove exactly-once.

Rows are appended (flushed and fsynced; to a URL run directory, once per step) by the trainer
only. A trainer checkpoint records how many rows each file had; a resumed trainer first cuts
both files back to that position (rows of steps it is about to redo), so a resume never
duplicates a row.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from sparserl_jax.storage import JsonlFile, run_path

__all__ = ["FILES", "Ledger", "check_exactly_once"]

FILES = ("consumed", "dropped")


class Ledger:
    """Append-only JSONL files `<run_dir>/consumed.jsonl` and `<run_dir>/dropped.jsonl` (a
    local directory or a URL: `storage.JsonlFile`; call `flush` before a checkpoint counts the
    rows)."""

    def __init__(self, run_dir: str | Path):
        self.dir = run_path(run_dir)
        self.files = {name: JsonlFile(self.dir / f"{name}.jsonl") for name in FILES}
        self._counts = {name: len(self.rows(name)) for name in FILES}

    def rows(self, name: str) -> list[dict[str, Any]]:
        """The complete rows of one file (a torn last line, from a kill mid-write, is skipped)."""
        return self.files[name].rows()

    def position(self) -> dict[str, int]:
        """Rows per file: what a checkpoint records."""
        return dict(self._counts)

    def truncate(self, position: dict[str, int]) -> None:
        """Keep the first `position[name]` rows of each file (atomically)."""
        for name in FILES:
            keep = self.rows(name)[: int(position.get(name, 0))]
            self.files[name].replace(keep)
            self._counts[name] = len(keep)

    def append(self, name: str, row: dict[str, Any]) -> None:
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
    }
