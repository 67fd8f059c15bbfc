"""Orbax checkpoints of everything a run needs to resume bit for bit, and SIGTERM handling.

A checkpoint is two items under `<run_dir>/checkpoints/<step>/`:
- `state`: a pytree of arrays (master params, optimizer state, RNG key data, sync baseline, DGG
  window, ...), saved asynchronously with each array's sharding;
- `meta`: a JSON dict (step, data-iterator state, sync version, config, anything small).

`restore_latest` walks back from the newest step: a checkpoint that fails to restore (truncated,
corrupt, half-written) is skipped with a warning and the previous one is used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointManager:
    """Keep the newest `keep` checkpoints of a run; save asynchronously; restore with fallback."""

    def __init__(self, run_dir: str | Path, *, keep: int = 3, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(run_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state: Any, meta: dict | None = None, *, force: bool = True) -> None:
        """Start saving `state` (pytree of arrays) and `meta` (JSON) as `step`; returns at once
        when async. The arrays are copied before this returns, so the caller may donate them."""
        meta = dict(meta or {}, step=int(step))
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self._mngr.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore `step` into the structure, dtypes and shardings of `abstract_state` (a pytree
        of arrays or `jax.ShapeDtypeStruct`s)."""
        abstract = jax.tree.map(_abstract, abstract_state)
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], out["meta"]

    def restore_latest(self, abstract_state: Any) -> tuple[Any, dict] | None:
        """The newest checkpoint that restores cleanly, or None when the run has none."""
        for step in reversed(self.steps()):
            try:
                return self.restore(step, abstract_state)
            except Exception as e:  # noqa: BLE001 (any failure means: this one is unusable)
                warnings.warn(
                    f"checkpoint step {step} in {self.directory} could not be restored "
                    f"({type(e).__name__}: {e}); falling back to the previous one",
                    stacklevel=2,
                )
        return None

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
