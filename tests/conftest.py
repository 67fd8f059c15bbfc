"""Test set-up: 8 fake CPU devices, XLA:CPU at LLVM -O0 (compile time), strict rank promotion,
fp32 matmuls, and JAX's persistent compilation cache in `.jax_cache/` (gitignored).

XLA_FLAGS and the cache settings must be set before JAX initialises (it reads `JAX_*` variables
at import), so this runs at import time; as environment variables they also reach the child
processes that tests spawn (`sparserl` runs, multi-process and benchmark children).
"""

import itertools
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The 8 fake devices' collectives meet in a rendezvous that XLA:CPU aborts the process on after
# 40 s; two test workers on a 2-core machine can starve a device thread that long (seen as
# "Fatal Python error: Aborted" in sharded tests). Give them 10 minutes.
if "xla_cpu_collective_call_terminate_timeout_seconds" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += (
        " --xla_cpu_collective_call_terminate_timeout_seconds=600"
        " --xla_cpu_collective_timeout_seconds=600"
    )
# Most of a cold run (CI's) is XLA:CPU compiling, not running: 18 of 23 s in a sharded engine
# test. LLVM at -O0 compiles those programs in about 80% of the CPU time; the programs run
# slower, but the tests' arrays are tiny. Results are checked against references and other
# programs compiled with the same flags (children get them too: `xla_flags_with_devices`).
# SPARSERL_TEST_XLA_OPT=1 keeps XLA's default optimisation.
if os.environ.get("SPARSERL_TEST_XLA_OPT", "0") != "1":
    for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
        if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += " " + flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# A cached executable is the one XLA compiled for the same HLO, flags and devices: results are
# unchanged, and a test that compiles what an earlier one did (the chains of `sparserl` runs,
# which read it through their environment too; in-process runs of one config) skips XLA.
# No size cap: with one JAX takes a file lock around every read and write and rescans the whole
# directory on every write (`lru_cache._evict_if_needed`), so a cold run, which writes thousands
# of programs, slowed down quadratically (compile-heavy tests ran 3-5x slower in a full CI-mode
# run). Uncapped, an entry is one plain file write; a reader that meets an entry still being
# written fails to decompress it, warns and compiles (`compiler._cache_read`). The directory is
# bounded instead by `_prune_cache` once per session. SPARSERL_TEST_COMPILATION_CACHE=0 turns
# it off.
CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
CACHE_KEEP_BYTES = 2 << 30
if os.environ.get("SPARSERL_TEST_COMPILATION_CACHE", "1") == "1":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


def _prune_cache(directory: str, keep_bytes: int) -> None:
    """Delete the least recently written entries of `directory` until it holds `keep_bytes`."""
    try:
        entries = [e for e in os.scandir(directory) if e.is_file()]
    except FileNotFoundError:
        return
    stats = sorted(((e.stat().st_mtime, e.stat().st_size, e.path) for e in entries), reverse=True)
    total = 0
    for _, size, path in stats:
        total += size
        if total > keep_bytes:
            os.remove(path)


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # once, in the controller
        _prune_cache(CACHE_DIR, CACHE_KEEP_BYTES)


def pytest_collection_modifyitems(config, items):
    """Deal the tests marked slow out to the front of every xdist worker's share.

    `--dist worksteal` first hands worker k the k-th of `workercount` contiguous chunks of the
    collection (chunk sizes as below) and later moves tests from the back of a busy worker's
    queue to an idle one. So each chunk here starts with every `workercount`-th slow test and
    is filled up with fast ones: the minutes-long runs start at once on every worker and the
    short tests fill the gaps, instead of one worker finishing a long run alone at the end.
    """
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = iter([item for item in items if not item.get_closest_marker("slow")])
    ordered, left = [], len(items)
    for k in range(workers):
        size = left // (workers - k)
        left -= size
        mine = slow[k::workers]
        ordered += mine + list(itertools.islice(fast, max(0, size - len(mine))))
    items[:] = ordered + list(fast)
