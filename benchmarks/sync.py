"""PULSESync benchmark: train a random transformer with AdamW and sync every optimizer step.

The model (default ~32M parameters) learns next-token prediction on synthetic sequences drawn from
a fixed random sparse bigram chain, so the loss really falls and the updates are real Adam
updates. After every step the fp32 master is published as bf16 via `Publisher`, carried by an
`InProcessTransport` and applied by a `Receiver`; each step's receiver bits are compared with an
independent `bits(bf16(master))`. Figures: changed elements, payload bytes vs dense bf16 and
zstd(dense bf16), bytes per changed element, and encode/apply throughput. Encode throughput is
given both for the patches alone and with the anchors included (`encode_with_anchors_*`: every
publish's whole time, the anchor every `anchor_every` versions in it, over the patches' bytes).

Every patch is applied by three receivers side by side: `Receiver(verify="all")` (the default),
`Receiver(verify="touched")` and the first receiver's apply (`benchmarks.sync_apply_v1`, "before"),
each timed and checked bit for bit. The XLA executables built during each step's publish and
each receiver's apply are counted (`sparserl_jax.compiles`).
Each step also reports the empirical entropy bound of the patch given the receiver's context
(`values.entropy_bound`: mask entropy per leaf and old exponent + value-step entropy).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks.bigram import stream
from benchmarks.sync_apply_v1 import ReceiverV1
from sparserl_jax.compiles import CompileCount
from sparserl_jax.models import Transformer, model_preset
from sparserl_jax.sync import entropy_bound
from sparserl_jax.sync.codec import CodecConfig
from sparserl_jax.sync.publisher import Publisher, SyncConfig
from sparserl_jax.sync.receiver import Receiver
from sparserl_jax.sync.transport import InProcessTransport

# `--preset` names -> `sparserl_jax.models.MODEL_PRESETS` names.
PRESETS = {"tiny": "sync-tiny", "cpu": "sync-cpu"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One benchmark run. `lr`: AdamW learning rate; `steps`: optimizer steps (one sync each)."""

    lr: float = 1e-6
    steps: int = 10
    preset: str = "cpu"
    batch: int = 4
    seq_len: int = 128
    weight_decay: float = 0.01
    anchor_every: int = 10
    zstd_level: int = 1
    cut_slack: float = CodecConfig.cut_slack
    seed: int = 0

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"preset {self.preset!r} unknown; expected one of {sorted(PRESETS)}")
        if not self.lr > 0 or self.steps < 1 or self.batch < 1 or self.seq_len < 2:
            raise ValueError(
                f"need lr > 0, steps >= 1, batch >= 1, seq_len >= 2; got lr={self.lr}, "
                f"steps={self.steps}, batch={self.batch}, seq_len={self.seq_len}"
            )


def _model(cfg: BenchConfig):
    mcfg = model_preset(PRESETS[cfg.preset], param_dtype="float32", dtype="float32")
    return Transformer(mcfg, rngs=nnx.Rngs(cfg.seed)), mcfg.vocab_size


def _zstd_size(bits_tree, level: int) -> int:
    import zstandard

    c = zstandard.ZstdCompressor(level=level)
    return sum(len(c.compress(np.asarray(x).tobytes())) for x in jax.tree.leaves(bits_tree))


def masters(cfg: BenchConfig):
    """The fp32 master tree (`nnx.to_pure_dict`) before training and after each of `cfg.steps`
    AdamW steps, with the step's loss (None first)."""
    model, vocab = _model(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, tokens_bt):
        def loss_fn(p):
            logits_btv = nnx.merge(graphdef, p, rest)(tokens_bt[:, :-1])
            labels_bt = tokens_bt[:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(logits_btv, labels_bt).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    yield nnx.to_pure_dict(params), None
    batches = map(jnp.asarray, stream(vocab, cfg.batch, cfg.seq_len, cfg.seed + 1))
    for _ in range(cfg.steps):
        params, opt_state, loss = train_step(params, opt_state, next(batches))
        master = nnx.to_pure_dict(params)
        jax.block_until_ready(master)
        yield master, loss


def run(cfg: BenchConfig, log=None) -> dict:
    """Train `cfg.steps` AdamW steps, syncing each one; returns the JSON-ready summary."""
    trained = masters(cfg)
    initial, _ = next(trained)

    @jax.jit
    def published_bits(tree):
        return jax.tree.map(
            lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16), tree
        )

    codec = CodecConfig(zstd_level=cfg.zstd_level, cut_slack=cfg.cut_slack)
    transport = InProcessTransport()
    pub = Publisher(transport, config=SyncConfig(anchor_every=cfg.anchor_every, codec=codec))
    device = jax.devices()[-1]  # the sampler's device (the last fake CPU device when several)
    sharding = jax.sharding.SingleDeviceSharding(device)
    receivers = {
        "all": Receiver(lambda name, shape: sharding),
        "touched": Receiver(lambda name, shape: sharding, verify="touched"),
        "before": ReceiverV1(lambda name, shape: sharding),
    }
    first = pub.publish(initial)
    master_per_published = sum(x.nbytes for x in jax.tree.leaves(initial)) / first.dense_bytes
    for rc in receivers.values():
        rc.sync(transport)
    prev = [np.asarray(x) for x in jax.tree.leaves(published_bits(initial))]
    steps, enc_s, enc_cpu_s, scanned = [], 0.0, 0.0, 0
    anchor_s, anchor_cpu_s, anchors = 0.0, 0.0, 0
    app_s, app_cpu_s = dict.fromkeys(receivers, 0.0), dict.fromkeys(receivers, 0.0)
    compiles = {k: [] for k in ("publish", *receivers)}
    for step, (master, loss) in enumerate(trained):
        t0, c0 = time.perf_counter(), time.process_time()
        with CompileCount() as cc:
            out = pub.publish(master)
        t1, c1 = time.perf_counter(), time.process_time()
        compiles["publish"].append(cc.total)
        blob = transport.get(out.version, "patch")
        expect = [np.asarray(e) for e in jax.tree.leaves(published_bits(master))]
        rec_apply, identical = {}, True
        order = list(receivers)
        order = order[step % len(order) :] + order[: step % len(order)]  # no receiver always first
        for name in order:
            rc = receivers[name]
            ta, ca = time.perf_counter(), time.process_time()
            with CompileCount() as cc:
                rc.apply(blob)
                jax.block_until_ready(list(rc.arrays.values()))
            rec_apply[name] = (time.perf_counter() - ta, time.process_time() - ca)
            compiles[name].append(cc.total)
            identical &= all(
                np.array_equal(e, np.asarray(rc.arrays[n]).view(np.uint16))
                for n, e in zip(pub.names, expect, strict=True)
            )
        bounds = [entropy_bound(o, e, "bfloat16") for o, e in zip(prev, expect, strict=True)]
        bound = np.sum(bounds, axis=0)
        prev = expect
        # Anchors (every K versions) are timed apart: encode GB/s is the per-step patch path,
        # and with the anchors' time added, what a publisher spends per version in all.
        if step or cfg.steps == 1:  # step 1 includes jit compilation
            enc_s += t1 - t0 - out.anchor_s
            enc_cpu_s += c1 - c0 - out.anchor_cpu_s
            anchor_s += out.anchor_s
            anchor_cpu_s += out.anchor_cpu_s
            anchors += out.anchor is not None
            for name, (w, c) in rec_apply.items():
                app_s[name] += w
                app_cpu_s[name] += c
            scanned += out.dense_bytes
        changed = out.total_changed
        rec = {
            "changed": changed,
            "sparsity": 1.0 - changed / out.numel,
            "payload_bytes": len(out.patch),
            "dense_bf16_bytes": out.dense_bytes,
            "ratio": out.dense_bytes / len(out.patch),
            "bytes_per_changed": len(out.patch) / max(changed, 1),
            "bound_mask_bytes": float(bound[0]),
            "bound_value_bytes": float(bound[1]),
            "bound_per_changed": float(bound.sum()) / max(changed, 1),
            "bit_identical": bool(identical),
            "loss": float(loss),
            "encode_s": t1 - t0 - out.anchor_s,
            "encode_cpu_s": c1 - c0 - out.anchor_cpu_s,
            "mask_s": out.mask_s,
            "extract_s": out.extract_s,
            "codec_s": out.encode_s,
            "anchor_s": out.anchor_s,
            "apply_s": rec_apply["all"][0],
            "apply_touched_s": rec_apply["touched"][0],
            "apply_before_s": rec_apply["before"][0],
            "compiles_publish": compiles["publish"][-1],
            "compiles_apply": compiles["all"][-1],
            "compiles_apply_touched": compiles["touched"][-1],
            "compiles_apply_before": compiles["before"][-1],
        }
        steps.append(rec)
        if log is not None:
            log(
                f"step {step + 1}: "
                + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                )
            )
    applied = {
        f"apply{'' if k == 'all' else '_' + k}_{unit}": scanned / secs[k] / 1e9
        for k in receivers
        for unit, secs in (("gb_per_s", app_s), ("gb_per_cpu_s", app_cpu_s))
    }
    return {
        "params": first.numel,
        "lr": cfg.lr,
        "steps": steps,
        "ratio_median": statistics.median(s["ratio"] for s in steps),
        "bytes_per_changed_median": statistics.median(s["bytes_per_changed"] for s in steps),
        "bound_per_changed_median": statistics.median(s["bound_per_changed"] for s in steps),
        "sparsity_median": statistics.median(s["sparsity"] for s in steps),
        # Baseline: each dense bf16 tensor through zstd level 3 (stronger than the patch's level).
        "zstd_dense_bf16_bytes": _zstd_size(pub.sent_bits, 3),
        "anchor_bytes": len(first.anchor),
        # GB/s of published bf16 bytes (2 per parameter); the fp32 master read is twice that.
        "encode_gb_per_s": scanned / enc_s / 1e9,
        "encode_master_gb_per_s": scanned * master_per_published / enc_s / 1e9,
        # Per CPU-second of this process (all its threads): less sensitive to a shared machine.
        "encode_gb_per_cpu_s": scanned / enc_cpu_s / 1e9,
        # The same with the anchors (every `anchor_every` versions, `anchors` of them in the
        # timed steps) in the time: a publisher's whole cost per version.
        "anchors": anchors,
        "anchor_s_mean": anchor_s / max(anchors, 1),
        "encode_with_anchors_gb_per_s": scanned / (enc_s + anchor_s) / 1e9,
        "encode_with_anchors_gb_per_cpu_s": scanned / (enc_cpu_s + anchor_cpu_s) / 1e9,
        # Apply GB/s of published bf16 bytes, per receiver: "apply" is verify="all" (default),
        # "apply_touched" verify="touched", "apply_before" the first receiver's apply (unpadded
        # scatters, `benchmarks.sync_apply_v1`).
        **applied,
        # XLA executables built per step (publish and each receiver's apply), and the last step
        # (1-based) that built any: flat after it.
        "compiles_per_step": compiles,
        "last_compiling_step": {
            k: max((i + 1 for i, n in enumerate(v) if n), default=0) for k, v in compiles.items()
        },
        "loadavg_1m": os.getloadavg()[0],  # other work on the machine slows every timing
        "all_bit_identical": all(s["bit_identical"] for s in steps),
    }
