"""Ahead-of-time TPU compiles of the kernels and whole programs from a CPU host (needs libtpu).

Used by `tools/bench_tpu_aot.py` and `tests/test_tpu_programs.py`. Nothing runs and no weights
are materialised: the model, the engine's cache and slot state and the learner's state are all
abstract (`nnx.eval_shape` / `jax.eval_shape`, ShapeDtypeStructs carrying shardings on the
devices of a TPU topology description), and each jitted program is lowered and compiled with
`jax.default_device(<topology device>)` so that kernel dispatch targets the TPU (Mosaic).

Per program: compile status, `memory_analysis()` (argument / output / temp bytes),
`cost_analysis()` (flops, bytes accessed), and whether the executable holds a Mosaic kernel
(`tpu_custom_call`). `hidden_states_program` is the decoder's loss and gradient without the LM
head, which isolates the teacher-forcing attention's temporaries (`ModelConfig.attention`).
`decode_roofline` compares the paged decode kernel with the XLA path.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pallas_kernels import _dispatch, compact_pages, paged_decode_attention, window_scores
from sparserl_jax.kvcache import CompressionConfig
from sparserl_jax.kvcache.evictions import record_shape
from sparserl_jax.models import ModelConfig, Transformer, model_preset
from sparserl_jax.models.attention import with_attention_mesh
from sparserl_jax.parallel import MeshConfig, batch_sharding, make_mesh, state_shardings
from sparserl_jax.rl.config import LearnerConfig
from sparserl_jax.rl.learner import Learner, LearnerState, RLBatch
from sparserl_jax.rl.objective import micro_loss
from sparserl_jax.rollout import RolloutConfig, RolloutEngine
from sparserl_jax.rollout.shards import slot_spec

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2")
POLICIES = ("none", "streaming", "snapkv", "h2o", "rkv")

# Published per-chip peaks (HBM bandwidth in bytes/s, dense bf16 FLOP/s), from Google Cloud's
# TPU system-architecture pages (cloud.google.com/tpu/docs/v5e, /v5p, /v6e): v5e 819 GB/s and
# 197 TFLOP/s, v5p 2765 GB/s and 459 TFLOP/s, v6e (Trillium) 1640 GB/s and 918 TFLOP/s.
PEAKS = {"v5e": (819e9, 197e12), "v5p": (2765e9, 459e12), "v6e": (1640e9, 918e12)}

GiB = 2**30


def topology_devices(name: str) -> list:
    """The devices of TPU topology `name` (e.g. "v5p:2x2x1"); raises without libtpu."""
    from jax.experimental import topologies

    # No chip is touched: several compiling processes may load libtpu at once (its lockfile).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return list(topologies.get_topology_desc(name, "tpu").devices)


def chip(name: str) -> str:
    return name.split(":")[0]


def summarize(compiled) -> dict[str, Any]:
    """Memory and cost figures of a compiled executable, and whether it holds a Mosaic kernel."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "mosaic": "tpu_custom_call" in compiled.as_text(),
        "mosaic_calls": mosaic_calls(compiled.as_text()),
    }


def mosaic_calls(hlo: str) -> dict[str, int]:
    """How many Mosaic custom calls of each kernel a compiled program holds, by the kernel
    function's name (`paged_decode_attention_tpu`, `window_scores_tpu`, `compact_pages_tpu`,
    splash's ...): XLA names each call's instruction after it (`%window_scores_tpu.1 = ...`)."""
    names = re.findall(
        r"%([A-Za-z_][\w]*?)(?:\.\d+)? = [^\n]*custom_call_target=\"tpu_custom_call\"", hlo
    )
    return dict(collections.Counter(names))


def total_bytes(summary: dict[str, Any]) -> int:
    """Peak bytes per device of a compiled program: its arguments, its outputs that do not
    alias (donated) arguments, and its temporaries."""
    r = summary
    return r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]


def compile_program(device, fn: Callable, *args) -> dict[str, Any]:
    """Lower and compile jitted `fn` on abstract `args` for `device`'s TPU; never raises: a
    failure is reported as {"ok": False, "error": ...}."""
    start = time.perf_counter()
    try:
        with jax.default_device(device):
            assert _dispatch.target_platform() == "tpu"
            compiled = fn.lower(*args).compile()
        out = {"ok": True, **summarize(compiled)}
    except Exception as e:  # a compile failure is a finding, reported, not raised
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    out["compile_s"] = round(time.perf_counter() - start, 1)
    return out


def _struct(x, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _place(tree, shardings) -> Any:
    """ShapeDtypeStructs of `tree` with `shardings` (one sharding, or a matching tree)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(_struct, tree, shardings)
    return jax.tree.map(lambda x: _struct(x, shardings), tree)


def _abstract_model(cfg: ModelConfig) -> nnx.Module:
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def _mesh(devices: list) -> Mesh | None:
    return None if len(devices) == 1 else make_mesh(MeshConfig(fsdp=-1), devices)


# ---- the rollout engine ------------------------------------------------------------------------


def engine_config(policy: str, *, slots=64, prompt=256, new=2048, page=16, budget=512):
    kv = None if policy == "none" else CompressionConfig(policy=policy, budget=budget)
    return RolloutConfig(
        num_slots=slots, max_prompt_len=prompt, max_new_tokens=new, page_size=page, kv=kv
    )


def engine_inputs(
    model_cfg: ModelConfig, rcfg: RolloutConfig, devices: list, mesh_cfg: MeshConfig | None = None
) -> tuple:
    """(engine, params, cache, slots, prefill inputs): abstract, placed on `devices` as the
    engine lays them out: one chip, or a mesh (`mesh_cfg`, default every chip on fsdp) where the
    weights follow the logical-axis rules, each data shard holds its own slots and pages
    (`rollout.shards`), the pools are split by KV head over the other axes when their count
    divides by them (else replicated), and the kernels run per chip."""
    abstract = _abstract_model(model_cfg)
    mesh = _mesh(devices) if mesh_cfg is None else make_mesh(mesh_cfg, devices)
    engine = RolloutEngine(abstract, rcfg, mesh=mesh)
    cache, slots = jax.eval_shape(engine._init)  # with the engine's own out shardings
    s, p = rcfg.num_slots, rcfg.max_prompt_len
    host = (
        jax.ShapeDtypeStruct((s, p), jnp.int32),
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s,), jnp.bool_),
        jax.ShapeDtypeStruct((s, 4), jnp.uint32),
    )
    if mesh is None:
        rep = param_sh = SingleDeviceSharding(devices[0])
        cache, slots, host = _place((cache, slots, host), rep)
    else:
        param_sh = nnx.to_pure_dict(state_shardings(nnx.state(abstract), mesh))
        by_slot = NamedSharding(mesh, slot_spec(mesh, rcfg.fsdp_shards))
        host = _place(host, by_slot)
    params = _place(engine.default_params, param_sh)
    return engine, params, cache, slots, host


def engine_programs(
    model_cfg: ModelConfig, rcfg: RolloutConfig, devices: list, mesh_cfg: MeshConfig | None = None
) -> dict:
    """Compile the engine's prefill and decode chunk for `devices` (see `engine_inputs`)."""
    engine, params, cache, slots, prefill_in = engine_inputs(model_cfg, rcfg, devices, mesh_cfg)
    return {
        "prefill": compile_program(devices[0], engine._prefill, params, cache, slots, *prefill_in),
        "decode_chunk": compile_program(devices[0], engine._chunk, params, cache, slots),
    }


# ---- the learner -------------------------------------------------------------------------------


def _head_record(model_cfg: ModelConfig, seq_len: int) -> tuple[int, int, int]:
    """One row's eviction record at the finest granularity (per layer and KV head)."""
    return record_shape(
        "head", layers=model_cfg.num_layers, kv_heads=model_cfg.num_kv_heads, max_len=seq_len
    )


def learner_inputs(
    model_cfg: ModelConfig, lcfg: LearnerConfig, devices: list, *, batch=8, seq_len=2048
) -> tuple:
    """(learner, state, batch, pass index, rows' energy) of `Learner`'s step (fp32 master
    weights, AdamW state, no reference logprobs; with `learner.attention_mask=replay` an
    eviction record per layer and KV head): abstract, placed on `devices` as the learner lays
    them out."""
    abstract = _abstract_model(model_cfg.replace(param_dtype="float32"))
    mesh = _mesh(devices)
    learner = Learner(abstract, lcfg, mesh=mesh)
    params = nnx.to_pure_dict(nnx.state(abstract))

    def build(p):
        zero = jnp.zeros((), jnp.int32)
        return LearnerState(p, learner.tx.init(p), learner.gate.init(), zero, zero, zero)

    state = jax.eval_shape(build, params)
    b, t = batch, seq_len
    rl_batch = RLBatch(
        jax.ShapeDtypeStruct((b, t), jnp.int32),
        jax.ShapeDtypeStruct((b, t), jnp.bool_),
        jax.ShapeDtypeStruct((b,), jnp.float32),
        jax.ShapeDtypeStruct((b, t), jnp.float32),
        jax.ShapeDtypeStruct((b, t), jnp.float32),
        None,
    )
    if lcfg.attention_mask == "replay":
        record = jax.ShapeDtypeStruct((b, *_head_record(model_cfg, t)), jnp.int32)
        rl_batch = rl_batch._replace(evict_pos_bykt=record)
    pass_index = jax.ShapeDtypeStruct((), jnp.int32)
    rows_energy = jax.ShapeDtypeStruct((), jnp.float32)
    if mesh is None:
        one = SingleDeviceSharding(devices[0])
        state, rl_batch, pass_index, rows_energy = _place(
            (state, rl_batch, pass_index, rows_energy), one
        )
    else:
        state = _place(state, learner.state_shardings)
        layout = learner._layout(rl_batch)
        rl_batch = RLBatch(
            *(x if x is None else _struct(x, s) for x, s in zip(rl_batch, layout, strict=True))
        )
        pass_index = _struct(pass_index, NamedSharding(mesh, PartitionSpec()))
        rows_energy = _struct(rows_energy, NamedSharding(mesh, PartitionSpec()))
    return learner, state, rl_batch, pass_index, rows_energy


def learner_program(
    model_cfg: ModelConfig, lcfg: LearnerConfig, devices: list, *, batch=8, seq_len=2048
) -> dict:
    """Compile `Learner`'s step (see `learner_inputs`)."""
    learner, *args = learner_inputs(model_cfg, lcfg, devices, batch=batch, seq_len=seq_len)
    return compile_program(devices[0], learner._compiled_step(args[1]), *args)


def hidden_states_program(model_cfg: ModelConfig, device, *, batch=1, seq_len=4096) -> dict:
    """Compile the loss + gradient of the decoder without its head (`sum(h^2)` of the final
    hidden states, fp32 master weights, `model_cfg`'s compute dtype, remat and attention) for
    one chip: the attention's and blocks' temporaries apart from the `[T, V]` logits."""
    abstract = _abstract_model(model_cfg.replace(param_dtype="float32"))
    graphdef, state = nnx.split(abstract)
    one = SingleDeviceSharding(device)
    params = _place(nnx.to_pure_dict(state), one)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=one)

    def loss(p, tokens_bt):
        h_btd = nnx.merge(graphdef, p).hidden_states(tokens_bt)
        return jnp.sum(jnp.square(h_btd.astype(jnp.float32)))

    return compile_program(device, jax.jit(jax.value_and_grad(loss)), params, tokens)


def loss_grad_inputs(
    model_cfg: ModelConfig, lcfg: LearnerConfig, devices: list, *, batch=1, seq_len=4096
) -> tuple:
    """(jitted loss + gradient, params, tied head, micro-batch) of the learner's own micro-batch
    loss (`rl.objective.micro_loss` under `value_and_grad`, pi_old given; the gradients are
    outputs, laid out like the parameters, no optimizer): abstract, placed on `devices` as the
    learner lays them out (one chip, or fsdp over them with the batch's rows split, traced under
    the mesh as the learner's step is), with an eviction record per layer and KV head under
    `learner.attention_mask=replay`. The step's temporaries apart from the gradient buffers
    and the AdamW update."""
    abstract = _abstract_model(model_cfg.replace(param_dtype="float32"))
    graphdef, state = nnx.split(abstract)
    mesh = _mesh(devices)
    tied = model_cfg.tie_embeddings
    loss = functools.partial(micro_loss, graphdef=graphdef, config=lcfg, tied=tied)
    grad_fn = with_attention_mesh(mesh, jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    if mesh is None:
        param_sh = rows = SingleDeviceSharding(devices[0])
        fn = jax.jit(grad_fn)
    else:
        param_sh = nnx.to_pure_dict(state_shardings(state, mesh))
        rows = batch_sharding(mesh, 2)
        head_sh = param_sh["embed"]["embedding"] if tied else None
        rep = NamedSharding(mesh, PartitionSpec())
        fn = jax.jit(grad_fn, out_shardings=(rep, (param_sh, head_sh)))
    params = _place(nnx.to_pure_dict(state), param_sh)
    head = params["embed"]["embedding"] if tied else None
    mb = {"tokens": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=rows)}
    for k in ("old_logp", "adv", "pg_coef", "reg_coef", "tok_w"):
        mb[k] = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32, sharding=rows)
    if lcfg.attention_mask == "replay":
        rows4 = rows if mesh is None else batch_sharding(mesh, 4)
        record = (batch, *_head_record(model_cfg, seq_len))
        mb["evict_pos"] = jax.ShapeDtypeStruct(record, jnp.int32, sharding=rows4)
    return fn, params, head, mb


def loss_grad_program(
    model_cfg: ModelConfig, lcfg: LearnerConfig, devices: list, *, batch=1, seq_len=4096
) -> dict:
    """Compile the learner's micro-batch loss and gradient (see `loss_grad_inputs`)."""
    fn, *args = loss_grad_inputs(model_cfg, lcfg, devices, batch=batch, seq_len=seq_len)
    return compile_program(devices[0], fn, *args)


# ---- kernels and the decode roofline -----------------------------------------------------------


def _kernel_structs(device, *shapes_dtypes):
    sh = SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes_dtypes]


def decode_shapes(cfg: ModelConfig, *, slots: int, seq_len: int, page: int) -> tuple:
    """Paged-attention operands of one layer's decode step: every slot holds `seq_len` tokens."""
    k, h = cfg.num_kv_heads, cfg.head_dim
    m = -(-seq_len // page)
    dt = jnp.dtype(cfg.dtype)
    return (
        ((slots, cfg.num_heads, h), dt),
        ((slots * m, page, k, h), dt),
        ((slots * m, page, k, h), dt),
        ((slots, m), jnp.int32),
        ((slots,), jnp.int32),
    )


def kernel_programs(cfg: ModelConfig, device, *, slots=64, seq_len=2304, page=16, window=8):
    """Compile each kernel at the preset's heads (paged decode also with impl="xla")."""
    attn = decode_shapes(cfg, slots=slots, seq_len=seq_len, page=page)
    q, kp, _, table, lens = attn
    out = {}
    for impl in ("auto", "xla"):
        fn = jax.jit(functools.partial(paged_decode_attention, return_probs=False, impl=impl))
        out[f"paged_decode[{impl}]"] = compile_program(device, fn, *_kernel_structs(device, *attn))
    wq = ((slots, window, cfg.num_heads, cfg.head_dim), q[1])
    ws = _kernel_structs(device, wq, kp, table, lens, lens)
    out["window_scores"] = compile_program(device, jax.jit(window_scores), *ws)
    keep = ((slots, cfg.num_kv_heads, table[0][1] * page // 4), jnp.int32)
    cs = _kernel_structs(device, kp, table, keep, lens)
    out["compact_pages"] = compile_program(device, jax.jit(compact_pages), *cs)
    return out


def decode_roofline(
    cfg: ModelConfig, topology: str, kernels: dict, *, slots: int, seq_len: int
) -> dict:
    """Roofline time of one layer's paged decode attention: max(bytes / HBM bandwidth,
    flops / peak bf16). The Mosaic call is opaque to XLA's cost model, so its figure is the
    analytic minimum (read every live K and V once, write the output); the XLA path's figure
    is XLA's own `bytes accessed` (the gathered pages are materialised, then read again)."""
    bw, peak = PEAKS[chip(topology)]
    item = jnp.dtype(cfg.dtype).itemsize
    k, g, h = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    kv_bytes = 2 * slots * seq_len * k * h * item
    qo_bytes = 2 * slots * k * g * h * item
    flops = 4 * slots * k * g * seq_len * h  # q.k and p.v, 2 flops per multiply-add
    rows = {}
    for impl, key in (("pallas", "paged_decode[auto]"), ("xla", "paged_decode[xla]")):
        got = kernels.get(key, {})
        if impl == "xla" and got.get("ok"):
            b, f = got["bytes_accessed"], max(got["flops"], flops)
        else:
            b, f = kv_bytes + qo_bytes, flops
        t_mem, t_flop = b / bw, f / peak
        rows[impl] = {
            "bytes": b,
            "flops": f,
            "t_hbm_us": round(t_mem * 1e6, 2),
            "t_flops_us": round(t_flop * 1e6, 2),
            "roofline_us": round(max(t_mem, t_flop) * 1e6, 2),
            "bound": "memory" if t_mem >= t_flop else "compute",
        }
    per_step = {k_: v["roofline_us"] * cfg.num_layers for k_, v in rows.items()}
    return {"per_layer": rows, "decode_step_attention_us": per_step}


def qwen_05b(dtype: str = "bfloat16", remat: bool = True) -> ModelConfig:
    return model_preset("qwen2.5-0.5b").replace(dtype=dtype, param_dtype=dtype, remat=remat)


def force_xla_env() -> Callable[[], None]:
    """Set SPARSERL_KERNEL_IMPL=xla; returns the undo."""
    before = os.environ.get(_dispatch.KERNEL_IMPL_ENV)
    os.environ[_dispatch.KERNEL_IMPL_ENV] = "xla"

    def undo():
        if before is None:
            os.environ.pop(_dispatch.KERNEL_IMPL_ENV, None)
        else:
            os.environ[_dispatch.KERNEL_IMPL_ENV] = before

    return undo


def run_all(
    topologies=TOPOLOGIES,
    *,
    policies=POLICIES,
    programs=("kernels", "engine", "learner"),
    mesh_topology: str | None = "v5p:2x2x1",
    model_cfg: ModelConfig | None = None,
    slots=64,
    prompt=256,
    new=2048,
    page=16,
    budget=512,
    batch=8,
    seq_len=2048,
    micro_batches=2,
    log: Callable[[str], None] = print,
) -> dict:
    """Every requested program on one chip of each topology (and, for the engine and learner,
    on the whole `mesh_topology` with fsdp over its chips). Returns the nested results."""
    cfg = model_cfg or qwen_05b()
    lcfg = LearnerConfig(num_micro_batches=micro_batches)
    targets = [(t, 1) for t in topologies]
    if mesh_topology:
        targets.append((mesh_topology, len(topology_devices(mesh_topology))))
    results: dict[str, Any] = {"targets": {}}
    for topo, n in targets:
        devices = topology_devices(topo)[:n]
        key = f"{topo}/{n}chip"
        res = results["targets"].setdefault(key, {})
        if "kernels" in programs and n == 1:
            kern = kernel_programs(cfg, devices[0], slots=slots, seq_len=prompt + new, page=page)
            res["kernels"] = kern
            res["roofline"] = decode_roofline(cfg, topo, kern, slots=slots, seq_len=prompt + new)
            log(f"{key} kernels {_brief(kern)}")
        if "engine" in programs:
            for policy in policies:
                rc = engine_config(
                    policy, slots=slots, prompt=prompt, new=new, page=page, budget=budget
                )
                res[f"engine[{policy}]"] = got = engine_programs(cfg, rc, devices)
                log(f"{key} engine[{policy}] {_brief(got)}")
        if "learner" in programs:
            res["learner"] = got = learner_program(cfg, lcfg, devices, batch=batch, seq_len=seq_len)
            log(f"{key} learner {_brief({'step': got})}")
        if "loss_grad" in programs:
            got = loss_grad_program(cfg, lcfg, devices, batch=batch, seq_len=seq_len)
            res["loss_grad"] = got
            temp = got.get("temp_bytes", 0) / GiB
            log(f"{key} loss_grad {_brief({'loss+grad': got})} temp {temp:.2f} GiB")
        if "hidden" in programs and n == 1:
            got = hidden_states_program(cfg, devices[0], batch=batch, seq_len=seq_len)
            res["hidden"] = got
            temp = got.get("temp_bytes", 0) / GiB
            log(f"{key} hidden {_brief({'loss+grad': got})} temp {temp:.2f} GiB")
    return results


def _brief(named: dict) -> str:
    parts = []
    for name, r in named.items():
        if not r.get("ok"):
            parts.append(f"{name}: FAILED ({r.get('error', '')[:200]})")
            continue
        mem = total_bytes(r) / GiB
        parts.append(
            f"{name}: ok {r['compile_s']}s mem {mem:.2f} GiB "
            f"{r['flops'] / 1e9:.1f} GFLOP mosaic={r['mosaic']}"
        )
    return "; ".join(parts)
