"""`sparserl launch CONFIG --samplers N`: the trainer and N samplers as local subprocesses.

They share `run_dir` (and the exchange under it unless `exchange.url` says otherwise). Each
one's output goes to `run_dir/logs/<job>.log`; the trainer's JSON summary (its stdout) to
`run_dir/logs/trainer.json`, printed at the end. SIGINT and SIGTERM are forwarded to every
child; nothing is restarted. The exit status is the trainer's; samplers still running when it
ends get `exchange.poll_s`-paced time to see the trainer's last heartbeat, then SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from sparserl_jax.config import Config

__all__ = ["launch"]


def _spawn(argv: list[str], log: Path, out: Path | None = None) -> subprocess.Popen:
    with log.open("ab") as err:
        stdout = out.open("wb") if out is not None else err
        try:
            return subprocess.Popen(argv, stdout=stdout, stderr=err, start_new_session=True)
        finally:
            if out is not None:
                stdout.close()


def launch(
    cfg: Config, config_path: str, overrides: list[str], samplers: int, *, log_fn=print
) -> int:
    """Start the jobs, wait for the trainer, return its exit status."""
    if samplers < 1:
        raise ValueError(f"--samplers must be >= 1, got {samplers}")
    logs = Path(cfg.run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "sparserl_jax"]
    trainer = _spawn(
        [*base, "trainer", config_path, *overrides],
        logs / "trainer.log",
        logs / "trainer.json",
    )
    log_fn(f"launch: trainer pid {trainer.pid}, log {logs / 'trainer.log'}")
    children = [trainer]
    for i in range(samplers):
        log = logs / f"sampler-{i}.log"
        p = _spawn([*base, "sampler", config_path, "--id", str(i), *overrides], log)
        log_fn(f"launch: sampler {i} pid {p.pid}, log {log}")
        children.append(p)

    def forward(signum, frame):
        del frame
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = trainer.wait()
        deadline = time.monotonic() + 10 * cfg.exchange.poll_s + 30
        for c in children[1:]:
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
    log_fn(f"launch: trainer exited {code}; samplers {[c.returncode for c in children[1:]]}")
    return code
