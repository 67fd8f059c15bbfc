"""XLA:CPU with 8 fake devices: do N back-to-back sharded programs with an all-reduce finish?

Each count runs in a child process with a deadline (a hang is the finding, not an error):

    python benchmarks/xla_cpu_inflight.py 32 40 64 --timeout 30

prints one JSON line per count: {"programs": N, "finished": bool, "seconds": ...}. On jax 0.10
(2 cores) 16-33 finish, 48 and 64 hang, 40 hangs about half the time: the reason
`sync.receiver` paces its per-leaf programs.
"""

import argparse
import json
import subprocess
import sys
import time

CHILD = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
total = jax.jit(lambda a: jnp.sum(a * 3 + 1))
xs = [jax.device_put(jnp.arange(8 * 1024, dtype=jnp.float32) + i, sharding) for i in range(8)]
n = int(sys.argv[1])
for _ in range(20):
    jax.block_until_ready([total(xs[i % 8]) for i in range(n)])
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("counts", type=int, nargs="+")
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    for n in args.counts:
        t = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(n)],
                timeout=args.timeout,
                capture_output=True,
            )
            finished = done.returncode == 0
        except subprocess.TimeoutExpired:
            finished = False
        print(json.dumps({"programs": n, "finished": finished, "seconds": time.perf_counter() - t}))


if __name__ == "__main__":
    main()
