"""Whole programs compile for a TPU from a CPU host: the rollout engine's decode chunk with R-KV
and the learner step, at a small model whose heads tile the TPU's lanes (2 KV heads of dim 64,
as in Qwen2.5-0.5B), so the decode chunk holds the Mosaic kernels. Abstract inputs only
(`benchmarks.tpu_aot`); the Qwen2.5-0.5B figures are `tools/bench_tpu_aot.py`'s (too slow here).
Skipped without libtpu, failing instead when `SPARSERL_REQUIRE_TPU_AOT` is set (`make
test-tpu-aot`), like tests/kernels/test_tpu_aot.py.
"""

from __future__ import annotations

import pytest

from benchmarks import tpu_aot
from sparserl_jax.models import model_preset
from sparserl_jax.rl.config import LearnerConfig
from sparserl_jax.testing import tpu

pytestmark = pytest.mark.slow

SMALL = model_preset("tpu-lanes-small", dtype="bfloat16", param_dtype="bfloat16", remat=True)


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    with tpu.no_persistent_cache():
        yield


@pytest.fixture(scope="module")
def v5p():
    return list(tpu.topology("v5p:2x2x1").devices)


def _check(result: dict, *, mosaic: bool | None = None):
    assert result["ok"], result.get("error")
    assert result["flops"] > 0 and result["temp_bytes"] >= 0
    if mosaic is not None:
        assert result["mosaic"] is mosaic


@pytest.mark.parametrize("name", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_rkv_engine_compiles_on_one_chip(name):
    rc = tpu_aot.engine_config("rkv", slots=8, prompt=32, new=96, page=16, budget=32)
    got = tpu_aot.engine_programs(SMALL, rc, list(tpu.topology(name).devices)[:1])
    _check(got["prefill"])
    _check(got["decode_chunk"], mosaic=True)  # paged attention, window scores, compaction


def test_rkv_engine_compiles_on_a_4_chip_v5p_mesh(v5p):
    # Mosaic calls cannot be partitioned by XLA: the kernels run per chip under shard_map (2 KV
    # heads do not divide over 4 chips, so replicated; tests/kernels/test_cache_on_kernels.py
    # checks the numerics of both layouts in interpret mode).
    rc = tpu_aot.engine_config("rkv", slots=8, prompt=32, new=96, page=16, budget=32)
    got = tpu_aot.engine_programs(SMALL, rc, v5p[:4])
    _check(got["prefill"])
    _check(got["decode_chunk"], mosaic=True)


@pytest.mark.parametrize("chips", [1, 4])
def test_learner_step_compiles_for_v5p(v5p, chips):
    lcfg = LearnerConfig(num_micro_batches=2)
    got = tpu_aot.learner_program(SMALL, lcfg, v5p[:chips], batch=8, seq_len=64)
    _check(got, mosaic=False)  # teacher forcing: dense XLA attention, no kernel
