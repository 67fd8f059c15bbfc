"""Compile the kernels, the rollout engine and the learner step for TPUs from a CPU host.

    python tools/bench_tpu_aot.py                      # Qwen2.5-0.5B, v5e / v5p / v6e + v5p mesh
    python tools/bench_tpu_aot.py --topologies v5p:2x2x1 --programs engine --policies rkv
    python tools/bench_tpu_aot.py --topologies v5p:2x2x1 --mesh-topology '' \
        --programs hidden --batch 1 --seq-len 16384 --attention dense   # attention temps alone
    python tools/bench_tpu_aot.py --topologies v5p:2x2x1 --mesh-topology '' \
        --programs loss_grad --batch 1 --seq-len 4096 --micro-batches 1  # loss + gradient alone

Needs libtpu (`make test-tpu-aot` builds .venv-tpu). Prints one line per target, then the
results as one JSON line. Logic: `benchmarks/tpu_aot.py`.
"""

from __future__ import annotations

import argparse
import json

from benchmarks import tpu_aot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--topologies", nargs="*", default=list(tpu_aot.TOPOLOGIES))
    p.add_argument("--mesh-topology", default="v5p:2x2x1", help="'' for none")
    p.add_argument(
        "--programs",
        nargs="+",
        default=["kernels", "engine", "learner"],
        help="... or hidden, loss_grad",
    )
    p.add_argument("--policies", nargs="+", default=list(tpu_aot.POLICIES))
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--attention", default="auto", help="ModelConfig.attention of the model")
    p.add_argument("--no-remat", action="store_true")
    a = p.parse_args()
    import jax

    # Executables compiled for a topology (no client) cannot be read back from the cache.
    jax.config.update("jax_enable_compilation_cache", False)
    results = tpu_aot.run_all(
        a.topologies,
        policies=a.policies,
        programs=a.programs,
        mesh_topology=a.mesh_topology or None,
        slots=a.slots,
        prompt=a.prompt_len,
        new=a.new_tokens,
        page=a.page_size,
        budget=a.budget,
        batch=a.batch,
        seq_len=a.seq_len,
        micro_batches=a.micro_batches,
        model_cfg=tpu_aot.qwen_05b(remat=not a.no_remat).replace(attention=a.attention),
        log=lambda s: print(s, flush=True),
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
