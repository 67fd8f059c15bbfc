"""The checks `make device-check` runs on an accelerator, each against XLA on the same device.

Each `check_*` function takes a `Shapes` (real shapes on a GPU/TPU, tiny ones for the CPU smoke
test) and `emit`, which records one JSON-ready dict as soon as it is measured, so a check cut off
by its time budget keeps what it finished. A record with a `tol` carries `err` and `pass`: the
tolerance is written next to the number it bounds. Imports are per check: the device machine may
lack grain and zstandard (only `sync` needs zstandard, for the format-3 header).

Timings are medians of repeated calls after a warm-up call (compilation is timed apart), each
call waited for with `block_until_ready`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Emit = Callable[[dict[str, Any]], None]

# Qwen2.5-0.5B (learner, engine, attention) and the learner-step estimate compiled ahead of time
# for one TPU v5p chip (docs/results.md, "Learner memory: bytes per chip at real shapes":
# micro-batch 1, remat, bf16 over fp32 masters): temporaries and the whole step, GiB, by T.
MODEL = "qwen2.5-0.5b"
TPU_AOT_GIB = {4096: {"temp": 2.35, "total": 7.87}, 16384: {"temp": 3.89, "total": 9.41}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
    """What each check runs at. `kernel_cases`: (page size, head dim, KV heads, group, pool
    pages, rows); `model`: overrides of the Qwen2.5-0.5B preset (empty: the real shapes)."""

    model: dict[str, Any]
    kernel_cases: tuple[tuple[int, int, int, int, int, int], ...]
    window: int = 8
    attention_t: int = 4096
    learner_ts: tuple[int, ...] = (4096, 16384)
    engine_slots: tuple[int, ...] = (256, 64)
    engine_prompt: int = 64
    engine_new: int = 2048
    engine_budget: int = 512
    engine_interval: int = 128
    engine_chunk: int = 128
    contract_slots: int = 32  # the engine contract, XLA vs kernels (sampled, T = 1)
    contract_new: int = 640  # prompt + 640 > the R-KV budget: it evicts
    sync_lrs: tuple[float, ...] = (1e-6, 1e-5)
    sync_versions: int = 2  # patches per lr; the first apply of a run may compile
    copy_mib: int = 2048
    reps: int = 10


REAL = Shapes(
    model={},
    kernel_cases=(
        (16, 64, 2, 7, 2048, 32),  # Qwen2.5-0.5B heads
        (128, 64, 2, 7, 256, 16),
        (16, 128, 4, 8, 2048, 32),  # Llama-3 / Qwen2.5-7B-like groups of 8
        (128, 128, 4, 8, 256, 16),
        (16, 128, 8, 1, 2048, 32),  # multi-head
        (128, 128, 8, 1, 256, 16),
    ),
)
TINY_MODEL = dict(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=14, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=512,
)  # fmt: skip
SMOKE = Shapes(
    model=TINY_MODEL,
    kernel_cases=((16, 16, 2, 7, 24, 4), (16, 16, 2, 1, 16, 2)),
    attention_t=64,
    learner_ts=(64,),
    engine_slots=(4,),
    engine_prompt=8,
    engine_new=40,
    engine_budget=24,
    engine_interval=8,
    engine_chunk=16,
    contract_slots=4,
    contract_new=40,
    copy_mib=8,
    reps=2,
)


def timed(fn: Callable, *args, reps: int) -> tuple[Any, float, float]:
    """`fn(*args)` once (compile + run, seconds), then the median of `reps` calls (ms)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, first, 1e3 * statistics.median(times)


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in fp64 (NaN anywhere: inf)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _bound(record: dict[str, Any], err: float, tol: float) -> dict[str, Any]:
    return {**record, "err": err, "tol": tol, "pass": bool(err <= tol)}


def platform_kernel() -> str:
    """The Pallas implementation of the target platform ("pallas_tpu" on TPU, else the GPU
    kernels, interpreted off a GPU), from `_dispatch.PLATFORM_KERNEL`."""
    from pallas_kernels._dispatch import PLATFORM_KERNEL, target_platform

    return PLATFORM_KERNEL.get(target_platform(), "pallas_gpu")


def peak_gib() -> float | None:
    """The device's `peak_bytes_in_use` in GiB (None where the backend does not report it)."""
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


# ---- env: the device and its memory bandwidth ------------------------------------------------


def check_env(shapes: Shapes, emit: Emit) -> None:
    """Devices, versions, and the measured HBM bandwidth (a device-to-device copy, bytes read +
    written), the denominator of the decode roofline."""
    dev = jax.devices()[0]
    emit(
        {
            "what": "device",
            "platform": dev.platform,
            "device_kind": dev.device_kind,
            "num_devices": jax.device_count(),
            "jax": jax.__version__,
            "jaxlib": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
            "flax": _version("flax"),
            "optax": _version("optax"),
            "bytes_limit": (dev.memory_stats() or {}).get("bytes_limit"),
        }
    )
    n = shapes.copy_mib * 2**20 // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0000001)  # a real pass: read n, write n
    _, _, ms = timed(copy, x, reps=shapes.reps)
    emit(
        {
            "what": "hbm_bandwidth",
            "bytes": 2 * x.nbytes,
            "ms": ms,
            "gb_per_s": 2 * x.nbytes / ms / 1e6,
        }
    )


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ---- kernels: paged attention, window scores, compaction vs their XLA references -------------


def _paged_inputs(case, seed: int):
    page, h, kh, g, pages, rows = case
    m = pages // rows
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(ks[0], (pages, page, kh, h), jnp.bfloat16)
    v = jax.random.normal(ks[1], (pages, page, kh, h), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(pages)[: rows * m].reshape(rows, m), jnp.int32)
    lengths = jnp.asarray(rng.integers(m * page // 2, m * page + 1, rows), jnp.int32)
    return ks[2], k, v, table, lengths


def check_kernels(shapes: Shapes, emit: Emit) -> None:
    """Each Pallas kernel of the target platform vs its XLA reference on the same device:
    numerics (relative L2 error, fp32 outputs of bf16 pools; compaction bit for bit) and
    milliseconds per call."""
    from pallas_kernels import compact_pages, paged_decode_attention, window_scores
    from pallas_kernels.paged_attention.api import decode_impl

    kernel = platform_kernel()
    reps = shapes.reps
    for case in shapes.kernel_cases:
        page, h, kh, g, pages, rows = case
        name = f"L{page}_H{h}_K{kh}_G{g}_P{pages}"
        qkey, k, v, table, lengths = _paged_inputs(case, seed=len(name))
        q = (jax.random.normal(qkey, (rows, kh * g, h)) / np.sqrt(h)).astype(jnp.bfloat16)
        # What the api runs for the kernel (XLA if it cannot compile these shapes).
        ran = decode_impl(k.shape, kh * g, rows, pages // rows, impl=kernel)
        base = {"case": name, "kernel": kernel, "ran": ran}

        for probs in (False, True):

            def attend(impl, probs=probs):
                return jax.jit(lambda *a: paged_decode_attention(*a, return_probs=probs, impl=impl))

            (want, want_p), _, xla_ms = timed(attend("xla"), q, k, v, table, lengths, reps=reps)
            (got, got_p), first, ms = timed(attend(kernel), q, k, v, table, lengths, reps=reps)
            err = rel_err(got, want)
            if probs:
                err = max(err, rel_err(got_p, want_p))
            op = "paged_attention" + ("+probs" if probs else "")
            rec = {**base, "op": op, "ms": ms, "xla_ms": xla_ms, "compile_s": first}
            emit(_bound(rec, err, 5e-3))  # fp32 math either side; TF32 dots on GPU ~1e-3

        w = shapes.window
        qw = (jax.random.normal(qkey, (rows, w, kh * g, h)) / np.sqrt(h)).astype(jnp.bfloat16)
        nq = jnp.full((rows,), w, jnp.int32)

        def scores(impl):
            return jax.jit(lambda *a: window_scores(*a, impl=impl))

        want, _, xla_ms = timed(scores("xla"), qw, k, table, lengths, nq, reps=reps)
        got, first, ms = timed(scores(kernel), qw, k, table, lengths, nq, reps=reps)
        rec = {**base, "op": "window_scores", "ms": ms, "xla_ms": xla_ms, "compile_s": first}
        emit(_bound(rec, rel_err(got, want), 5e-3))

        rng = np.random.default_rng(len(name) + 1)
        new_len = np.asarray(lengths) // 2
        keep = np.zeros((rows, kh, int(new_len.max())), np.int32)
        for b in range(rows):
            for j in range(kh):
                picked = np.sort(rng.choice(int(lengths[b]), int(new_len[b]), replace=False))
                keep[b, j, : new_len[b]] = picked
        keep, new_len = jnp.asarray(keep), jnp.asarray(new_len, jnp.int32)

        def compact(impl):
            # Donated, as in the engine: both paths update the pool in place.
            return jax.jit(
                lambda p, t, kp, n: compact_pages(p, t, kp, n, impl=impl), donate_argnums=0
            )

        want = np.asarray(compact("xla")(jnp.copy(k), table, keep, new_len)).view(np.uint16)
        got = np.asarray(compact(kernel)(jnp.copy(k), table, keep, new_len)).view(np.uint16)
        mismatched = int(np.sum(want != got))
        times = {}
        for impl in ("xla", kernel):
            fn, pool = compact(impl), jnp.copy(k)
            pool = jax.block_until_ready(fn(pool, table, keep, new_len))
            t0 = time.perf_counter()
            for _ in range(reps):  # compacting a compacted pool again is the same work
                pool = fn(pool, table, keep, new_len)
            jax.block_until_ready(pool)
            times[impl] = 1e3 * (time.perf_counter() - t0) / reps
        rec = {**base, "op": "compaction", "ms": times[kernel], "xla_ms": times["xla"]}
        emit(_bound(rec, float(mismatched), 0.0))  # a copy: bit for bit


# ---- learner attention: cuDNN (GPU) / splash (TPU) vs chunked, against dense fp32 ------------


def check_attention(shapes: Shapes, emit: Emit) -> None:
    """Teacher-forcing attention at Qwen2.5-0.5B heads, T = `attention_t`, bf16: forward and
    gradient of each implementation against the dense path in fp32 (relative L2), and time."""
    from pallas_kernels._dispatch import target_platform
    from sparserl_jax.models.attention import causal_attention, resolve_attention
    from sparserl_jax.models.presets import model_preset

    cfg = model_preset(MODEL, **shapes.model)
    t, n, kh, h = shapes.attention_t, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ks = jax.random.split(jax.random.key(0), 4)
    q = (jax.random.normal(ks[0], (1, t, n, h)) / np.sqrt(h)).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, t, kh, h), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, t, kh, h), jnp.bfloat16)
    ct = jax.random.normal(ks[3], (1, t, n, h), jnp.bfloat16)

    def fwd_bwd(impl, dtype):
        def loss(q, k, v):
            out = causal_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), impl=impl)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    (_, want_out), want_grads = fwd_bwd("dense", jnp.float32)(q, k, v)
    kernel = {"tpu": "splash", "gpu": "cudnn"}.get(target_platform())
    for impl in ("chunked", *([kernel] if kernel else [])):
        ran = resolve_attention(impl, jnp.bfloat16, h, segmented=False)
        ((_, out), grads), first, ms = timed(fwd_bwd(impl, jnp.bfloat16), q, k, v, reps=shapes.reps)
        fwd_only = jax.jit(lambda q, k, v, impl=impl: causal_attention(q, k, v, impl=impl))
        _, _, fwd_ms = timed(fwd_only, q, k, v, reps=shapes.reps)
        rec = {"impl": impl, "ran": ran, "t": t, "fwd_ms": fwd_ms, "fwd_bwd_ms": ms}
        rec["compile_s"] = first
        # bf16 inputs and outputs: one rounding of each output is ~2^-9 relative.
        emit(_bound({**rec, "what": "forward"}, rel_err(out, want_out), 1e-2))
        gerr = max(rel_err(g, w) for g, w in zip(grads, want_grads, strict=True))
        emit(_bound({**rec, "what": "gradient"}, gerr, 2e-2))
