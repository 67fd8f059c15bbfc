"""bf16 compute with fp32 master weights, against the fp32 reference step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.rl.learner import Learner
from sparserl_jax.testing import tiny_model
from sparserl_jax.testing.learner import config, host, make_batch, reference, with_old


@pytest.mark.slow
def test_bf16_compute_tracks_fp32_reference():
    model = tiny_model(seed=9, num_layers=1, dtype="bfloat16")
    learner = Learner(model, config(num_micro_batches=1))
    state = learner.init(model)
    batch = with_old(learner, state, make_batch(seed=8))
    fp32 = tiny_model(seed=9, num_layers=1)
    want_loss, want_norm, _ = reference(
        host(state.params), nnx.split(fp32)[0], batch, learner.config, False
    )
    state, m = learner.step(state, batch, 1)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    # bf16 has an 8-bit mantissa: agreement to a few percent is what it can give.
    np.testing.assert_allclose(m["loss"], want_loss, rtol=5e-2, atol=5e-3)
    np.testing.assert_allclose(m["grad_norm"], want_norm, rtol=5e-2)
