"""`tools/bench_memory.py`'s harness (`benchmarks.memory`): overrides reach the config schema
unchanged (architecture keys routed to `model.arch`), per-chip bytes follow the shardings, an
HBM overflow reported by the TPU compiler is a row that fits nothing, the longest fitting length
is read off the rows; and real ahead-of-time compiles for a v5p chip of a tiny preset's learner
step and its loss and gradient, in worker processes, and of tunix's GRPO step with its splash
attention (skipped without libtpu, failing instead when `SPARSERL_REQUIRE_TPU_AOT` is set, as in
tests/test_tpu_programs.py; the tunix one skipped without google-tunix: `make bench-venv`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks import memory, memory_tunix, tpu_aot
from sparserl_jax.config import ConfigError
from sparserl_jax.models import model_preset
from sparserl_jax.testing import tpu

LEARNER = dict(
    kind="learner", program="step", preset="test-tiny", chips=1, seq_len=64, micro_batch=1,
    remat=True,
)  # fmt: skip


def test_overrides_route_architecture_keys_and_reach_every_section():
    assert memory.route_override("model.num_layers=3") == "model.arch.num_layers=3"
    assert memory.route_override("model.remat=false") == "model.remat=false"  # a ModelSpec key
    assert memory.route_override("learner.num_micro_batches=2") == "learner.num_micro_batches=2"
    sets = ["model.num_layers=3", "learner.num_micro_batches=2", "learner.loss.kl_coef=0.1"]
    cfg = memory.config_for({**LEARNER, "sets": sets})
    model = cfg.model.model_config()
    assert (model.num_layers, model.dtype, model.param_dtype, model.remat) == (
        3,
        "bfloat16",
        "float32",
        True,
    )
    assert cfg.learner.num_micro_batches == 2 and cfg.learner.loss.kl_coef == 0.1
    engine = dict(kind="engine", program="decode", preset="test-tiny", chips=1, slots=4,
                  prompt_len=16, max_len=64, policy="rkv", budget=32, sets=[])  # fmt: skip
    rc = memory.config_for(engine).rollout
    assert (rc.num_slots, rc.max_prompt_len, rc.max_len, rc.kv.budget) == (4, 16, 64, 32)
    assert memory.config_for({**engine, "policy": "none"}).rollout.kv is None


def test_an_unknown_override_names_the_key_before_any_compile():
    with pytest.raises(ConfigError, match="unknown key 'learner.no_such_key'"):
        memory.check([{**LEARNER, "sets": ["learner.no_such_key=1024"]}])
    with pytest.raises(ConfigError, match="unknown key 'model.no_such_field'"):
        memory.check([{**LEARNER, "sets": ["model.no_such_field=chunked"]}])
    # `measure` never raises: the same mistake is a failed row naming it.
    row = memory.measure({**LEARNER, "sets": ["learner.no_such_key=1024"]})
    assert not row["ok"] and "learner.no_such_key" in row["error"]


def test_per_chip_bytes_follow_the_shardings():
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(4), ("fsdp",))
    split = NamedSharding(mesh, PartitionSpec("fsdp", None))
    rep = NamedSharding(mesh, PartitionSpec())
    tree = {
        "w": jax.ShapeDtypeStruct((64, 10), jnp.float32, sharding=split),  # 16 x 10 per chip
        "b": jax.ShapeDtypeStruct((10,), jnp.bfloat16, sharding=rep),  # whole on every chip
        "x": jax.ShapeDtypeStruct((3, 5), jnp.int32),  # no sharding: whole
    }
    assert memory.per_chip_bytes(tree) == 16 * 10 * 4 + 10 * 2 + 15 * 4


def test_an_hbm_overflow_is_a_row_that_fits_nothing():
    error = (
        "JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
        "required for HLO temporaries (118.73G) exceeds available HBM"
    )
    row = memory._finish({}, {"ok": False, "compile_s": 1.0, "error": error})
    assert row["oom"] and not row["fits_v5p"] and not row["fits_h100"]
    assert row["temp_bytes"] == int(118.73 * 2**30)
    ok = {"ok": True, "compile_s": 1.0, "argument_bytes": 10, "output_bytes": 8}
    row = memory._finish({}, {**ok, "alias_bytes": 6, "temp_bytes": 85 * 2**30})
    assert row["total_bytes"] == 12 + 85 * 2**30 and row["fits_v5p"] and not row["fits_h100"]
    row = memory._finish({}, {**ok, "alias_bytes": 6, "temp_bytes": 80 * 2**30 - 12})
    assert row["fits_v5p"] and row["fits_h100"]  # exactly 80 GiB


def test_longest_fitting_length_per_setting():
    def row(kind, t, v5p, h100, remat=True, **extra):
        return dict(LEARNER, kind=kind, seq_len=t, remat=remat, sets=[], ok=True,
                    fits_v5p=v5p, fits_h100=h100, **extra)  # fmt: skip

    rows = [
        row("learner", 4096, True, True),
        row("learner", 16384, True, False),
        {**row("learner", 32768, False, False), "ok": False, "oom": True},
        row("learner", 32768, True, True, program="loss_grad"),
        row("tunix", 4096, False, False, flash=False),
        row("tunix", 4096, True, True, flash=True),
        row("learner", 4096, True, True, remat=False),
        {**row("learner", 8192, True, True), "ok": False},  # failed rows are not evidence
    ]
    got = {(g["step"], g["remat"]): g for g in memory.longest_fitting(rows)}
    assert got["learner", True]["compiled"] == [4096, 16384, 32768]
    assert (got["learner", True]["longest_v5p"], got["learner", True]["longest_h100"]) == (
        16384,
        4096,
    )
    assert got["learner loss+grad", True]["longest_h100"] == 32768
    assert got["tunix GRPO", True]["longest_v5p"] is None
    assert got["tunix GRPO flash", True]["longest_v5p"] == 4096
    assert got["learner", False]["longest_v5p"] == 4096
    table = memory.markdown(rows, memory.longest_fitting(rows))
    assert "| learner | test-tiny | 1 | T=32768, mb 1, remat | - | - | over HBM |" in table
    assert "| learner | test-tiny | 1 | 1 | on | 4096, 16384, 32768 | 16384 | 4096 |" in table
    assert "| tunix GRPO | test-tiny | 1 | 1 | on | 4096 | none | none |" in table
    assert "| tunix GRPO flash | test-tiny | 1 | 1 | on | 4096 | 4096 | 4096 |" in table


def test_specs_pair_each_shape_with_every_program():
    grid = dict(seq_lens=[64, 128], micro_batches=[1], remats=[True])
    specs = memory.learner_specs(["test-tiny"], chips=[1], programs=["step", "loss_grad"], **grid)
    assert [(s["seq_len"], s["program"]) for s in specs] == [
        (64, "step"),
        (64, "loss_grad"),
        (128, "step"),
        (128, "loss_grad"),
    ]
    peer = memory.peer_specs(["test-tiny"], flash=[False, True], **grid)
    assert [(s["kind"], s["chips"], s["seq_len"], s["flash"]) for s in peer] == [
        ("tunix", 1, 64, False),
        ("tunix", 1, 64, True),
        ("tunix", 1, 128, False),
        ("tunix", 1, 128, True),
    ]
    assert [memory.label(s) for s in specs[:2] + peer[:2]] == [
        "learner",
        "learner loss+grad",
        "tunix GRPO",
        "tunix GRPO flash",
    ]
    with pytest.raises(ValueError, match="'adamw' is not one of"):
        memory.learner_specs(["test-tiny"], chips=[1], programs=["adamw"], **grid)


@pytest.mark.slow
def test_tiny_learner_step_compiles_for_one_v5p_chip_in_a_worker():
    tpu.topology("v5p:2x2x1")  # skips without libtpu
    spec = {**LEARNER, "preset": "tpu-lanes-small", "sets": ["learner.num_micro_batches=2"]}
    logged = []
    [row, grad] = memory.sweep([spec, {**spec, "program": "loss_grad"}], log=logged.append)
    assert row["ok"], row.get("error")
    n = model_preset("tpu-lanes-small").num_params()
    assert row["batch"] == 2  # micro-batch 1 x 2 micro-batches x 1 chip
    assert row["params_bytes"] == 4 * n  # fp32 masters, whole on one chip
    assert 8 * n <= row["opt_state_bytes"] < 8 * n + 64  # AdamW mu and nu (+ its counters)
    assert row["temp_bytes"] > 0
    assert row["total_bytes"] == tpu_aot.total_bytes(row) >= row["params_bytes"]
    assert row["fits_v5p"] and row["fits_h100"]
    assert logged and "fits v5p=yes" in logged[0]
    # One micro-batch's loss and gradient: the same parameters, no optimizer state, the fp32
    # gradients among the outputs.
    assert grad["ok"], grad.get("error")
    assert grad["batch"] == 1 and grad["params_bytes"] == 4 * n
    assert "opt_state_bytes" not in grad and grad["output_bytes"] >= 4 * n


@pytest.mark.slow
def test_tunix_flash_step_compiles_with_its_splash_kernel():
    pytest.importorskip("tunix")
    device = tpu.topology("v5p:2x2x1").devices[0]
    spec = memory.peer_specs(["tpu-lanes-small"], [2048], [1], [True], flash=[True])[0]
    model_cfg = memory.config_for(spec).model.model_config()
    fn, *args = memory_tunix.grpo_step(
        model_cfg, device, seq_len=2048, batch=1, remat=True, flash=True
    )
    # As the tool compiles it: tunix's code broadcasts by rank promotion, and Mosaic rejects the
    # fp32 contract precision that this suite's "highest" matmul precision asks of bf16.
    with jax.numpy_rank_promotion("allow"), jax.default_matmul_precision("default"):
        got = tpu_aot.compile_program(device, fn, *args)
    assert got["ok"], got.get("error")
    calls = got["mosaic_calls"]
    assert any(name.startswith("splash_mha_fwd") for name in calls), calls
    assert any(name.startswith("splash_mha_dkv") for name in calls), calls
