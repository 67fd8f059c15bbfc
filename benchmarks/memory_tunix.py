"""The peer of `benchmarks.memory`: tunix's GRPO training step, abstract, for one TPU chip.

tunix (google-tunix, the `bench` extra: `make bench-venv`) is imported inside `grpo_step` so the
harness imports without it. What is compiled is the work of its trainer's step: `value_and_grad`
of its registered GRPO policy loss (`tunix.rl.algo_core.grpo_loss_fn`: the logits of the whole
sequence from its Qwen2, then `selective_log_softmax` on the completion) and an AdamW update,
parameters and optimizer state donated. bf16 compute over fp32 parameters, decoder remat (or
none), no reference model (beta 0, as our learner with kl_coef 0).

Attention: its XLA einsum (`[B, K, G, T, S]` scores; its default) or, `flash=True`, its splash
kernel (`ModelConfig.use_flash_attention`, tunix's best setting, block 1024 by its default),
which it runs under `shard_map` over the mesh of the legacy `with mesh:` context, axes `fsdp`
and `tp`: the step is traced under a one-chip mesh of those axes either way. One chip only: its
Qwen2 skips its activation sharding constraints whenever the host's default backend is the CPU,
so a mesh compiled from this host would not be the layout it runs with.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks import rollout as rollout_bench
from benchmarks import tpu_aot
from sparserl_jax.models import ModelConfig

PROMPT = 256  # tunix splits a sequence into prompt + completion; seq_len is their sum


def grpo_step(
    model_cfg: ModelConfig, device, *, seq_len: int, batch: int, remat: bool, flash: bool = False
) -> tuple[Any, Any, Any, Any]:
    """(jitted step, params, optimizer state, example): the inputs are ShapeDtypeStructs on
    `device`; the step is `step(params, opt_state, example) -> (params, opt_state, loss)`."""
    import optax
    from tunix.models.qwen2 import model as tq
    from tunix.rl import algo_core, common
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    if seq_len <= PROMPT:
        raise ValueError(f"seq_len {seq_len} must exceed the peer's prompt length {PROMPT}")
    tcfg = rollout_bench.tunix_config(
        model_cfg,
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        remat_config=tq.RematConfig.DECODER if remat else tq.RematConfig.NONE,
        use_flash_attention=flash,
    )
    abstract = nnx.eval_shape(lambda: tq.Qwen2(tcfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    algo = GRPOConfig(beta=0.0)
    algo.temperature = 1.0  # its learner copies the rollout temperature here
    tx = optax.adamw(1e-6, b1=0.9, b2=0.98, weight_decay=0.1)
    mesh = Mesh(np.asarray([device]).reshape(1, 1), ("fsdp", "tp"))

    def step(params, opt_state, example):
        def loss(p):
            model = nnx.merge(graphdef, p, rest)
            return algo_core.grpo_loss_fn(model, example, algo, pad_id=0, eos_id=1)

        # Its attention reads the mesh from this context (`pxla.thread_resources`), at trace time.
        with mesh:
            (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    completion = seq_len - PROMPT
    example = common.TrainExample(
        prompt_ids=sds((batch, PROMPT), jnp.int32),
        prompt_mask=sds((batch, PROMPT), jnp.int32),
        completion_ids=sds((batch, completion), jnp.int32),
        completion_mask=sds((batch, completion), jnp.int32),
        advantages=sds((batch,), jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=sds((batch, completion), jnp.float32),
    )
    one = NamedSharding(mesh, PartitionSpec())
    params, example = tpu_aot._place((params, example), one)
    opt_state = tpu_aot._place(jax.eval_shape(tx.init, params), one)
    return jax.jit(step, donate_argnums=(0, 1)), params, opt_state, example
