"""`sparserl launch CONFIG --samplers N`: the trainer and N samplers as local subprocesses.

They share `run_dir` (and the exchange under it unless `exchange.url` says otherwise). Each
one's output goes to `run_dir/logs/<job>.log` (for a URL run_dir, `./logs/<its last part>/`:
logs are this host's); the trainer's JSON summary (its stdout) to `.../trainer.json`, printed at
the end with the trainer's `summary:` lines (the reward lines `sparserl train` ends with).
SIGINT and SIGTERM are forwarded to every child. A sampler that dies while the trainer runs is
started again, at most `RESTARTS` times each; when no sampler is left, the trainer is stopped
(SIGTERM: it checkpoints) and `launch` exits non-zero, saying which samplers ended how.
Otherwise the exit status is the trainer's; samplers still running when it ends get
`exchange.poll_s`-paced time to see the trainer's last heartbeat, then SIGTERM. `--trainer-cpus`
/ `--sampler-cpus` (Linux) pin the jobs to CPU sets, so the learner and the samplers do not take
each other's cores.

`--trainer-processes P` starts the trainer as P processes on a local coordinator
(`run_dir/logs/trainer.log` is process 0's, `trainer-<p>.log` the others'). If any of them
ends badly the others are stopped (SIGTERM, then SIGKILL after `STOP_GRACE_S`: one blocked in a
collective with a dead peer never returns) and `launch` exits `TRAINER_PROCESS_DIED`; the same
command again resumes from the newest checkpoint they saved together.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from sparserl_jax.config import Config
from sparserl_jax.storage import is_url

__all__ = ["NO_SAMPLERS", "RESTARTS", "TRAINER_PROCESS_DIED", "launch", "parse_cpus"]

RESTARTS = 3  # per sampler, while the trainer runs
NO_SAMPLERS = 4  # exit status: every sampler died, restarts spent; the trainer was stopped
TRAINER_PROCESS_DIED = 6  # exit status: a process of a multi-process trainer ended badly
STOP_GRACE_S = 30.0  # after SIGTERM, before SIGKILL
WATCH_S = 0.5  # how often the children are looked at


def parse_cpus(spec: str | None) -> set[int] | None:
    """A CPU list (`0`, `0-3`, `0,2,4-7`) as a set, checked against the CPUs this process may
    use; None for None."""
    if spec is None:
        return None
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus |= set(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"CPU list {spec!r} is not like 0,2,4-7") from None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if allowed is None:
        raise ValueError("pinning jobs to CPUs needs Linux (os.sched_setaffinity)")
    if not cpus or not cpus <= allowed:
        raise ValueError(f"CPU list {spec!r} is not within the CPUs allowed here {sorted(allowed)}")
    return cpus


def _spawn(
    argv: list[str], log: Path, out: Path | None = None, cpus: set[int] | None = None
) -> subprocess.Popen:
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    with log.open("ab") as err:
        stdout = out.open("wb") if out is not None else err
        try:
            return subprocess.Popen(
                argv, stdout=stdout, stderr=err, start_new_session=True, preexec_fn=pin
            )
        finally:
            if out is not None:
                stdout.close()


def logs_dir(run_dir: str) -> Path:
    """Where `launch` writes its jobs' logs: `<run_dir>/logs`, or for a URL run directory (the
    logs are this host's) `./logs/<the URL's last part>`."""
    if is_url(run_dir):
        return Path("logs") / run_dir.rstrip("/").rsplit("/", 1)[-1]
    return Path(run_dir) / "logs"


def launch(
    cfg: Config,
    config_path: str,
    overrides: list[str],
    samplers: int,
    *,
    trainer_cpus: set[int] | None = None,
    sampler_cpus: set[int] | None = None,
    trainer_processes: int = 1,
    log_fn=print,
) -> int:
    """Start the jobs, watch them until the trainer ends, return its exit status (or
    `NO_SAMPLERS`, or `TRAINER_PROCESS_DIED`). `trainer_cpus` / `sampler_cpus`: CPU sets to pin
    the jobs to. `trainer_processes`: P > 1 starts the trainer as P processes joined by
    `jax.distributed` on a local coordinator (process 0 leads; `decoupled/processes.py`)."""
    if samplers < 1:
        raise ValueError(f"--samplers must be >= 1, got {samplers}")
    if trainer_processes < 1:
        raise ValueError(f"--trainer-processes must be >= 1, got {trainer_processes}")
    logs = logs_dir(cfg.run_dir)
    logs.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "sparserl_jax"]
    join = []
    if trainer_processes > 1:
        join = ["--coordinator", f"localhost:{free_port()}"]
        join += ["--num-processes", str(trainer_processes)]
    trainers = []
    for p in range(trainer_processes):
        name = "trainer" if p == 0 else f"trainer-{p}"
        ident = ["--process-id", str(p)] if join else []
        trainers.append(
            _spawn(
                [*base, "trainer", config_path, *overrides, *join, *ident],
                logs / f"{name}.log",
                logs / f"{name}.json",
                trainer_cpus,
            )
        )
        log_fn(f"launch: trainer process {p} pid {trainers[p].pid}, log {logs / f'{name}.log'}")
    trainer = trainers[0]

    def start_sampler(i: int) -> subprocess.Popen:
        log = logs / f"sampler-{i}.log"
        p = _spawn(
            [*base, "sampler", config_path, "--id", str(i), *overrides], log, None, sampler_cpus
        )
        log_fn(f"launch: sampler {i} pid {p.pid}, log {log}")
        return p

    sampler = {i: start_sampler(i) for i in range(samplers)}
    restarts = dict.fromkeys(sampler, 0)

    def forward(signum, frame):
        del frame
        for c in [*trainers, *sampler.values()]:
            if c.poll() is None:
                c.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    code = None
    try:
        while (code := trainer.poll()) is None:
            dead = [(p, t.returncode) for p, t in enumerate(trainers) if t.poll() not in (None, 0)]
            if dead:
                how = ", ".join(f"process {p} exited {rc}" for p, rc in dead)
                log_fn(f"launch: a trainer process died ({how}); stopping the others")
                _stop(trainers)
                code = TRAINER_PROCESS_DIED
                break
            ended = {i: p.returncode for i, p in sampler.items() if p.poll() is not None}
            for i, rc in ended.items():
                if rc != 0 and restarts[i] < RESTARTS:
                    restarts[i] += 1
                    log_fn(f"launch: sampler {i} exited {rc}; restart {restarts[i]} of {RESTARTS}")
                    sampler[i] = start_sampler(i)
            if all(p.poll() is not None and p.returncode != 0 for p in sampler.values()):
                how = ", ".join(
                    f"sampler {i} exited {p.returncode} after {restarts[i]} restarts"
                    for i, p in sampler.items()
                )
                log_fn(f"launch: no sampler left ({how}); stopping the trainer")
                _stop(trainers)
                code = NO_SAMPLERS
                break
            time.sleep(WATCH_S)
        deadline = time.monotonic() + 10 * cfg.exchange.poll_s + 30
        if code == 0:  # the followers end with the leader's stop event
            for t in trainers[1:]:
                try:
                    t.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    code = TRAINER_PROCESS_DIED
                    log_fn("launch: a trainer process did not stop with process 0; stopped")
        _stop(trainers)
        if code == 0 and any(t.returncode != 0 for t in trainers[1:]):
            code = TRAINER_PROCESS_DIED
        for c in sampler.values():
            try:
                c.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.terminate()
                try:
                    c.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    c.kill()
                    c.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    summary = (logs / "trainer.json").read_text().strip()
    if summary:
        print(summary)
    # The trainer's closing lines (held-out and training reward), as `sparserl train` ends.
    for line in (logs / "trainer.log").read_text(errors="replace").splitlines():
        if line.startswith("summary: "):
            log_fn(line)
    ends = [c.returncode for c in sampler.values()]
    exits = [t.returncode for t in trainers]
    log_fn(f"launch: trainer exited {exits[0] if len(exits) == 1 else exits}; samplers {ends}")
    return code


def _stop(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process still running (a trainer checkpoints on it), SIGKILL what has not
    ended after `grace_s` (one stuck in a collective with a dead peer never will)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def free_port() -> int:
    """A TCP port free on localhost now (for a local coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
