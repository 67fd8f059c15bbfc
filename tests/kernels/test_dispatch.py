"""Which implementation each op runs, per target platform and shape class: a kernel is chosen only
where it compiles (else XLA, logged once) on TPU and GPU, XLA on CPU, and interpret mode follows the
platform the program is lowered for (tests/kernels/test_tpu_aot.py lowers for a TPU)."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _dispatch, paged_decode_attention, window_scores
from pallas_kernels.compaction import kernel_tpu as compaction_tpu
from pallas_kernels.paged_attention.api import decode_impl
from pallas_kernels.paged_attention.kernel_tpu import unsupported_reason
from pallas_kernels.window_scores.reference import window_scores_reference
from sparserl_jax.testing.kernels import LENGTHS, PAGE_TABLE, H, N, pools, queries

# [P, L, K, H] pools by shape class, with N query heads: (kv_shape, num_heads).
TPU_OK = {
    "page128_h128_gqa8": ((64, 128, 8, 128), 64),
    "page16_h64_k2_g7": ((64, 16, 2, 64), 14),  # Qwen2.5-0.5B heads
    "page256_h128_mha": ((64, 256, 4, 128), 4),
    "page32_h64_k1": ((64, 32, 1, 64), 4),
    "page16_h256": ((64, 16, 2, 256), 8),
}
TPU_BAD = {
    "page12": ((64, 12, 2, 64), 4),  # page size not a multiple of 8
    "h96": ((64, 16, 2, 96), 4),  # head dim neither divides nor is a multiple of 128
    "h64_k3": ((64, 16, 3, 64), 3),  # 3 heads of 64 lanes do not fill 128-lane blocks
}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(_dispatch.KERNEL_IMPL_ENV, raising=False)


def on(platform):
    """`decode_impl` with its choice made for `platform`."""
    return functools.partial(decode_impl, platform=platform)


@pytest.mark.parametrize("name", sorted(TPU_OK))
def test_tpu_picks_the_kernel_where_it_compiles(name):
    decide = on("tpu")
    kv_shape, n = TPU_OK[name]
    assert decide(kv_shape, n, 8, 16) == "pallas_tpu"
    assert decide(kv_shape, n, 8, 16, impl="xla") == "xla"


@pytest.mark.parametrize("name", sorted(TPU_BAD))
def test_tpu_falls_back_to_xla_with_one_log_line(name, caplog):
    decide = on("tpu")
    kv_shape, n = TPU_BAD[name]
    _dispatch._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="pallas_kernels"):
        for impl in ("auto", "pallas_tpu", "auto"):
            assert decide(kv_shape, n, 8, 16, impl=impl) == "xla"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "using XLA" in lines[0], lines
    # Decided for a TPU from this CPU host: an info line, not a warning (nothing runs there).
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_tpu_smem_budget():
    decide = on("tpu")
    assert decide((64, 128, 8, 128), 64, 256, 64) == "pallas_tpu"  # 66 KiB of tables
    assert "SMEM" in unsupported_reason((64, 128, 8, 128), 512, 512)  # 1 MiB: fails to compile
    assert decide((64, 128, 8, 128), 64, 512, 512) == "xla"
    assert compaction_tpu.unsupported_reason(16, 8, 512) is None
    # Tables over the budget are compacted in blocks of rows: only one row too large is refused.
    assert compaction_tpu.rows_per_call(64, 8, 4096) == 3  # 64 rows: 22 calls
    assert compaction_tpu.unsupported_reason(64, 8, 4096) is None
    assert "SMEM" in compaction_tpu.unsupported_reason(64, 64, 4096)


@pytest.mark.parametrize("name", sorted(TPU_OK) + sorted(TPU_BAD))
def test_cpu_uses_xla_and_interprets_kernels_at_any_shape(name):
    decide = on("cpu")
    kv_shape, n = {**TPU_OK, **TPU_BAD}[name]
    assert decide(kv_shape, n, 8, 16) == "xla"
    # Asked for explicitly, a kernel runs in interpret mode, where any shape works.
    assert decide(kv_shape, n, 8, 16, impl="pallas_tpu") == "pallas_tpu"
    assert decide(kv_shape, n, 8, 16, impl="pallas_gpu") == "pallas_gpu"
    assert _dispatch.interpret_needed("pallas_tpu", platform="cpu")
    assert _dispatch.interpret_needed("pallas_gpu", platform="cpu")


@pytest.mark.parametrize("name", sorted(TPU_OK))
def test_gpu_defaults_to_triton_where_it_compiles(name, monkeypatch):
    decide = on("gpu")
    kv_shape, n = TPU_OK[name]
    # Triton takes any GQA group (padded to 16 query rows) but only power-of-two page sizes and
    # head dims of at least 16 (Triton dot tiles); other shapes fall back to XLA.
    page_size, head_dim = kv_shape[1], kv_shape[3]
    runs = all(_dispatch.is_pow2(x) and x >= 16 for x in (page_size, head_dim))
    for impl in ("auto", "pallas_gpu"):
        assert decide(kv_shape, n, 8, 16, impl=impl) == ("pallas_gpu" if runs else "xla")
    assert decide(kv_shape, n, 8, 16, impl="xla") == "xla"
    monkeypatch.setenv(_dispatch.KERNEL_IMPL_ENV, "xla")  # the way back to XLA on a GPU
    assert decide(kv_shape, n, 8, 16) == "xla"
    assert not _dispatch.interpret_needed("pallas_gpu", platform="gpu")


def test_env_override(monkeypatch):
    decide = on("tpu")
    monkeypatch.setenv(_dispatch.KERNEL_IMPL_ENV, "xla")
    assert decide((64, 128, 8, 128), 64, 8, 16) == "xla"
    monkeypatch.setenv(_dispatch.KERNEL_IMPL_ENV, "pallas_tpu")
    assert decide((64, 12, 2, 64), 4, 8, 16) == "xla"  # still shape-checked


def test_target_platform_follows_the_default_device():
    assert _dispatch.target_platform() == "cpu"
    with jax.default_device(jax.devices("cpu")[0]):
        assert _dispatch.target_platform() == "cpu"
    with jax.default_device("cpu"):
        assert _dispatch.target_platform() == "cpu"


def test_window_scores_falls_back_on_tpu(caplog):
    """Shapes Mosaic and Triton reject (page size 12) run the XLA reference on a TPU or GPU
    target, as on any other: one log line per platform (info here: the TPU and GPU branches of a
    program this CPU host runs)."""
    _dispatch._LOGGED.clear()
    k = jax.random.normal(jax.random.key(0), (4, 12, 2, 64))
    pt = jnp.array([[0, 1], [2, 3]], jnp.int32)
    lens, nq = jnp.array([20, 5], jnp.int32), jnp.array([3, 3], jnp.int32)
    q = jax.random.normal(jax.random.key(1), (2, 3, 4, 64))
    with caplog.at_level(logging.INFO, logger="pallas_kernels"):
        got = window_scores(q, k, pt, lens, nq)
    np.testing.assert_array_equal(got, window_scores_reference(q, k, pt, lens, nq))
    lines = [r.getMessage() for r in caplog.records]
    assert sorted(line.split(" cannot")[0] for line in lines) == [
        "window_scores: pallas_gpu",
        "window_scores: pallas_tpu",
    ], lines


def test_forced_tpu_kernel_in_a_cpu_program_interprets():
    """A program with the Mosaic kernel asked for, lowered for the CPU: the kernel runs in
    interpret mode and matches XLA. Both choices are traced (a platform-dependent branch); the
    CPU lowering holds the interpreter (a loop over the kernel's grid) and no Mosaic call."""
    k, v = pools(jnp.float32)
    q = queries((3, N, H), jnp.float32)
    args = (q, k, v, PAGE_TABLE, LENGTHS)

    def attend(impl, mesh=None):
        return jax.jit(
            lambda *a: paged_decode_attention(*a, return_probs=True, impl=impl, mesh=mesh)
        )

    forced = attend("pallas_tpu")
    assert "platform_index" in str(forced.trace(*args).jaxpr)
    text = forced.lower(*args).as_text()
    assert "tpu_custom_call" not in text and "stablehlo.while" in text
    for got, want in zip(forced(*args), attend("xla")(*args), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-6)
    # "auto" lowered for the CPU is the XLA path alone.
    text = attend("auto").lower(*args).as_text()
    assert "tpu_custom_call" not in text and "stablehlo.while" not in text
    # With a mesh the target is its devices' platform: one choice, no branch.
    mesh = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    assert "platform_index" not in str(attend("pallas_tpu", mesh).trace(*args).jaxpr)
