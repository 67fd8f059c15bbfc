"""Benchmark harnesses behind `tools/bench_*.py`; not part of the library.

- `loco`: DDP vs DiLoCo vs PULSELoCo from one pretrained start (`tools/bench_loco.py`);
  `loco_density`: where PULSELoCo's gate fires (`tools/loco_density.py`).
- `sync`: PULSESync patch sizes and speed over real AdamW steps (`tools/bench_sync.py`).
- `rollout`: rollout speed and KV memory, dense vs sparse vs tunix (`tools/bench_rollout.py`).
- `learner`: learner-step throughput on a synthetic GRPO batch (`tools/bench_learner.py`).
- `async_runs`: synchronous vs decoupled training runs, steps/s and trainer idle time
  (`tools/bench_async.py`).
- `kv_memory`: peak KV bytes of a dense and a compressed greedy generation.
- `memory`: per-chip bytes of the learner step and the engine at real shapes, compiled ahead of
  time for TPU v5p (`tools/bench_memory.py`); `memory_tunix`: tunix's GRPO step as its peer.
- `tpu_aot`: the ahead-of-time TPU compiles they share (`tools/bench_tpu_aot.py`).
- `bigram`: the synthetic data they train on, walks of a fixed random sparse bigram chain.

Architectures come from `sparserl_jax.models.MODEL_PRESETS`; each harness maps the `--preset`
names of its tool to registry names.
"""
