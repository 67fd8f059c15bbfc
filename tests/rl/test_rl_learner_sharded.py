"""The learner step on 8 fake devices (data 2 x fsdp 2 x tensor 2) against one device."""

import dataclasses

import jax
import numpy as np
import pytest

from sparserl_jax.parallel import MeshConfig, make_mesh
from sparserl_jax.rl.learner import Learner
from sparserl_jax.testing import tiny_model
from sparserl_jax.testing.learner import config, host, make_batch, with_old


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_sharded_matches_single_device(tied):
    cfg = config(num_micro_batches=2)
    # No q/k/v bias: the key bias has an exactly-zero true gradient (softmax is shift invariant),
    # and Adam would blow its rounding noise up to lr-sized, layout-dependent updates.
    model = tiny_model(seed=3, num_layers=1, qkv_bias=False, tie_embeddings=tied)
    one = Learner(model, dataclasses.replace(cfg, num_micro_batches=1))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    eight = Learner(model, cfg, mesh=mesh)
    s1, s8 = one.init(model), eight.init(model)
    assert len(s8.params["layers"][0]["attn"]["q_proj"].sharding.device_set) == 8
    batch = with_old(one, s1, make_batch(seed=1))
    np.testing.assert_allclose(
        eight.logprobs(s8.params, batch.tokens_bt), batch.old_logp_bt, rtol=1e-5, atol=1e-6
    )
    for k in (1, 2):
        s1, m1 = one.step(s1, batch, k)
        s8, m8 = eight.step(s8, batch, k)
        for key in ("loss", "grad_norm", "dgg/g", "entropy", "correction/ess"):
            np.testing.assert_allclose(m8[key], m1[key], rtol=1e-5, atol=1e-7, err_msg=key)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
        host(s8.params),
        host(s1.params),
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
        host(s8.opt_state),
        host(s1.opt_state),
    )
    q = s8.params["layers"][0]["attn"]["q_proj"]
    assert q.sharding.spec == eight.param_shardings["layers"][0]["attn"]["q_proj"].spec


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_step_keeps_activations_row_sharded(tied):
    """On an fsdp mesh every chip computes only its own rows: the compiled step holds no
    full-batch MLP activation or logits chunk. Without the model's activation constraints XLA
    laid activations out like the fsdp-sharded weights (hidden dimension split, rows replicated),
    so each chip computed all B rows (the 7B step on 8 chips held `[8, T, 18944]`)."""
    f, v = 80, 67
    model = tiny_model(seed=0, num_layers=1, intermediate_size=f, tie_embeddings=tied)
    learner = Learner(model, config(num_micro_batches=1), mesh=make_mesh(MeshConfig(fsdp=8)))
    state = learner.init(model)
    batch = with_old(learner, state, make_batch(seed=0))
    b, t = batch.tokens_bt.shape
    hlo = (
        learner._compiled_step(batch)
        .lower(state, batch, np.int32(1), np.float32(np.inf))
        .compile()
        .as_text()
    )
    full = [f"[{b},{t},{f}]", f"[{b},{t - 1},{v}]", f"[{b},{t},{v}]"]
    assert [s for s in full if s in hlo] == []
    assert f"[1,{t},{f}]" in hlo  # each chip's own row of the MLP activations


def test_mini_batches_stay_on_the_shards_that_hold_their_rows():
    """`num_mini_batches`' strided rows (j, j + n, ...) of a batch whose rows are split in
    contiguous blocks over data x fsdp: each shard already holds its share of every
    mini-batch, so taking them compiles to no communication and keeps the batch layout."""
    from sparserl_jax.rl.objective import _strided_rows, mini_batches

    model = tiny_model(seed=0, num_layers=1)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    learner = Learner(model, config(num_micro_batches=1, num_mini_batches=2), mesh=mesh)
    batch = learner._prepare(with_old(learner, learner.init(model), make_batch(seed=0)))
    layout = learner._layout(batch)
    minis = mini_batches(batch, 2, layout)
    for j, mini in enumerate(minis):
        for got, whole, want in zip(mini, batch, layout, strict=True):
            if whole is not None:
                assert got.sharding.is_equivalent_to(want, got.ndim)
                np.testing.assert_array_equal(np.asarray(got), np.asarray(whole)[j::2])
    hlo = _strided_rows.lower(batch, 2, layout).compile().as_text()
    for collective in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
        assert collective not in hlo, collective
