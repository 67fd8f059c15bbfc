"""Ahead-of-time compiles of the ops for TPU topologies (v5e, v5p, v6e) from a CPU host.

These exercise Mosaic, not interpret mode: the ops are compiled with `impl="auto"` under
`jax.default_device(<topology device>)`, or with the kernel asked for in a program that only its
shardings place on the TPU, and every compiled program must hold a `tpu_custom_call` (the Mosaic
kernel) -- or none, for shapes that dispatch sends to XLA. They need libtpu (the `tpu` extra,
`make test-tpu-aot`) and are skipped without it, or fail when `SPARSERL_REQUIRE_TPU_AOT` is set
(as `make test-tpu-aot` does, so CI cannot skip them).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks.tpu_aot import mosaic_calls
from pallas_kernels import _dispatch, compact_pages, paged_decode_attention, window_scores
from sparserl_jax.testing import tpu

pytestmark = pytest.mark.slow

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2")
B, M, P = 8, 16, 256
# (page size L, head dim H, kv heads K, group G, dtype): K * G query heads.
ATTN_SHAPES = [
    (128, 128, 8, 8, jnp.bfloat16),  # GQA 8, the shapes
    (16, 64, 2, 7, jnp.bfloat16),  # Qwen2.5-0.5B heads, small pages
    (256, 128, 4, 2, jnp.float32),
    (32, 64, 1, 1, jnp.float32),
    (64, 256, 2, 4, jnp.bfloat16),
]


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    with tpu.no_persistent_cache():
        yield


@pytest.fixture(scope="module", params=TOPOLOGIES)
def device(request):
    return tpu.topology(request.param).devices[0]


def _compiled_text(device, fn, *shapes_dtypes):
    sharding = jax.sharding.SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes_dtypes]
    with jax.default_device(device):
        assert _dispatch.target_platform() == "tpu"
        assert not _dispatch.interpret_needed("pallas_tpu")
        return jax.jit(fn).lower(*structs).compile().as_text()


@pytest.mark.parametrize("return_probs", [True, False])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=str)
def test_paged_attention_compiles_with_mosaic(device, shape, return_probs):
    pl_, h, k, g, dtype = shape
    text = _compiled_text(
        device,
        lambda *a: paged_decode_attention(*a, return_probs=return_probs),
        ((B, k * g, h), dtype),
        ((P, pl_, k, h), dtype),
        ((P, pl_, k, h), dtype),
        ((B, M), jnp.int32),
        ((B,), jnp.int32),
    )
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("window", [8, 32])
@pytest.mark.parametrize("shape", ATTN_SHAPES[:3], ids=str)
def test_window_scores_compiles_with_mosaic(device, shape, window):
    pl_, h, k, g, dtype = shape
    text = _compiled_text(
        device,
        window_scores,
        ((B, window, k * g, h), dtype),
        ((P, pl_, k, h), dtype),
        ((B, M), jnp.int32),
        ((B,), jnp.int32),
        ((B,), jnp.int32),
    )
    assert "tpu_custom_call" in text


@pytest.mark.parametrize(
    "pool",
    [
        (128, 8, (128,), jnp.bfloat16, False),
        (16, 2, (64,), jnp.bfloat16, True),  # the rollout cache's lane-dense [P, L, K * H]
        (16, 8, (128,), jnp.bfloat16, True),
        (32, 2, (), jnp.float32, False),
        (16, 2, (), jnp.int32, False),
    ],
)
def test_compaction_compiles_with_mosaic(device, pool):
    pl_, k, rest, dtype, lane_dense = pool
    shape = (P, pl_, k * math.prod(rest)) if lane_dense else (P, pl_, k, *rest)
    text = _compiled_text(
        device,
        compact_pages,
        (shape, dtype),
        ((B, M), jnp.int32),
        ((B, k, M * pl_ // 4), jnp.int32),
        ((B,), jnp.int32),
    )
    assert "tpu_custom_call" in text


def test_unsupported_shapes_compile_on_xla(device):
    """Page size 12 is not a multiple of 8: dispatch sends decode to XLA, and it compiles."""
    text = _compiled_text(
        device,
        lambda *a: paged_decode_attention(*a, return_probs=True),
        ((B, 4, 64), jnp.bfloat16),
        ((P, 12, 2, 64), jnp.bfloat16),
        ((P, 12, 2, 64), jnp.bfloat16),
        ((B, M), jnp.int32),
        ((B,), jnp.int32),
    )
    assert "tpu_custom_call" not in text


# Each op, its Mosaic kernel's name and its operands (page size 16, head dim 64, 2 KV heads).
KV, TABLE, ROWS = ((P, 16, 2, 64), jnp.bfloat16), ((B, M), jnp.int32), ((B,), jnp.int32)
FORCED = {
    "paged_attention": (
        functools.partial(paged_decode_attention, return_probs=True),
        "paged_decode_attention_tpu",
        [((B, 14, 64), jnp.bfloat16), KV, KV, TABLE, ROWS],
    ),
    "window_scores": (
        window_scores,
        "window_scores_tpu",
        [((B, 8, 14, 64), jnp.bfloat16), KV, TABLE, ROWS, ROWS],
    ),
    "compaction": (
        compact_pages,
        "compact_pages_tpu",
        [KV, TABLE, ((B, 2, M * 4), jnp.int32), ROWS],
    ),
}


@pytest.mark.parametrize("chips", [1, 4])
@pytest.mark.parametrize("op", sorted(FORCED))
def test_forced_kernel_compiles_with_mosaic_by_its_shardings(op, chips):
    """`impl="pallas_tpu"` in a program that only its `in_shardings` place on TPU devices (no
    `jax.default_device`): dispatch follows the platform lowered for, so the program holds the
    Mosaic call, once (per chip, under `shard_map`, with `mesh=` on 4 chips), and not the
    interpreter (Pallas' HLO interpreter loops over the grid; TPU interpret mode calls the host)."""
    fn, kernel, shapes_dtypes = FORCED[op]
    mesh = Mesh(np.array(tpu.topology("v5p:2x2x1").devices[:chips]), ("fsdp",))
    assert _dispatch.target_platform() == "cpu"  # the process's: dispatch must not follow it
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]
    shardings = tuple(NamedSharding(mesh, PartitionSpec()) for _ in structs)

    def call(*args):
        return fn(*args, impl="pallas_tpu", mesh=mesh if chips > 1 else None)

    # Mosaic reads the chip generation from the abstract mesh, else the default device (CPU).
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(call, in_shardings=shardings).lower(*structs)
    text = lowered.as_text()
    assert "tpu_custom_call" in text
    interpreter = ("stablehlo.while", "callback", "stablehlo.send", "stablehlo.recv")
    assert not any(word in text for word in interpreter)
    assert mosaic_calls(lowered.compile().as_text()) == {kernel: 1}


def test_compaction_over_the_smem_budget_runs_in_blocks_of_rows():
    """16 rows keeping 16,384 tokens on 2 heads: 128 KiB of SMEM tables per row, so 3 rows per
    call (`rows_per_call`): 6 Mosaic calls on the one aliased pool, no XLA fallback."""
    from pallas_kernels.compaction import kernel_tpu

    rows, max_pages, keep = 16, 64, 16384
    assert kernel_tpu.rows_per_call(max_pages, 2, keep) == 3
    shapes = [((256, 16, 128), jnp.bfloat16), ((rows, max_pages), jnp.int32)]
    shapes += [((rows, 2, keep), jnp.int32), ((rows,), jnp.int32)]
    device = tpu.topology("v5p:2x2x1").devices[0]
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    with jax.default_device(device):
        compiled = (
            jax.jit(lambda *a: compact_pages(*a, impl="pallas_tpu")).lower(*structs).compile()
        )
    assert mosaic_calls(compiled.as_text()) == {"compact_pages_tpu": 6}
