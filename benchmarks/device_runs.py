"""The whole-program device checks: a learner step, the rollout engine, a PULSESync apply.

Companions of `benchmarks.device_checks` (same `Shapes`, `emit` and record conventions). Each
function runs one configuration, so the orchestrator (`benchmarks.device_check`) can give each
its own process: `peak_bytes_in_use` is a per-process high-water mark.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_checks import MODEL, TPU_AOT_GIB, Emit, Shapes, peak_gib, platform_kernel


def check_learner(shapes: Shapes, emit: Emit, *, seq_len: int, attention: str) -> None:
    """One learner step (loss + gradient + AdamW; Sparse-RL correction, DGG on) at Qwen2.5-0.5B,
    micro-batch 1, remat, bf16 over fp32 masters, T = `seq_len`, teacher-forcing attention
    `attention` ("auto": the platform's kernel): time and peak device memory, beside the
    TPU-compiled estimate."""
    from flax import nnx

    from benchmarks.learner import benchmark_learner, synthetic_batch
    from sparserl_jax.models import Transformer, model_preset
    from sparserl_jax.models.attention import resolve_attention
    from sparserl_jax.rl.config import LearnerConfig

    cfg = model_preset(MODEL, **shapes.model).replace(
        dtype="bfloat16", param_dtype="float32", remat=True, attention=attention
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    batch = synthetic_batch(
        batch=1, seq_len=seq_len, prompt_len=seq_len // 8, vocab=cfg.vocab_size, group_size=1
    )
    batch = batch._replace(advantages_b=jnp.ones(1))  # a group of 1 has advantage 0: no gradient
    got = benchmark_learner(model, LearnerConfig(), batch, steps=3)
    est = TPU_AOT_GIB.get(seq_len)
    emit(
        {
            "t": seq_len,
            "attention": attention,
            "attention_ran": resolve_attention(
                attention, jnp.bfloat16, cfg.head_dim, segmented=False
            ),
            "step_ms": got["step_ms"],
            "tokens_per_s": got["tokens_per_s"],
            "compile_s": got["compile_s"],
            "peak_gib": None if got["peak_bytes"] is None else got["peak_bytes"] / 2**30,
            "tpu_v5p_aot_total_gib": est and est["total"],
            "loss_finite": bool(np.isfinite(got["loss"])),
            "grad_norm": got["grad_norm"],
            "pass": bool(np.isfinite(got["loss"]) and np.isfinite(got["grad_norm"])),
        }
    )


def _kv_bytes_per_step(cfg, shapes: Shapes, sparse: bool, interval: int) -> float:
    """Mean KV bytes one decode step reads per slot (every kept token of every layer, K and V):
    prompt + s tokens at step s when dense; with compression the kept count as compressions
    leave it (back to the budget every `interval` steps once past it)."""
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16
    b, kept = shapes.engine_budget, []
    for s in range(shapes.engine_new):
        n = shapes.engine_prompt + s
        kept.append(n if not sparse or n <= b else b + (n - b) % interval)
    return per_token * float(np.mean(kept))


def _engine_model(shapes: Shapes, policy: str):
    """The engine tasks' model (Qwen2.5-0.5B shapes, random bf16 weights) and compression
    (None for dense, else `policy` at `engine_budget`)."""
    from flax import nnx

    from sparserl_jax.kvcache import CompressionConfig
    from sparserl_jax.models import Transformer, model_preset

    cfg = model_preset(MODEL, **shapes.model).replace(dtype="bfloat16", param_dtype="bfloat16")
    kv = None
    if policy != "dense":
        kv = CompressionConfig(
            policy=policy, budget=shapes.engine_budget, interval=shapes.engine_interval
        )
    return Transformer(cfg, rngs=nnx.Rngs(0)), kv


def check_engine(shapes: Shapes, emit: Emit, *, slots: int, policy: str, path: str) -> None:
    """Greedy decode of `engine_new` tokens in each of `slots` slots at Qwen2.5-0.5B shapes with
    random bf16 weights, dense or R-KV at `engine_budget`, through `path` (the XLA reference or
    the platform's Pallas kernels): tokens/s, peak device memory, and the bytes a decode step
    must move (weights + kept KV) for the roofline."""
    import os

    from flax import nnx

    from benchmarks.rollout import engine_runner, random_prompts
    from pallas_kernels._dispatch import KERNEL_IMPL_ENV

    os.environ[KERNEL_IMPL_ENV] = platform_kernel() if path == "kernel" else "xla"
    model, kv = _engine_model(shapes, policy)
    cfg = model.cfg
    prompts = random_prompts(cfg.vocab_size, slots, shapes.engine_prompt, seed=0)
    t0 = time.perf_counter()
    run = engine_runner(
        model, prompts, gen_len=shapes.engine_new, kv=kv, chunk_steps=shapes.engine_chunk
    )
    compile_s = time.perf_counter() - t0
    got = run()
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    interval = kv.interval if kv is not None else 1
    kv_bytes = slots * _kv_bytes_per_step(cfg, shapes, kv is not None, interval)
    step_ms = 1e3 * got["seconds"] / shapes.engine_new
    emit(
        {
            "slots": slots,
            "policy": policy,
            "path": path,
            "kernel_impl": os.environ[KERNEL_IMPL_ENV],
            "new_tokens": shapes.engine_new,
            "tokens_per_s": got["tokens_per_s"],
            "seconds": got["seconds"],
            "step_ms": step_ms,
            "compile_s": compile_s,
            "kv_peak_gib": got["kv_peak_bytes"] / 2**30,
            "peak_gib": peak_gib(),
            "tokens_evicted": got["tokens_evicted"],
            "weight_bytes": weights,
            "kv_bytes_per_step": kv_bytes,
            "bytes_per_step": weights + kv_bytes,
            "pass": bool(np.isfinite(got["tokens_per_s"])),
        }
    )


def check_engine_contract(shapes: Shapes, emit: Emit, *, policy: str) -> None:
    """The engine's contract through XLA and through the platform's kernels, in one process:
    `contract_slots` prompts sampled at T = 1 with the same keys, `contract_new` tokens each, at
    Qwen2.5-0.5B shapes with random bf16 weights (R-KV: past its budget, so it evicts); each
    path's sampler logprobs against the teacher-forced ones of the same weights
    (`dense_logprobs` with chunked attention, the run's own evictions replayed for R-KV), and how
    far the two paths sample the same tokens. bf16 sets no absolute tolerance here, so the check
    is relative: the kernels pass when their mean and p99 |sampler - teacher-forced| (and, for
    R-KV, the mean over tokens sampled after the row's first eviction) are each at most 1.5x
    XLA's + 1e-3, and the kernel's decode did not fall back to XLA. R-KV's XLA record also gives
    the error against the teacher without the replay: what a contract broken by eviction would
    look like."""
    import dataclasses
    import os

    from benchmarks.rollout import random_prompts
    from pallas_kernels._dispatch import KERNEL_IMPL_ENV, cdiv
    from pallas_kernels.paged_attention.api import decode_impl
    from sparserl_jax.rollout import RolloutConfig, RolloutEngine, dense_logprobs

    model, kv = _engine_model(shapes, policy)
    cfg = model.cfg
    slots, page = shapes.contract_slots, 16
    prompts = random_prompts(cfg.vocab_size, slots, shapes.engine_prompt, seed=1)
    config = RolloutConfig(
        num_slots=slots,
        max_prompt_len=shapes.engine_prompt,
        max_new_tokens=shapes.contract_new,
        temperature=1.0,
        chunk_steps=shapes.engine_chunk,
        kv=kv,
        page_size=page,
        record_evictions=kv is not None,
    )
    pool = (config.pool_pages, page, cfg.num_kv_heads, cfg.head_dim)
    pages = cdiv(shapes.engine_prompt + shapes.contract_new, page)
    # The teacher: one program for both paths (chunked attention, as "xla" makes `auto`); each
    # engine's own `kernel_impl` is explicit, so the environment does not reach it.
    os.environ[KERNEL_IMPL_ENV] = "xla"
    ids, errs, ran = {}, {}, {}
    for path in ("xla", "kernel"):
        which = platform_kernel() if path == "kernel" else "xla"
        ran[path] = decode_impl(pool, cfg.num_heads, slots, pages, impl=which)
        engine = RolloutEngine(model, dataclasses.replace(config, kernel_impl=which))
        t0 = time.perf_counter()
        res = engine.generate(prompts, seeds=list(range(slots)))
        seconds = time.perf_counter() - t0
        tokens_bt, mask_bt, sampler_bt = res.sequences()
        evict = None if kv is None else res.evictions(tokens_bt.shape[1])
        teacher_bt = np.asarray(dense_logprobs(model, None, tokens_bt, evict_pos_bykt=evict))
        err_bt = np.abs(sampler_bt - teacher_bt)
        err = err_bt[mask_bt]
        ids[path] = res.completion_ids
        errs[path] = {"mean": float(err.mean()), "p99": float(np.quantile(err, 0.99))}
        record = {
            "policy": policy,
            "path": path,
            "decode_ran": ran[path],
            "tokens": int(mask_bt.sum()),
            "tokens_evicted": int(res.tokens_evicted.sum()),
            "seconds_with_compile": seconds,
            "mean_abs_err": errs[path]["mean"],
            "p99_abs_err": errs[path]["p99"],
            "max_abs_err": float(err.max()),
        }
        if kv is not None:
            after = res.after_eviction(tokens_bt.shape[1])
            errs[path]["after_eviction"] = float(err_bt[after].mean()) if after.any() else 0.0
            record["mean_abs_err_after_eviction"] = errs[path]["after_eviction"]
            if path == "xla":
                blind_bt = np.asarray(dense_logprobs(model, None, tokens_bt))
                record["mean_abs_err_no_replay"] = float(
                    np.abs(sampler_bt - blind_bt)[mask_bt].mean()
                )
        emit(record)
    differ = ids["xla"] != ids["kernel"]
    first = np.where(differ.any(axis=1), differ.argmax(axis=1), differ.shape[1])
    emit(
        {
            "policy": policy,
            "path": "kernel vs xla",
            "rows_identical": float((first == differ.shape[1]).mean()),
            "mean_first_divergence": float(first.mean()),
            "tokens_per_row": differ.shape[1],
            "pass": ran["kernel"] != "xla"  # a kernel ran (no fallback passing trivially)
            and all(errs["kernel"][k] <= 1.5 * v + 1e-3 for k, v in errs["xla"].items()),
        }
    )


def check_sync(shapes: Shapes, emit: Emit) -> None:
    """PULSESync format 3 on a Qwen2.5-0.5B-shaped tree: fp32 masters moved by synthetic
    Adam-sized steps (`lr * N(0, 1)` per element) at each learning rate, published on the host,
    applied by a receiver on the device: apply GB/s (published bf16 bytes per second) and the
    received bits against bf16(master) rounded on the host (numpy, ml_dtypes)."""
    import ml_dtypes
    from flax import nnx

    from sparserl_jax.models import Transformer, model_preset
    from sparserl_jax.sync.codec import CodecConfig
    from sparserl_jax.sync.publisher import Publisher, SyncConfig
    from sparserl_jax.sync.receiver import Receiver
    from sparserl_jax.sync.transport import InProcessTransport

    cfg = model_preset(MODEL, **shapes.model).replace(param_dtype="float32")
    master = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0))))
    transport = InProcessTransport()
    config = SyncConfig(anchor_every=1000, codec=CodecConfig(format=3))
    pub = Publisher(transport, config=config)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    receiver = Receiver(lambda name, shape: sharding)
    t0 = time.perf_counter()
    first = pub.publish(master)
    receiver.sync(transport)
    jax.block_until_ready(list(receiver.arrays.values()))
    emit({"what": "anchor", "params": first.numel, "seconds": time.perf_counter() - t0})

    @jax.jit
    def adam_like(tree, key, lr):
        leaves, treedef = jax.tree.flatten(tree)
        keys = jax.random.split(key, len(leaves))
        moved = [x + lr * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
        return jax.tree.unflatten(treedef, moved)

    key = jax.random.key(1)
    for lr in shapes.sync_lrs:
        for i in range(shapes.sync_versions):
            key, sub = jax.random.split(key)
            # Waited for, so the publish timings below do not include this step.
            master = jax.block_until_ready(adam_like(master, sub, jnp.float32(lr)))
            # One record per phase, so a run cut off by its budget shows where the time went.
            t0 = time.perf_counter()
            out = pub.publish(master)
            encode_s = time.perf_counter() - t0
            rec = {"lr": lr, "version": out.version, "warm": i > 0}  # a first apply may compile
            emit(
                {
                    "what": "publish",
                    **rec,
                    "changed": out.total_changed,
                    "bytes": len(out.patch),
                    "bytes_per_changed": len(out.patch) / max(out.total_changed, 1),
                    "encode_s": encode_s,
                    "mask_s": out.mask_s,
                    "extract_s": out.extract_s,
                    "codec_s": out.encode_s,
                }
            )
            t0 = time.perf_counter()
            receiver.apply(transport.get(out.version, "patch"))
            jax.block_until_ready(list(receiver.arrays.values()))
            apply_s = time.perf_counter() - t0
            gb_per_s = out.dense_bytes / apply_s / 1e9
            emit({"what": "apply", **rec, "apply_s": apply_s, "apply_gb_per_s": gb_per_s})
            t0 = time.perf_counter()
            mismatched = 0
            for name, x in zip(pub.names, jax.tree.leaves(master), strict=True):
                want = np.asarray(x).astype(ml_dtypes.bfloat16).view(np.uint16)
                got = np.asarray(receiver.arrays[name]).view(np.uint16)
                mismatched += int(np.sum(want != got))
            check_s = time.perf_counter() - t0
            rec = {"what": "bits", **rec, "check_s": check_s, "err": float(mismatched), "tol": 0.0}
            emit({**rec, "pass": mismatched == 0})
