"""Where a PULSESync format-3 version's time goes: wall time per function, publish and apply.

    PYTHONPATH=. .venv/bin/python -m benchmarks.sync_profile --lr 1e-6 --steps 12 --warmup 2

Trains the model of `tools/bench_sync.py` (same `BenchConfig`), publishes every step with format 3
and applies each patch with `Receiver(verify="all")` and `Receiver(verify="touched")`. Selected
functions of the codec and its stages are wrapped with a wall-clock accumulator (inclusive:
nested calls count in both); after `--warmup` steps (compilation) it prints one JSON line: per
version, in ms, the publish (`encode`, its `mask_s`, `extract_s`, `codec_s`), each apply, and
each wrapped function summed over the publisher and both receivers. Bit identity is checked.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import time

import jax
import numpy as np

from benchmarks.sync import BenchConfig, masters
from sparserl_jax.sync.codec import CodecConfig
from sparserl_jax.sync.publisher import Publisher, SyncConfig
from sparserl_jax.sync.receiver import Receiver

# The modules themselves (`sparserl_jax.sync` re-exports a function named `decode`).
codec, decode, order, publisher, receiver, values = (
    importlib.import_module(f"sparserl_jax.sync.{m}")
    for m in ("codec", "decode", "order", "publisher", "receiver", "values")
)

# (owner, attribute): module functions are looked up through their module at call time, methods
# through their class, so wrapping the attribute times every call.
WRAPPED = [
    (codec, "_choose_cuts"),
    (codec, "_sparse"),
    (codec, "context_order"),
    (codec, "code_values"),
    (values, "_steps"),
    (publisher, "digest_update"),
    (decode, "_sparse_v3_values"),
    (decode, "context_select"),
    (receiver, "scatter_changes"),
    (order.ContextCache, "ranges"),
    (order.ContextCache, "advance"),
    (order._Ranges, "select"),
    (order._Ranges, "rank"),
]


def _timed(fn, name: str, totals: dict):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0

    return wrapper


def profile(cfg: BenchConfig, warmup: int) -> dict:
    """Run and time (see the module docstring); the wrapped functions are restored after."""
    totals: dict[str, float] = collections.defaultdict(float)
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr in WRAPPED]
    for owner, attr, fn in originals:
        setattr(owner, attr, _timed(fn, f"{owner.__name__.rsplit('.', 1)[-1]}.{attr}", totals))
    try:
        return _run(cfg, warmup, totals)
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


def _run(cfg: BenchConfig, warmup: int, totals: dict) -> dict:
    config = SyncConfig(anchor_every=10**9, codec=CodecConfig(format=3, cut_slack=cfg.cut_slack))
    pub = Publisher(config=config)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    receivers = {v: Receiver(lambda n, s: sharding, verify=v) for v in ("all", "touched")}
    phases: dict[str, float] = collections.defaultdict(float)
    counted, identical = 0, True
    for step, (master, _) in enumerate(masters(cfg)):
        if step == warmup + 1:
            totals.clear()
            phases.clear()
        t0 = time.perf_counter()
        out = pub.publish(master)
        phases["encode"] += time.perf_counter() - t0
        phases["mask_s"] += out.mask_s
        phases["extract_s"] += out.extract_s
        phases["codec_s"] += out.encode_s
        blob = out.anchor if step == 0 else out.patch
        for verify, rc in receivers.items():
            t0 = time.perf_counter()
            rc.apply(blob)
            jax.block_until_ready(list(rc.arrays.values()))
            phases[f"apply_{verify}"] += time.perf_counter() - t0
            sent = dict(zip(pub.names, jax.tree.leaves(pub.sent_bits), strict=True))
            identical &= all(
                np.array_equal(np.asarray(sent[n]), np.asarray(a).view(np.asarray(sent[n]).dtype))
                for n, a in rc.arrays.items()
            )
        counted += step > warmup
    per = max(counted, 1)
    return {
        "lr": cfg.lr,
        "versions": counted,
        "changed_last": out.total_changed,
        "ms_per_version": {k: round(1e3 * v / per, 2) for k, v in phases.items()},
        "functions_ms_per_version": {
            k: round(1e3 * v / per, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
        },
        "all_bit_identical": bool(identical),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps not counted (compilation)")
    p.add_argument("--preset", default="cpu")
    p.add_argument("--cut-slack", type=float, default=BenchConfig.cut_slack)
    a = p.parse_args(argv)
    if not 0 <= a.warmup < a.steps:
        p.error(f"--warmup must be in [0, --steps), got {a.warmup}")
    cfg = BenchConfig(lr=a.lr, steps=a.steps, preset=a.preset, cut_slack=a.cut_slack)
    print(json.dumps(profile(cfg, a.warmup)), flush=True)


if __name__ == "__main__":
    main()
