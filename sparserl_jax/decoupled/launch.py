"""`sparserl launch CONFIG --samplers N`: the trainer and N samplers as local subprocesses.

They share `run_dir` (and the exchange under it unless `exchange.url` says otherwise). Each
one's output goes to `run_dir/logs/<job>.log`; the trainer's JSON summary (its stdout) to
`run_dir/logs/trainer.json`, printed at the end with the trainer's `summary:` lines (the
reward lines `sparserl train` ends with). SIGINT and SIGTERM are forwarded to every
child. A sampler that dies while the trainer runs is started again, at most `RESTARTS` times
each; when no sampler is left, the trainer is stopped (SIGTERM: it checkpoints) and `launch`
exits non-zero, saying which samplers ended how. Otherwise the exit status is the trainer's;
samplers still running when it ends get `exchange.poll_s`-paced time to see the trainer's last
heartbeat, then SIGTERM. `--trainer-cpus` / `--sampler-cpus` (Linux) pin the jobs to CPU sets,
so the learner and the samplers do not take each other's cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sparserl_jax.config import Config

__all__ = ["NO_SAMPLERS", "RESTARTS", "launch", "parse_cpus"]

RESTARTS = 3  # per sampler, while the trainer runs
NO_SAMPLERS = 4  # exit status: every sampler died, restarts spent; the trainer was stopped
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


def launch(
    cfg: Config,
    config_path: str,
    overrides: list[str],
    samplers: int,
    *,
    trainer_cpus: set[int] | None = None,
    sampler_cpus: set[int] | None = None,
    log_fn=print,
) -> int:
    """Start the jobs, watch them until the trainer ends, return its exit status (or
    `NO_SAMPLERS`). `trainer_cpus` / `sampler_cpus`: CPU sets to pin the jobs to."""
    if samplers < 1:
        raise ValueError(f"--samplers must be >= 1, got {samplers}")
    logs = Path(cfg.run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "sparserl_jax"]
    trainer = _spawn(
        [*base, "trainer", config_path, *overrides],
        logs / "trainer.log",
        logs / "trainer.json",
        trainer_cpus,
    )
    log_fn(f"launch: trainer pid {trainer.pid}, log {logs / 'trainer.log'}")

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
        for c in [trainer, *sampler.values()]:
            if c.poll() is None:
                c.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    code = None
    try:
        while (code := trainer.poll()) is None:
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
                trainer.terminate()
                trainer.wait()
                code = NO_SAMPLERS
                break
            time.sleep(WATCH_S)
        deadline = time.monotonic() + 10 * cfg.exchange.poll_s + 30
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
    log_fn(f"launch: trainer exited {trainer.returncode}; samplers {ends}")
    return code
