"""Several local JAX processes joined by `jax.distributed` (gloo CPU collectives), for tests of
multi-process code: `run_processes` starts a script once per process with a free coordinator
port and a hard wall-clock limit (a hung child can never hang the suite); `join` is what a child
calls first."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sparserl_jax.decoupled.launch import free_port
from sparserl_jax.sync.loco_runtime import init_cpu_distributed
from sparserl_jax.testing.fixtures import xla_flags_with_devices

ROOT = Path(__file__).resolve().parents[2]


def run_processes(
    script: str | os.PathLike,
    args: Sequence[Sequence[str]],
    *,
    devices_per_process: int = 1,
    wall_s: float = 300.0,
) -> list[str]:
    """Run `python script PORT PROCESS_ID NUM_PROCESSES *args[p]` for each process p, each with
    `devices_per_process` CPU devices; return their outputs. Raises AssertionError (with each
    child's tail) when one exits non-zero or they do not all finish within `wall_s`."""
    port = free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags_with_devices(devices_per_process)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    n = len(args)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(port), str(p), str(n), *map(str, args[p])],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(n)
    ]
    deadline, logs = time.monotonic() + wall_s, []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired as err:
        for proc in procs:
            proc.kill()
        tails = [(proc.communicate()[0] or "")[-2000:] for proc in procs]
        raise AssertionError(
            f"children did not finish in {wall_s} s:\n" + "\n---\n".join(tails)
        ) from err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for p, proc in enumerate(procs):
        assert proc.returncode == 0, f"process {p} exited {proc.returncode}:\n{logs[p][-3000:]}"
    return logs


def join(argv: Sequence[str]) -> list[str]:
    """In a child of `run_processes`: join the others (`jax.distributed`, gloo) and return the
    child's own arguments. Must run before anything touches a JAX backend."""
    port, process_id, num_processes = int(argv[1]), int(argv[2]), int(argv[3])
    init_cpu_distributed(f"localhost:{port}", num_processes, process_id, timeout_s=30)
    return list(argv[4:])
