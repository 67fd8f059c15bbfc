"""Per-chip memory of the learner step and the rollout engine at real checkpoint shapes, compiled
ahead of time for TPU v5p from this CPU host (needs libtpu: `make test-tpu-aot` builds .venv-tpu).

    python tools/bench_memory.py                      # the default sweep (below), 16 compiles
    python tools/bench_memory.py --full               # every preset x length x mb x remat x mesh
    python tools/bench_memory.py --presets qwen2.5-7b --chips 8 --seq-lens 32768 --no-engine
    python tools/bench_memory.py --presets qwen3-0.6b --no-engine --peer none \\
        --learner-programs step loss_grad             # + one micro-batch's loss and gradient
    python tools/bench_memory.py --no-learner --engine-chips 8 --engine-topology v5e:2x4 \\
        --engine-mesh 2x4                             # the 7B engine on v5e-8, data 2 x tensor 4
                                                      # (1x2x4: fsdp 2 x tensor 4)
    python tools/bench_memory.py --presets qwen2.5-0.5b --seq-lens 4096 --no-engine \\
        --set learner.num_micro_batches=2 --set learner.loss.entropy_coef=0.01

Default sweep: the learner step of Qwen2.5-0.5B on one chip at T = 4096 / 16384 / 32768
(micro-batch 1, remat on), of Qwen2.5-7B on 8 chips (fsdp) at the same lengths, tunix's GRPO
step for Qwen2.5-0.5B at the same shapes without and with its splash attention (`--peer tunix`,
the default when google-tunix is installed: `make bench-venv`; `--peer-flash off|on`), and the
rollout engine's decode chunk and prefill at Qwen2.5-7B shapes on one chip (256 slots of 4096
tokens, 512 of them prompt), dense and R-KV budget 512.
`--full`: all five presets (qwen2.5-0.5b, qwen3-0.6b, qwen2.5-1.5b, qwen2.5-7b, llama3.2-1b) x
the three lengths x micro-batch 1 and 4 x remat on and off x 1, 4 and 8 chips, and the engine
at every preset (hours of compiling on a small host).

Learner: bf16 compute over fp32 master weights with AdamW state; `--micro-batches` is rows per
chip per micro-batch (the step's batch is that x learner.num_micro_batches x chips).
`--learner-programs loss_grad`: instead of (or beside: `step loss_grad`) the whole step, one
micro-batch's loss and gradient with the gradients as outputs, no optimizer (its rows have no
optimizer state; the gradients are in the total). Engine: bf16 weights and pools, on one chip
or, with `--engine-mesh`, on a mesh as `rollout.shards` lays it out (a three-part mesh with
fsdp > 1 sets `rollout.fsdp_shards`).

`--set KEY=VALUE` (repeatable) overrides any key of the config schema (sparserl_jax/config.py),
on every config of the sweep: `--set learner.num_micro_batches=2`, `--set rollout.page_size=32`,
`--set learner.logits_chunk_size=1024` once such a key exists; `model.X` for an architecture
field X goes to `model.arch.X`. An unknown key stops the tool before any compile, naming it; a
compile that fails (or overflows the chip) is a row that says why, and the sweep goes on.

Prints one line per config (params, optimizer state or KV pool, temporaries, total per chip in
GiB; fits 95 GiB v5p / 80 GiB H100), then one JSON line: {"rows": [...], "longest": [...]}
(`longest`: per learner setting, the longest compiled length that fits one chip of each kind);
`--markdown` prints both as the tables of docs/benchmarks.md before the JSON line.
Each config compiles in a fresh subprocess (`--in-process` to not). Logic: benchmarks/memory.py.
"""

from __future__ import annotations

import argparse
import json

from benchmarks import memory
from sparserl_jax.config import ConfigError
from sparserl_jax.models import MODEL_PRESETS

DEFAULT_LEARNER = (("qwen2.5-0.5b", 1), ("qwen2.5-7b", 8))


def _bools(values: list[str]) -> list[bool]:
    return [v == "on" for v in values]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--full", action="store_true", help="the whole grid (see above)")
    p.add_argument("--presets", nargs="+", choices=memory.PRESETS, help="registry names")
    p.add_argument("--seq-lens", nargs="+", type=int, default=list(memory.SEQ_LENS))
    p.add_argument("--micro-batches", nargs="+", type=int, help="rows per chip (default 1)")
    p.add_argument("--remat", nargs="+", choices=["on", "off"], help="default on")
    p.add_argument("--chips", nargs="+", type=int, choices=sorted(memory.TOPOLOGY))
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--peer",
        choices=["tunix", "none"],
        default="tunix" if memory.tunix_available() else "none",
        help="tunix's GRPO step at the same shapes, one chip, qwen2 presets (default: tunix "
        "when installed)",
    )
    p.add_argument(
        "--peer-flash",
        nargs="+",
        choices=["off", "on"],
        default=["off", "on"],
        help="tunix's step without / with its splash attention (use_flash_attention)",
    )
    p.add_argument(
        "--learner-programs",
        nargs="+",
        choices=memory.LEARNER_PROGRAMS,
        default=["step"],
        help="step: the whole step (AdamW); loss_grad: one micro-batch's loss and gradient",
    )
    p.add_argument("--no-learner", action="store_true")
    p.add_argument("--peer-only", action="store_true", help="of the learners, only the peer's")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--engine-presets", nargs="+", choices=memory.ENGINE_PRESETS)
    p.add_argument("--engine-programs", nargs="+", default=["decode", "prefill"])
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=4096, help="prompt + new tokens per slot")
    p.add_argument("--policies", nargs="+", default=["none", "rkv"], help="none = dense")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--engine-chips", type=int, default=1, help="chips of the engine's mesh")
    p.add_argument("--engine-topology", help="e.g. v5e:2x4 (default: v5p's for the chips)")
    p.add_argument(
        "--engine-mesh",
        help="DATAxTENSOR (2x4) or DATAxFSDPxTENSOR (1x2x4): each data x fsdp shard its own "
        "slots and pages (fsdp > 1 sets rollout.fsdp_shards: weights split, never gathered)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per config")
    p.add_argument("--in-process", action="store_true", help="no subprocess per config")
    p.add_argument("--markdown", action="store_true", help="also print docs/benchmarks.md tables")
    a = p.parse_args()
    for s in a.sets:
        if "=" not in s:
            p.error(f"--set {s!r} is not of the form KEY=VALUE")

    specs = []
    if not a.no_learner:
        grid = dict(
            seq_lens=a.seq_lens,
            micro_batches=a.micro_batches or ([1, 4] if a.full else [1]),
            remats=_bools(a.remat or (["on", "off"] if a.full else ["on"])),
            sets=a.sets,
        )
        programs = a.learner_programs
        if a.full or a.presets or a.chips:
            presets = a.presets or list(memory.PRESETS)
            chips = a.chips or ([1, 4, 8] if a.full else [1])
            specs += memory.learner_specs(presets, chips=chips, programs=programs, **grid)
        else:
            presets = [DEFAULT_LEARNER[0][0]]
            for preset, chips in DEFAULT_LEARNER:
                specs += memory.learner_specs([preset], chips=[chips], programs=programs, **grid)
        if a.peer_only:
            specs = []
        if a.peer == "tunix":
            qwen2 = [p_ for p_ in presets if MODEL_PRESETS[p_].family == "qwen2"]
            specs += memory.peer_specs(qwen2, flash=_bools(a.peer_flash), **grid)
    if not a.no_engine:
        specs += memory.engine_specs(
            a.engine_presets or (list(memory.PRESETS) if a.full else ["qwen2.5-7b"]),
            slots=a.slots,
            prompt_len=a.prompt_len,
            max_len=a.max_len,
            policies=a.policies,
            budget=a.budget,
            programs=a.engine_programs,
            sets=a.sets,
            chips=[a.engine_chips],
            topology=a.engine_topology,
            mesh=tuple(map(int, a.engine_mesh.split("x"))) if a.engine_mesh else None,
        )
    try:
        memory.check(specs)
    except ConfigError as e:
        p.error(str(e))
    print(f"{len(specs)} configs", flush=True)
    rows = memory.sweep(
        specs,
        isolate=not a.in_process,
        timeout_s=a.timeout,
        log=lambda s: print(s, flush=True),
    )
    longest = memory.longest_fitting(rows)
    if a.markdown:
        print(memory.markdown(rows, longest), flush=True)
    print(json.dumps({"rows": rows, "longest": longest}))


if __name__ == "__main__":
    main()
