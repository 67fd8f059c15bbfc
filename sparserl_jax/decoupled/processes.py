"""A decoupled trainer of several processes (`sparserl trainer --num-processes P`).

JAX's multi-controller runtime joins the processes (`jax.distributed`, gloo on CPU); the mesh
spans every process's devices and the learner's programs run on all of them. Process 0, the
leader, alone runs what talks to the samplers: the epoch and its fence, the heartbeat, the work
queue, the verdicts, the ledger and the metrics. For each thing every process must do together
it appends an *event* to the exchange (`trainer/events/e<epoch>/<n>`): `step` (the items and
their rollouts' checksums), `save` (a checkpoint of that step) or `stop`. The others (followers)
read the events in order, never waiting inside a collective while the leader waits for
rollouts; each reads the same checksummed rollouts and places only its rows (the learner's
`make_array_from_callback`). Every process publishes its own shards (`sync.parts`), and all save
and restore the sharded state together (Orbax). A follower whose leader's heartbeat stops for
`exchange.lease_s` stops with one line. The follower's loop is `trainer._run_follower`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jax
import numpy as np

from sparserl_jax.checkpoint import CheckpointError, CheckpointManager
from sparserl_jax.config import Config
from sparserl_jax.decoupled.exchange import Exchange, SupersededError
from sparserl_jax.sync.loco_runtime import init_cpu_distributed
from sparserl_jax.sync.parts import PartPublisher

START_BYTES = 1024  # the leader's start record, broadcast to the followers


JOIN_TIMEOUT_S = 300  # for every trainer process to reach the coordinator


def init_processes(coordinator: str | None, num_processes: int | None, process_id: int | None):
    """Join the trainer's processes (before anything touches a JAX backend); a no-op without a
    coordinator unless `num_processes` asks for JAX's own detection (TPU pods, SLURM)."""
    if coordinator is None and num_processes is None:
        return
    init_cpu_distributed(coordinator, num_processes, process_id, timeout_s=JOIN_TIMEOUT_S)


def multi_process() -> bool:
    return jax.process_count() > 1


def refuse(cfg: Config) -> None:
    """What a trainer of several processes cannot do yet, refused in one line before work."""
    if cfg.train.eval_examples:
        raise ValueError(
            "train.eval_examples: evaluation runs in one trainer process; with several set "
            "train.eval_examples=0 (and evaluate a checkpoint with one process)"
        )
    if cfg.sft.steps:
        raise ValueError(
            "sft.steps: the SFT warm start runs in one process; run it first with one trainer "
            "process (it is saved as step 0), or set sft.steps=0"
        )


def share_start(record: dict[str, Any] | None) -> dict[str, Any]:
    """The leader's start record (epoch, step, version, run id), the same in every process: a
    broadcast of `START_BYTES` bytes."""
    from jax.experimental import multihost_utils

    raw = np.zeros(START_BYTES, np.uint8)
    if record is not None:
        body = json.dumps(record).encode()
        if len(body) > START_BYTES:
            raise ValueError(f"start record of {len(body)} bytes exceeds {START_BYTES}")
        raw[: len(body)] = np.frombuffer(body, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(raw))
    return json.loads(got.tobytes().rstrip(b"\0"))


def publisher(ex: Exchange, epoch: int, cfg: Config, version: int, run_id: str | None):
    """Every process's part of each version under the epoch's sync location."""
    return PartPublisher(
        ex.sync_location(epoch),
        run_id=run_id,
        config=cfg.sync,
        start_version=version,
        timeout_s=max(60.0, cfg.exchange.lease_s),
    )


class Events:
    """The leader's ordered events for the followers (see the module docstring). In one process
    the leader's methods (`step`, `save`, `stop`) are no-ops."""

    def __init__(self, ex: Exchange, epoch: int, *, poll_s: float = 0.05, lease_s: float = 60.0):
        self.ex, self.epoch, self.n = ex, epoch, 0
        self.poll_s, self.lease_s = poll_s, lease_s
        self.active = multi_process()

    def _key(self, n: int) -> str:
        return f"trainer/events/e{self.epoch:06d}/{n:09d}"

    def _put(self, event: dict[str, Any]) -> None:
        if self.active:
            self.ex.check_fence()
            self.ex.write(self._key(self.n), json.dumps(event).encode())
            self.n += 1

    def step(self, step: int, items, rollouts) -> None:
        if not self.active:  # no follower: no checksum reads on the step's path
            return
        sums = [self.ex.rollout_sha256(r.item) for r in rollouts]
        self._put({"kind": "step", "step": step, "items": [i.id for i in items], "sha256": sums})

    def save(self, step: int, aside: bool = False) -> None:
        """Checkpoint `step` (`aside`: first move a superseded trainer's `step` aside)."""
        self._put({"kind": "save", "step": step, "aside": aside})

    def stop(self, step: int) -> None:
        self._put({"kind": "stop", "step": step})

    def next(self) -> dict[str, Any]:
        """The next event; raises RuntimeError once the leader's heartbeat has not changed for
        `lease_s` (by this process's clock) while none came, and `SupersededError` once a newer
        trainer registered (the follower's exchange handle is fenced to its epoch)."""
        seen, since = None, time.monotonic()
        while True:
            self.ex.check_fence()
            raw, _ = self.ex.read(self._key(self.n))
            if raw is not None:
                self.n += 1
                return json.loads(raw)
            _, beat = self.ex.pulse("trainer/heartbeat")
            if beat != seen:
                seen, since = beat, time.monotonic()
            elif time.monotonic() - since > self.lease_s:
                raise RuntimeError(
                    f"the leader (trainer process 0) stopped: no heartbeat for {self.lease_s:g} s "
                    f"and no event {self.n} of epoch {self.epoch}; stopping this process too"
                )
            time.sleep(self.poll_s)


def older_checkpoint(ckpt: CheckpointManager, step: int, epoch: int) -> bool:
    """Before trainer `epoch` saves `step`: whether that step is already there, saved by an
    older epoch past its fence check, or its save cut off (to be moved aside); a newer epoch's
    means this trainer is the superseded one: `SupersededError`, and the checkpoint is left
    alone."""
    if not ckpt.has(step):
        return False
    try:
        there = ckpt.meta(step).get("epoch", 0)
    except CheckpointError:  # a save cut off (a trainer killed mid-save on an object store)
        return True
    if there >= epoch:
        raise SupersededError(f"checkpoint step {step} is a newer trainer's: epoch {epoch} stops")
    return True
