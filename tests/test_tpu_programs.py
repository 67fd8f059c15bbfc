"""Whole programs compile for a TPU from a CPU host: the rollout engine's decode chunk with R-KV
and the learner step, at a small model whose heads tile the TPU's lanes (2 KV heads of dim 64,
as in Qwen2.5-0.5B), so the decode chunk holds the Mosaic kernels. Abstract inputs only
(`benchmarks.tpu_aot`); the Qwen2.5-0.5B figures are `tools/bench_tpu_aot.py`'s (too slow here).
Skipped without libtpu, failing instead when `SPARSERL_REQUIRE_TPU_AOT` is set (`make
test-tpu-aot`), like tests/kernels/test_tpu_aot.py.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import pytest

from benchmarks import tpu_aot
from sparserl_jax.models import ModelConfig
from sparserl_jax.rl.config import LearnerConfig

pytestmark = pytest.mark.slow

SMALL = ModelConfig(
    family="qwen2", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=64, intermediate_size=256, qkv_bias=True, tie_embeddings=True,
    dtype="bfloat16", param_dtype="bfloat16", remat=True,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    # Executables compiled for a topology (no client) cannot be read back from the cache.
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


def _unavailable(reason: str):
    if os.environ.get("SPARSERL_REQUIRE_TPU_AOT"):
        pytest.fail(f"SPARSERL_REQUIRE_TPU_AOT is set but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def v5p():
    if importlib.util.find_spec("libtpu") is None:
        _unavailable("libtpu is not installed (pip install -e '.[tpu]', or `make test-tpu-aot`)")
    try:
        return tpu_aot.topology_devices("v5p:2x2x1")
    except Exception as e:  # no TPU plugin / unknown topology in this jax
        _unavailable(f"TPU topology v5p:2x2x1 is unavailable: {e}")


def _check(result: dict, *, mosaic: bool | None = None):
    assert result["ok"], result.get("error")
    assert result["flops"] > 0 and result["temp_bytes"] >= 0
    if mosaic is not None:
        assert result["mosaic"] is mosaic


def test_rkv_engine_compiles_on_one_v5p_chip(v5p):
    rc = tpu_aot.engine_config("rkv", slots=8, prompt=32, new=96, page=16, budget=32)
    got = tpu_aot.engine_programs(SMALL, rc, v5p[:1])
    _check(got["prefill"])
    _check(got["decode_chunk"], mosaic=True)  # paged attention, window scores, compaction


@pytest.mark.parametrize("chips", [1, 4])
def test_learner_step_compiles_for_v5p(v5p, chips):
    lcfg = LearnerConfig(num_micro_batches=2)
    got = tpu_aot.learner_program(SMALL, lcfg, v5p[:chips], batch=8, seq_len=64)
    _check(got, mosaic=False)  # teacher forcing: dense XLA attention, no kernel
