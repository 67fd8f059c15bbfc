"""Per-chip memory of the learner step and the rollout engine at real shapes, by the TPU compiler.

Used by `tools/bench_memory.py`. One *spec* (a JSON-able dict) is one program at one shape on one
mesh; `measure(spec)` compiles it ahead of time for a TPU topology from this CPU host (through
`benchmarks.tpu_aot`: abstract inputs, nothing runs, no weights) and returns one *row*:

- `params_bytes`, `opt_state_bytes` (learner step) or `kv_cache_bytes` (engine): what the
  program's arguments hold per chip, from the shardings they are laid out with (a learner
  `loss_grad` row, one micro-batch's loss and gradient, holds no optimizer state);
- `temp_bytes`: XLA's `memory_analysis()` temporaries per chip (activations, logits, gradients
  before they land in the donated state);
- `total_bytes`: arguments + outputs that alias no donated argument + temporaries, per chip
  (`tpu_aot.total_bytes`), and whether that fits one v5p chip (95 GiB) and one H100 (80 GiB;
  the same bytes, as compiled for the TPU: a GPU build lays memory out differently).

Configs go through the project's own config machinery (`sparserl_jax.config.load_config`): a
spec's `sets` are `dotted.key=value` overrides of the `Config` schema (`learner.*`,
`model.*`, `rollout.*`), so keys added to those dataclasses later work without a change here. A
`model.X` whose X is a `ModelConfig` field but not a `ModelSpec` one is routed to
`model.arch.X`.

`sweep(specs)` runs each spec in a fresh `python -m benchmarks.memory SPEC` (a compile of a
7B step holds gigabytes that the next compile does not need); the persistent compilation cache
stays off (executables compiled for a topology without a client cannot be read back).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from benchmarks import memory_tunix, tpu_aot
from sparserl_jax.config import Config, ModelSpec, load_config
from sparserl_jax.models import ModelConfig
from sparserl_jax.parallel.sharding import MeshConfig

# Checkpoint shapes of issue 15 (registry names), the default sweep's subsets, and the lengths.
PRESETS = ("qwen2.5-0.5b", "qwen3-0.6b", "qwen2.5-1.5b", "qwen2.5-7b", "llama3.2-1b")
ENGINE_PRESETS = (*PRESETS, "qwen2.5-32b")  # the engine only: 32B's learner needs a pod
SEQ_LENS = (4096, 16384, 32768)
LEARNER_PROGRAMS = ("step", "loss_grad")
# The smallest v5p topology holding this many chips (the first `chips` devices are used).
TOPOLOGY = {1: "v5p:2x2x1", 4: "v5p:2x2x1", 8: "v5p:2x2x2", 16: "v5p:2x2x4"}
GiB = 2**30
# Per-chip HBM in GiB: v5p 95 (the TPU compiler's own limit is 95.74 GiB; it refuses larger
# programs), H100 80.
HBM = {"v5p": 95 * GiB, "h100": 80 * GiB}


# ---- configs -----------------------------------------------------------------------------------


def route_override(item: str) -> str:
    """`model.X=v` -> `model.arch.X=v` when X is a `ModelConfig` field and not a `ModelSpec` one
    (so an architecture key reads as in `ModelConfig`); anything else unchanged."""
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    spec = {f.name for f in dataclasses.fields(ModelSpec)}
    arch = {f.name for f in dataclasses.fields(ModelConfig)}
    if sep and len(parts) >= 2 and parts[0] == "model" and parts[1] in arch - spec:
        return ".".join(["model", "arch", *parts[1:]]) + "=" + value
    return item


def config_for(spec: dict[str, Any]) -> Config:
    """The `Config` of one spec: its preset, dtypes, remat and shape, then its `sets`."""
    base = [f"model.preset={spec['preset']}", "model.dtype=bfloat16"]
    if spec["kind"] in ("learner", "tunix"):
        base += ["model.param_dtype=float32", f"model.remat={str(spec['remat']).lower()}"]
    else:  # the sampler holds bf16 weights
        base += ["model.param_dtype=bfloat16"]
        kv = ["rollout.kv=null"]
        if spec["policy"] != "none":
            kv = [f"rollout.kv.policy={spec['policy']}", f"rollout.kv.budget={spec['budget']}"]
        base += [
            f"rollout.num_slots={spec['slots']}",
            f"rollout.max_prompt_len={spec['prompt_len']}",
            f"rollout.max_new_tokens={spec['max_len'] - spec['prompt_len']}",
            *kv,
        ]
    return load_config(None, [*base, *(route_override(s) for s in spec.get("sets", ()))])


def check(specs: Sequence[dict]) -> None:
    """Raise `ConfigError` (naming the key) for the first spec whose config does not validate,
    before any compile starts."""
    for spec in specs:
        config_for(spec)


# ---- bytes -------------------------------------------------------------------------------------


def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of a tree of ShapeDtypeStructs carrying shardings (a replicated
    leaf counts whole on every chip)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


_OOM = re.compile(r"Ran out of memory in memory space hbm|Ran out of memory on HBM")
_OOM_TEMP = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def _finish(row: dict, got: dict) -> dict:
    row["ok"] = got["ok"]
    row["compile_s"] = got["compile_s"]
    if not got["ok"]:
        row["error"] = got["error"]
        if _OOM.search(got["error"]):
            # The TPU compiler refuses a program larger than the chip's HBM (v5p: 95 GiB):
            # it fits neither chip; the temporaries it names are kept when it names them.
            row.update(oom=True, fits_v5p=False, fits_h100=False)
            if m := _OOM_TEMP.search(got["error"]):
                row["temp_bytes"] = int(float(m[1]) * 1024 ** ("KMGT".index(m[2]) + 1))
        return row
    for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes"):
        row[k] = got[k]
    row["total_bytes"] = total = tpu_aot.total_bytes(got)
    row.update({f"fits_{hw}": total <= cap for hw, cap in HBM.items()})
    return row


# ---- one spec ----------------------------------------------------------------------------------


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile one spec in this process; a bad config or a failed compile is a row with
    `ok: False` and the error, never an exception."""
    row = dict(spec)
    try:
        cfg = config_for(spec)
        topology = spec.get("topology") or TOPOLOGY[spec["chips"]]
        devices = tpu_aot.topology_devices(topology)[: spec["chips"]]
        model_cfg = cfg.model.model_config()
        if spec["kind"] == "learner":
            return _measure_learner(row, cfg, model_cfg, devices)
        if spec["kind"] == "tunix":
            return _measure_tunix(row, model_cfg, devices)
        return _measure_engine(row, cfg, model_cfg, devices)
    except Exception as e:  # a config the tool cannot build is a finding, reported per row
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
        return row


def _measure_learner(row: dict, cfg: Config, model_cfg: ModelConfig, devices: list) -> dict:
    lcfg = cfg.learner
    if row["program"] == "loss_grad":  # one micro-batch: its loss and gradient, no optimizer
        row["batch"] = batch = row["micro_batch"] * len(devices)
        fn, params, head, mb = tpu_aot.loss_grad_inputs(
            model_cfg, lcfg, devices, batch=batch, seq_len=row["seq_len"]
        )
        row["params_bytes"] = per_chip_bytes(params)
        return _finish(row, tpu_aot.compile_program(devices[0], fn, params, head, mb))
    row["batch"] = batch = row["micro_batch"] * lcfg.num_micro_batches * len(devices)
    learner, state, rl_batch, *indices = tpu_aot.learner_inputs(
        model_cfg, lcfg, devices, batch=batch, seq_len=row["seq_len"]
    )
    row["params_bytes"] = per_chip_bytes(state.params)
    row["opt_state_bytes"] = per_chip_bytes(state.opt_state)
    step = learner._compiled_step(rl_batch)
    return _finish(row, tpu_aot.compile_program(devices[0], step, state, rl_batch, *indices))


def _measure_engine(row: dict, cfg: Config, model_cfg: ModelConfig, devices: list) -> dict:
    mesh_cfg = None
    if row.get("mesh"):  # [data, (fsdp,) tensor]: each data x fsdp shard its slots and pages
        data, *fsdp, tensor = row["mesh"]
        mesh_cfg = MeshConfig(data=data, fsdp=fsdp[0] if fsdp else 1, tensor=tensor)
        if fsdp and fsdp[0] > 1:  # slots and weights split over fsdp too (rollout.shards)
            cfg = dataclasses.replace(
                cfg, rollout=dataclasses.replace(cfg.rollout, fsdp_shards=True)
            )
    engine, params, cache, slots, prefill_in = tpu_aot.engine_inputs(
        model_cfg, cfg.rollout, devices, mesh_cfg
    )
    row["params_bytes"] = per_chip_bytes(params)
    row["kv_cache_bytes"] = per_chip_bytes(cache)
    row["pool_pages"] = cfg.rollout.pool_pages
    programs = {
        "prefill": (engine._prefill, (params, cache, slots, *prefill_in)),
        "decode": (engine._chunk, (params, cache, slots)),
    }
    fn, args = programs[row["program"]]
    return _finish(row, tpu_aot.compile_program(devices[0], fn, *args))


# ---- the peer ---------------------------------------------------------------------------------


def _measure_tunix(row: dict, model_cfg: ModelConfig, devices: list) -> dict:
    if len(devices) != 1:
        raise ValueError("the tunix peer compiles for one chip only (see benchmarks.memory_tunix)")
    fn, params, opt_state, example = memory_tunix.grpo_step(
        model_cfg,
        devices[0],
        seq_len=row["seq_len"],
        batch=row["micro_batch"],
        remat=row["remat"],
        flash=row["flash"],
    )
    row["batch"] = row["micro_batch"]
    row["params_bytes"] = per_chip_bytes(params)
    row["opt_state_bytes"] = per_chip_bytes(opt_state)
    return _finish(row, tpu_aot.compile_program(devices[0], fn, params, opt_state, example))


def tunix_available() -> bool:
    return importlib.util.find_spec("tunix") is not None


# ---- specs and sweeps --------------------------------------------------------------------------


def _shapes(
    presets: Sequence[str],
    seq_lens: Sequence[int],
    micro_batches: Sequence[int],
    remats: Sequence[bool],
    chips: Sequence[int],
    sets: Sequence[str],
) -> list[dict]:
    return [
        dict(preset=p, chips=c, seq_len=t, micro_batch=m, remat=r, sets=list(sets))
        for p in presets
        for c in chips
        for r in remats
        for m in micro_batches
        for t in seq_lens
    ]


def learner_specs(
    presets: Sequence[str],
    seq_lens: Sequence[int],
    micro_batches: Sequence[int],
    remats: Sequence[bool],
    chips: Sequence[int],
    sets: Sequence[str] = (),
    programs: Sequence[str] = ("step",),
) -> list[dict]:
    """Specs of our learner: `program` "step" (the whole step: loss, gradient, AdamW) or
    "loss_grad" (one micro-batch's loss and gradient, the gradients as outputs)."""
    for prog in programs:
        if prog not in LEARNER_PROGRAMS:
            raise ValueError(f"learner program {prog!r} is not one of {LEARNER_PROGRAMS}")
    shapes = _shapes(presets, seq_lens, micro_batches, remats, chips, sets)
    return [dict(kind="learner", program=prog, **s) for s in shapes for prog in programs]


def peer_specs(
    presets: Sequence[str],
    seq_lens: Sequence[int],
    micro_batches: Sequence[int],
    remats: Sequence[bool],
    sets: Sequence[str] = (),
    flash: Sequence[bool] = (False,),
) -> list[dict]:
    """Specs of tunix's GRPO step at the same shapes, one chip, without (`flash` False) and / or
    with its splash attention (`benchmarks.memory_tunix`)."""
    shapes = _shapes(presets, seq_lens, micro_batches, remats, [1], sets)
    return [dict(kind="tunix", program="step", flash=f, **s) for s in shapes for f in flash]


def engine_specs(
    presets: Sequence[str],
    *,
    slots: int,
    prompt_len: int,
    max_len: int,
    policies: Sequence[str],
    budget: int,
    programs: Sequence[str] = ("decode", "prefill"),
    chips: Sequence[int] = (1,),
    sets: Sequence[str] = (),
    topology: str | None = None,
    mesh: tuple[int, int] | None = None,
) -> list[dict]:
    """`topology` (e.g. "v5e:2x4"; default `TOPOLOGY[chips]`) and `mesh` (data, tensor; default
    every chip on fsdp) where given."""
    where = {k: v for k, v in (("topology", topology), ("mesh", mesh)) if v}
    return [
        dict(kind="engine", program=prog, preset=p, chips=c, slots=slots, prompt_len=prompt_len,
             max_len=max_len, policy=pol, budget=budget, sets=list(sets), **where)
        for p in presets
        for c in chips
        for pol in policies
        for prog in programs
    ]  # fmt: skip


def sweep(
    specs: Sequence[dict],
    *,
    isolate: bool = True,
    timeout_s: float | None = None,
    runner: Callable[[dict], dict] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Every spec's row, in order; each in a fresh subprocess when `isolate` (a run that
    crashes or times out is a row with the reason), logging one line per row."""
    rows = []
    for i, spec in enumerate(specs):
        if runner is not None:
            row = runner(spec)
        elif isolate:
            row = _in_subprocess(spec, timeout_s)
        else:
            row = measure(spec)
        rows.append(row)
        log(f"[{i + 1}/{len(specs)}] {describe(row)}")
    return rows


def _in_subprocess(spec: dict, timeout_s: float | None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.memory", json.dumps(spec)]
    # Compiles only: no worker owns a TPU, so one may load libtpu beside another process.
    env = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_WORKER_HOSTNAMES": "localhost", **os.environ}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {**spec, "ok": False, "error": f"timed out after {timeout_s} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = proc.stderr.strip()[-1500:]
    wall = round(time.perf_counter() - start, 1)
    return {**spec, "ok": False, "error": f"exit {proc.returncode} after {wall} s: {tail}"}


# ---- reporting ---------------------------------------------------------------------------------


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def label(row: dict) -> str:
    """Which learner program a row measured: ours ("learner", "learner loss+grad") or the
    peer's ("tunix GRPO", "tunix GRPO flash")."""
    if row["kind"] == "learner":
        return "learner" if row["program"] == "step" else "learner loss+grad"
    return "tunix GRPO flash" if row["flash"] else "tunix GRPO"


def describe(row: dict) -> str:
    """One line: the shape, then params / optimizer state (or KV pool) / temporaries / total
    per chip in GiB and whether it fits."""
    if row["kind"] in ("learner", "tunix"):
        what = (
            f"{label(row)} {row['preset']} {row['chips']}chip T={row['seq_len']} "
            f"mb={row['micro_batch']} remat={'on' if row['remat'] else 'off'}"
        )
        held = f"params {_gib(row.get('params_bytes'))} opt {_gib(row.get('opt_state_bytes'))}"
    else:
        pol = "dense" if row["policy"] == "none" else f"{row['policy']}{row['budget']}"
        what = (
            f"engine.{row['program']} {row['preset']} {row['chips']}chip slots={row['slots']} "
            f"len={row['max_len']} {pol}"
        )
        held = f"params {_gib(row.get('params_bytes'))} kv {_gib(row.get('kv_cache_bytes'))}"
    if row.get("sets"):
        what += " " + " ".join(row["sets"])
    if not row.get("ok"):
        return f"{what}: FAILED {row.get('error', '')[:300]}"
    fits = " ".join(f"{hw}={'yes' if row[f'fits_{hw}'] else 'NO'}" for hw in HBM)
    return (
        f"{what}: {held} temp {_gib(row['temp_bytes'])} total {_gib(row['total_bytes'])} GiB "
        f"per chip; fits {fits} ({row['compile_s']} s)"
    )


def longest_fitting(rows: Sequence[dict]) -> list[dict]:
    """Per learner setting (the program, ours or the peer's, as `label` names it; preset, chips,
    micro-batch, remat, sets): the longest compiled sequence length whose program fits one chip
    of each kind (None: none fits). A compile the TPU compiler refused for overflowing the chip
    counts as not fitting."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["kind"] in ("learner", "tunix") and (r.get("ok") or r.get("oom")):
            key = (
                label(r),
                r["preset"],
                r["chips"],
                r["micro_batch"],
                r["remat"],
                tuple(r["sets"]),
            )
            groups.setdefault(key, []).append(r)
    out = []
    for (step, preset, chips, mb, remat, sets), rs in groups.items():
        entry = dict(
            step=step, preset=preset, chips=chips, micro_batch=mb, remat=remat, sets=list(sets)
        )
        entry["compiled"] = sorted(r["seq_len"] for r in rs)
        for hw in HBM:
            fit = [r["seq_len"] for r in rs if r[f"fits_{hw}"]]
            entry[f"longest_{hw}"] = max(fit) if fit else None
        out.append(entry)
    return out


def markdown(rows: Sequence[dict], longest: Sequence[dict]) -> str:
    """The rows and the longest fitting lengths as two markdown tables (GiB per chip)."""

    def yn(r, hw):
        return "-" if f"fits_{hw}" not in r else ("yes" if r[f"fits_{hw}"] else "**no**")

    out = [
        "| program | preset | chips | shape | params | opt state / KV pool | temp | total "
        "| fits v5p | fits H100 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kind"] == "engine":
            pol = "dense" if r["policy"] == "none" else f"{r['policy']} {r['budget']}"
            prog, shape = f"engine {r['program']}", f"{r['slots']} slots x {r['max_len']}, {pol}"
            held = r.get("kv_cache_bytes")
        else:
            prog = label(r)
            remat = "remat" if r["remat"] else "no remat"
            shape = f"T={r['seq_len']}, mb {r['micro_batch']}, {remat}"
            held = r.get("opt_state_bytes")
        if r.get("sets"):
            shape += ", " + ", ".join(r["sets"])
        temp = _gib(r.get("temp_bytes"))
        if r.get("oom"):
            temp = f"{temp} (compiler: over HBM)" if "temp_bytes" in r else "over HBM"
        elif not r.get("ok"):
            temp = f"failed: {r.get('error', '')[:80]}"
        out.append(
            f"| {prog} | {r['preset']} | {r['chips']} | {shape} | {_gib(r.get('params_bytes'))} "
            f"| {_gib(held)} | {temp} | {_gib(r.get('total_bytes'))} | {yn(r, 'v5p')} "
            f"| {yn(r, 'h100')} |"
        )
    out += [
        "",
        "| step | preset | chips | mb | remat | lengths compiled | longest on v5p | on H100 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in longest:
        out.append(
            f"| {g['step']} | {g['preset']} | {g['chips']} "
            f"| {g['micro_batch']} | {'on' if g['remat'] else 'off'} "
            f"| {', '.join(map(str, g['compiled']))} | {g['longest_v5p'] or 'none'} "
            f"| {g['longest_h100'] or 'none'} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str]) -> None:
    """Worker: `python -m benchmarks.memory SPEC_JSON` prints the spec's row as one JSON line."""
    jax.config.update("jax_enable_compilation_cache", False)
    print(json.dumps(measure(json.loads(argv[0]))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
