"""The decoupled trainer's heartbeat thread (`Pulse`), and its view of the samplers'."""

from __future__ import annotations

import contextlib
import threading
import time

from sparserl_jax.decoupled.exchange import Exchange, SamplerWatch, SupersededError


class Pulse(threading.Thread):
    """The trainer's heartbeat, from a side thread every `period` s (so a long restore, compile or
    update never looks like a dead trainer), and its view of the samplers': a sampler is alive
    while its pulse changes within `lease_s` of this process's clock.

    Until `follow` names the incarnation it beats `starting` (no epoch: samplers wait); its last
    beat says `done` and the step reached, of a run of `steps` steps."""

    def __init__(self, exchange: Exchange, lease_s: float, *, steps: int, period: float = 1.0):
        super().__init__(daemon=True)
        self.ex, self.steps, self.period = exchange, steps, period
        self.epoch: int | None = None
        self.step = self.version = 0
        self._stop_event = threading.Event()
        self._finished = False
        self.watch = SamplerWatch(exchange, lease_s)
        self.superseded: SupersededError | None = None

    def follow(self, epoch: int, step: int, version: int) -> None:
        self.epoch, self.step, self.version = epoch, step, version

    def _beat(self, done: bool) -> None:
        payload = {"epoch": self.epoch, "step": self.step, "version": self.version}
        payload |= {"done": done, "steps": self.steps, "starting": self.epoch is None}
        self.ex.put_pulse("trainer/heartbeat", {**payload, "time": time.time()})

    def run(self) -> None:
        while True:
            try:
                self._beat(False)
            except SupersededError as e:  # a newer trainer: never beat again
                self.superseded = e
                return
            except (ValueError, OSError, RuntimeError):
                pass  # the exchange briefly unreachable: the next beat tries again
            if self._stop_event.wait(self.period):
                return

    def check(self) -> None:
        """Raise the `SupersededError` the beating thread met, if it met one."""
        if self.superseded is not None:
            raise self.superseded

    def finish(self, done: bool) -> None:
        """Stop beating; the last beat says whether the run is done (samplers then exit)."""
        if self._finished:
            return
        self._finished = True
        self._stop_event.set()
        self.join()
        if self.superseded is None:
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                self._beat(done)

    def samplers_alive(self) -> int:
        return len(self.watch.alive())
