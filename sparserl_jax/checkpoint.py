"""Orbax checkpoints of everything a run needs to resume bit for bit, and SIGTERM handling.

A checkpoint is three items under `<run_dir>/checkpoints/<step>/`, committed together by Orbax:
- `state`: a pytree of arrays (master params, optimizer state, RNG key data, sync baseline, DGG
  window, ...), saved asynchronously with each array's sharding;
- `meta`: a JSON dict (step, data-iterator state, sync version, config, anything small);
- `digests`: every array's path, shape, dtype and 64-bit digest of its bits (PULSESync's
  order-free leaf digest, `sync.mask.leaf_digests`, computed where the array lives: two scalars
  per leaf leave the devices), and a SHA-256 of the canonical JSON of `meta`.

Restoring checks first that the stored arrays have the paths, shapes and dtypes the caller
expects (`CheckpointMismatchError`, naming the first difference: a config error, nothing is
loaded), then restores and recomputes every digest. `restore_latest` walks back from the newest
step: a checkpoint that fails (unreadable, truncated, a digest that differs) is reported in one
log line, moved aside to `<run_dir>/checkpoints.corrupt/<step>-<time>` (never deleted) and the
previous one is tried, so a run that fell back later saves that step again without colliding.
Checkpoints written before digests existed restore unverified, with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from sparserl_jax.storage import move_tree, run_path
from sparserl_jax.sync.mask import leaf_digests, publish_bits

log = logging.getLogger(__name__)

DIGESTS_FORMAT = 1


class CheckpointError(Exception):
    """A checkpoint step cannot be used: unreadable, incomplete or failing its digests."""


class CheckpointMismatchError(ValueError):
    """The stored arrays do not have the structure, shapes or dtypes the run expects."""


class CheckpointManager:
    """Keep the newest `keep` checkpoints of a run; save asynchronously; restore verified, with
    fallback (module docstring)."""

    def __init__(self, run_dir: str | Path, *, keep: int = 3, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        root = run_path(run_dir)  # a local directory or a URL (`storage`)
        self.directory = root / "checkpoints"
        self.corrupt_directory = root / "checkpoints.corrupt"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta", "digests")
        )

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def has(self, step: int) -> bool:
        """Whether step `step` is on storage now (another process may have saved it)."""
        return (self.directory / str(step)).exists()

    def meta(self, step: int) -> dict:
        """Step `step`'s meta from its file (no collective; unverified: `restore` verifies)."""
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            return dict(json.loads(path.read_text()))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint step {step}: {path} is unreadable: {e}") from e

    def save(self, step: int, state: Any, meta: dict | None = None, *, force: bool = True) -> None:
        """Start saving `state` (pytree of arrays) and `meta` (JSON) as `step`; returns at once
        when async. The arrays are copied before this returns, so the caller may donate them.
        The digests are computed first, on the devices (a pass over the state, no host copy)."""
        meta = dict(meta or {}, step=int(step))
        leaves = jax.tree_util.tree_leaves_with_path(state)
        gone = [jax.tree_util.keystr(p) for p, x in leaves if getattr(x, "is_deleted", bool)()]
        if gone:  # reading them is an error at best (a crash was seen: a donated learner state)
            raise ValueError(
                f"checkpoint step {step}: {len(gone)} arrays of the state were deleted (donated "
                f"to a later step?), e.g. {gone[0]}: save the state before it is donated"
            )
        digests = {
            "format": DIGESTS_FORMAT,
            "arrays": array_digests(state),
            "meta_sha256": _meta_sha256(meta),
        }
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                digests=ocp.args.JsonSave(digests),
            ),
            force=force,
        )

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self._mngr.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore `step` into the structure, dtypes and shardings of `abstract_state` (a pytree
        of arrays or `jax.ShapeDtypeStruct`s), verified against its digests.

        Raises `CheckpointMismatchError` when the stored arrays differ in structure, shape or
        dtype from `abstract_state`, and `CheckpointError` (one line: step, file or array, what
        failed) when the step cannot be read or a digest differs.
        """
        abstract = jax.tree.map(_abstract, abstract_state)
        stored = self._read_digests(step)
        if stored is not None:
            check_structure(stored["arrays"], abstract, step)
        # Before the reads start, not after one fails: the other reads' echoes can reach the
        # closed loop before the failure reaches us (seen on a loaded machine).
        _quiet_abandoned_reads()
        try:
            out = self._mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # noqa: BLE001 (Orbax/TensorStore raise many kinds)
            raise CheckpointError(f"checkpoint step {step}: {_one_line(e)}") from e
        state, meta = out["state"], out["meta"]
        if stored is None:
            log.warning(
                "checkpoint step %d in %s has no digests (written by an older version): "
                "restored unverified",
                step,
                self.directory,
            )
            return state, meta
        if _meta_sha256(meta) != stored["meta_sha256"]:
            raise CheckpointError(f"checkpoint step {step}: meta (meta/) fails its digest")
        got = array_digests(state)
        for path, want in stored["arrays"].items():
            if got[path]["digest"] != want["digest"]:
                raise CheckpointError(
                    f"checkpoint step {step}: array {path} (state/) fails its digest "
                    f"({got[path]['digest']} != stored {want['digest']})"
                )
        return state, meta

    def restore_latest(
        self, abstract_state: Any, refuse: Callable[[dict], str | None] | None = None
    ) -> tuple[Any, dict] | None:
        """The newest checkpoint that restores and verifies, or None when the run has none.

        Each step that fails is reported in one log line and moved aside (module docstring),
        and so is one whose meta `refuse(meta)` gives a reason for (the decoupled trainer's: a
        checkpoint a superseded incarnation wrote); a `CheckpointMismatchError` (the run's
        config does not match) is raised at once.
        """
        for step in reversed(self.steps()):
            try:
                why = refuse(self.meta(step)) if refuse is not None else None
                if why is not None:  # judged on the meta alone: no state read for it
                    raise CheckpointError(f"checkpoint step {step} {why}")
                return self.restore(step, abstract_state)
            except CheckpointError as e:
                moved = self.move_aside(step) or "checkpoints.corrupt/ (by process 0)"
                log.warning("%s; moved to %s, falling back to the previous checkpoint", e, moved)
        return None

    def move_aside(self, step: int) -> Any:
        """Move checkpoint `step` out of the run's checkpoints (into `corrupt_directory`, never
        deleted) so that a later save of the same step does not collide with it. With several
        processes every one calls this (they judged the step alike: its digests are global);
        process 0 alone moves it, the others wait for it and get None."""
        self._mngr.wait_until_finished()
        dst = None
        if jax.process_index() == 0:
            src = self.directory / str(step)
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            dst = self.corrupt_directory / f"{step}-{stamp}"
            n = 1
            while dst.exists():
                dst, n = self.corrupt_directory / f"{step}-{stamp}-{n}", n + 1
            move_tree(src, dst)
        sync_processes(f"sparserl_checkpoint_move_aside_{step}")
        self._mngr.reload()
        return dst

    def _read_digests(self, step: int) -> dict | None:
        """The step's stored digests; None for a checkpoint written before digests existed."""
        step_dir = self.directory / str(step)
        path = step_dir / "digests" / "metadata"
        if not (step_dir / "digests").exists():
            if _written_with_digests(step_dir):
                raise CheckpointError(f"checkpoint step {step}: digests/ is missing")
            return None
        try:
            digests = json.loads(path.read_text())
            if digests.get("format") != DIGESTS_FORMAT or not isinstance(digests["arrays"], dict):
                raise ValueError(f"unknown digests format {digests.get('format')!r}")
            str(digests["meta_sha256"])
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint step {step}: {path} is unreadable: {e}") from e
        return digests

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sync_processes(name: str) -> None:
    """Wait until every process of a multi-process run reached `name` (a no-op in one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@jax.jit
def _device_digests(tree):
    return leaf_digests(publish_bits(tree, None))


def array_digests(state: Any) -> dict[str, dict[str, Any]]:
    """`{path: {"shape", "dtype", "digest"}}` of every array leaf of `state`: the 64-bit
    order-free digest of its bits, computed where it lives (shards reduce locally)."""
    leaves = jax.tree_util.tree_leaves_with_path(state)
    # One program per set of devices the leaves live on (a jitted call takes one set).
    groups: dict[Any, list[int]] = {}
    for i, (_, leaf) in enumerate(leaves):
        where = leaf.sharding.device_set if isinstance(leaf, jax.Array) else None
        groups.setdefault(frozenset(where) if where else None, []).append(i)
    lanes: list[Any] = [None] * len(leaves)
    for members in groups.values():
        got = jax.device_get(_device_digests([leaves[i][1] for i in members]))
        for i, lane in zip(members, got, strict=True):
            lanes[i] = lane
    return {
        jax.tree_util.keystr(path): {
            "shape": list(np.shape(leaf)),
            "dtype": np.dtype(leaf.dtype).name,
            "digest": f"{int(lane[0]):08x}{int(lane[1]):08x}",
        }
        for (path, leaf), lane in zip(leaves, lanes, strict=True)
    }


def check_structure(stored: dict[str, dict], abstract: Any, step: int) -> None:
    """Raise `CheckpointMismatchError` naming the first array whose path, shape or dtype in
    the checkpoint differs from `abstract`'s."""
    want = {
        jax.tree_util.keystr(path): (list(x.shape), np.dtype(x.dtype).name)
        for path, x in jax.tree_util.tree_leaves_with_path(abstract)
    }
    for path in sorted(set(want) | set(stored)):
        if path not in stored:
            problem = "is expected but not in the checkpoint"
        elif path not in want:
            problem = "is in the checkpoint but not expected"
        elif (stored[path]["shape"], stored[path]["dtype"]) != want[path]:
            got, exp = stored[path], want[path]
            problem = (
                f"is {got['dtype']}{got['shape']} in the checkpoint but the run expects "
                f"{exp[1]}{exp[0]}"
            )
        else:
            continue
        raise CheckpointMismatchError(
            f"checkpoint step {step} does not match this run's config: array {path} {problem} "
            "(a different model or optimizer? use another run_dir, or train.resume=false)"
        )


def _meta_sha256(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _written_with_digests(step_dir: Path) -> bool:
    """Whether Orbax's record of the step lists a `digests` item (then a step without them lost
    them); an unreadable record counts as such."""
    try:
        record = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
        return "digests" in record["item_handlers"]
    except Exception:  # noqa: BLE001
        return True


def _one_line(e: BaseException) -> str:
    """The first line of an error (TensorStore's messages run to dozens), with the file named
    when the message holds a path."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    paths = re.findall(r"(?:file://)?(/[^\s\"']+)", text)
    where = f" (file {paths[0]})" if paths and paths[0] not in first else ""
    return f"{type(e).__name__}: {first[:300]}{where}"


def _quiet_abandoned_reads() -> None:
    """Silence the echoes of a failed restore (it is reported in one line already): Orbax
    closes its event loop at the first failed read while the step's other TensorStore reads are
    in flight; as each ends, its callback meets the closed loop (`RuntimeError: Event loop is
    closed`, printed as an unraisable traceback) and its task is collected with its error never
    retrieved (an `asyncio` error log). Only exceptions of exactly those kinds are dropped."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_abandoned_reads", False):
        return

    def hook(unraisable) -> None:
        frames = traceback.extract_tb(unraisable.exc_traceback)
        if not (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
            and any(f.name == "call_soon_threadsafe" for f in frames)
        ):
            previous(unraisable)

    hook.quiets_abandoned_reads = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_unretrieved_read_error)


def _unretrieved_read_error(record: logging.LogRecord) -> bool:
    """A logging filter: False for asyncio's report of a checkpoint read's unretrieved error."""
    text = record.getMessage()
    return not (
        "exception was never retrieved" in text and ("orbax" in text or "tensorstore" in text)
    )


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class Preempted(Exception):
    """Raised inside a `PreemptionGuard.abortable` region when a stop signal ends the run there
    (the region's work is dropped: the next run redoes it)."""


# The signals that stop a run at a safe point: a preemption notice (SIGTERM) and Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Test hook: `SPARSERL_TEST_SIGNAL_AT=<key>` makes the guard send SIGTERM to its own process when
# the run reaches the stage `key` (`PreemptionGuard.mark`), so tests can stop a run at an exact
# stage without timing races.
TEST_SIGNAL_ENV = "SPARSERL_TEST_SIGNAL_AT"


class PreemptionGuard:
    """Turn SIGTERM (and optionally SIGINT) into a stop the run handles at a safe point.

        with PreemptionGuard() as guard:
            for step in ...:
                with guard.abortable(f"rollout:{step}", f"the rollout of step {step}"):
                    ...                     # dropped at once on a signal (raises Preempted)
                guard.mark(f"update:{step}", f"the update of step {step}")
                ...                         # runs to the end; the loop polls guard.requested
                if guard.requested:
                    ckpt.save(step, state, meta); ckpt.wait(); break   # then exit 0

    A signal sets `requested` (and `signal_received`, `stopped_where`: what the run was doing,
    as last given to `mark`). Inside an `abortable` region it also raises `Preempted` at once:
    only work whose result can be recomputed belongs there (a rollout, an evaluation, the SFT
    stage), never a save or an update of state that outlives it. A second SIGINT raises
    KeyboardInterrupt (Ctrl-C twice: stop now). The previous handlers are restored on exit.
    Only the main thread can install handlers; elsewhere the guard is inert (never requested).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self._signals = signals
        self._previous: dict[int, Any] = {}
        self._abortable = False
        self.requested = False
        self.signal_received: int | None = None
        self.where = "start-up"
        self.stopped_where: str | None = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal_received).name if self.signal_received else "signal"

    def _handle(self, signum, frame) -> None:
        del frame
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.requested:
            self.stopped_where = self.where
        self.requested = True
        self.signal_received = signum
        log.info("signal %d received during %s: stopping at a safe point", signum, self.where)
        if self._abortable:
            self._abortable = False
            raise Preempted(f"stopped by {self.signal_name} during {self.stopped_where}")

    def mark(self, key: str, where: str) -> None:
        """Record what the run does now (`where`, for the stop message); `key` names the stage
        for the test hook (`TEST_SIGNAL_ENV`)."""
        self.where = where
        if os.environ.get(TEST_SIGNAL_ENV) == key:
            os.kill(os.getpid(), signal.SIGTERM)

    @contextlib.contextmanager
    def abortable(self, key: str, where: str) -> Iterator[None]:
        """A region a signal stops at once, by raising `Preempted` (also on entry when a signal
        came earlier)."""
        try:
            self._abortable = True
            self.mark(key, where)
            if self.requested:
                self._abortable = False
                raise Preempted(f"stopped by {self.signal_name} during {self.stopped_where}")
            yield
        finally:
            self._abortable = False

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for s in self._signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
