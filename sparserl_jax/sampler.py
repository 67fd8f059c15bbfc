"""The sampler side of a run: its devices, its copy of the published weights, its engines.

The sampler holds exactly the bits the trainer published (`bf16(master)` by default), received
through PULSESync and checked against the publisher's full-state digest, and generates with them:
training rollouts (sampled, `rollout` config) and held-out evaluation (the same sampling, plus
one greedy completion per prompt).

Meshes: `colocated` lays one mesh over every device (the sampler's weights live on the learner's
devices); `split` gives the last `train.sampler_devices` devices to the sampler and the rest to
the trainer, and the patch is applied onto the sampler mesh in-process. The sampler mesh is data
x fsdp x tensor (`train.sampler_fsdp`, `train.sampler_tensor`): weights over tensor (and their
hidden dim over fsdp), each data shard (with `rollout.fsdp_shards`, each data x fsdp shard) its
own rollout slots and KV pages (`rollout.shards`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from sparserl_jax.config import TrainConfig
from sparserl_jax.data import Example, compute_rewards
from sparserl_jax.parallel import MeshConfig, make_mesh, state_shardings
from sparserl_jax.rollout import RolloutConfig, RolloutEngine, RolloutResult
from sparserl_jax.rollout.shards import check_split
from sparserl_jax.sync import ApplyEvent, Receiver, Transport, leaf_names
from sparserl_jax.sync.mask import from_bits, published_dtype
from sparserl_jax.sync.parts import OpenTransport, PartsReceiver

__all__ = [
    "Sampler",
    "completion_texts",
    "make_meshes",
    "published_params",
    "sampler_shardings",
    "step_seeds",
    "trainer_devices",
]


def make_meshes(
    mesh_cfg: MeshConfig,
    train_cfg: TrainConfig,
    devices: Sequence[jax.Device],
    *,
    rollout: RolloutConfig | None = None,
) -> tuple[Mesh, Mesh | None]:
    """The trainer's mesh and, with `topology=split`, the sampler's (None when colocated).
    With `rollout`, also checks that its slots and pages split over the sampling mesh's data
    shards (`rollout.shards`), before anything is built."""
    if train_cfg.topology == "colocated":
        trainer, sampler = make_mesh(mesh_cfg, devices), None
    else:
        k = train_cfg.sampler_devices
        if k >= len(devices):
            raise ValueError(
                f"train.topology=split needs more devices than train.sampler_devices={k}; have "
                f"{len(devices)} (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8)"
            )
        try:
            trainer = make_mesh(mesh_cfg, devices[: len(devices) - k])
        except ValueError as e:
            raise ValueError(f"{e} ({trainer_devices(train_cfg, len(devices))})") from None
        split = MeshConfig(data=-1, fsdp=train_cfg.sampler_fsdp, tensor=train_cfg.sampler_tensor)
        sampler = make_mesh(split, devices[len(devices) - k :])
    if rollout is not None:
        mesh = sampler or trainer
        check_split(
            mesh, rollout.num_slots, rollout.pool_pages, rollout.pages_per_slot, rollout.fsdp_shards
        )
    return trainer, sampler


def trainer_devices(train_cfg: TrainConfig, num_devices: int) -> str:
    """How many devices the trainer's mesh is laid over and why, for error messages."""
    if train_cfg.topology == "colocated":
        return f"{num_devices} devices"
    k = train_cfg.sampler_devices
    return (
        f"{num_devices - k} devices: {num_devices} less train.sampler_devices={k} for the "
        "sampler (train.topology=split)"
    )


def sampler_shardings(model: nnx.Module, mesh: Mesh) -> dict[str, Any]:
    """Per leaf name (`sync.leaf_names`), the sharding the sampler holds that weight with."""
    state = nnx.state(model)
    shardings = jax.tree.leaves(
        nnx.to_pure_dict(state_shardings(state, mesh)),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return dict(zip(leaf_names(nnx.to_pure_dict(state)), shardings, strict=True))


def published_params(bits_tree, like, publish_dtype):
    """Published bits (a PULSESync tree) as parameters with the dtypes of `like`: exact, since
    every published value is representable in the (wider) parameter dtype."""
    return jax.tree.map(
        lambda b, x: from_bits(b, published_dtype(x.dtype, publish_dtype)).astype(x.dtype),
        bits_tree,
        like,
    )


def step_seeds(seed: int, step: int, n: int) -> list[int]:
    """Per-prompt rollout seeds of one step: a pure function of `(seed, step)`."""
    return [int(s) for s in np.random.SeedSequence([seed, step]).generate_state(n)]


def completion_texts(result: RolloutResult, tokenizer) -> list[str]:
    """The decoded completions (special tokens such as the stop token dropped)."""
    return [
        tokenizer.decode(result.completion_ids[i, : int(result.completion_lens[i])].tolist())
        for i in range(len(result.prompt_ids))
    ]


def _engines(
    model: nnx.Module, rollout: RolloutConfig, mesh: Mesh | None
) -> tuple[RolloutEngine, RolloutEngine]:
    """The training-rollout engine of `rollout` and its greedy evaluation twin."""
    greedy = dataclasses.replace(rollout, temperature=0.0, n_samples=1)
    return RolloutEngine(model, rollout, mesh=mesh), RolloutEngine(model, greedy, mesh=mesh)


@dataclasses.dataclass
class Sampler:
    """The sampler's weights (received through PULSESync) and its two engines: `engine` samples
    like the training rollouts, `eval_engine` decodes one greedy completion per prompt.

    With a compressed KV cache, `set_kv_budget` switches both to another budget (the adaptive
    budget, `kvcache.adaptive`); `kv_budget` is the one in use (None when dense)."""

    receiver: Receiver | PartsReceiver  # parts: a trainer of several processes (`sync.parts`)
    treedef: Any
    names: list[str]
    like: Any  # the parameter tree's shapes and dtypes
    publish_dtype: Any
    engine: RolloutEngine
    eval_engine: RolloutEngine
    model: nnx.Module | None = None  # the graph the engines run (to build other budgets')
    mesh: Mesh | None = None
    kv_budget: int | None = None
    # Per budget, its two engines: built on first use and kept, so each budget's programs
    # compile once however often the budget comes back (a ladder bounds how many there are).
    by_budget: dict[int, tuple[RolloutEngine, RolloutEngine]] = dataclasses.field(
        default_factory=dict
    )
    # The sampled and greedy engines with the full cache (`train.eval_dense`), built on first use.
    dense_engines: tuple[RolloutEngine, RolloutEngine] | None = None

    @classmethod
    def create(
        cls,
        model: nnx.Module,
        params,
        rollout: RolloutConfig,
        *,
        shardings: dict[str, Any],
        publish_dtype,
        mesh: Mesh | None = None,
    ) -> Sampler:
        """A sampler running `model`'s graph that holds nothing yet (its first `sync` brings the
        weights), each leaf laid out as `shardings` says (see `sampler_shardings`). `params` gives
        the parameter tree's structure and dtypes. `mesh`: the sampler's devices, over which
        the engines lay out their paged caches and run their kernels."""
        budget = rollout.kv.budget if rollout.sparse else None
        if budget is not None:
            rollout = rollout.with_budget(budget)  # the engines never adapt by themselves
        engine, eval_engine = _engines(model, rollout, mesh)
        return cls(
            receiver=Receiver(lambda name, shape: shardings[name]),
            treedef=jax.tree.structure(params),
            names=leaf_names(params),
            like=jax.eval_shape(lambda p: p, params),
            publish_dtype=publish_dtype,
            engine=engine,
            eval_engine=eval_engine,
            model=model,
            mesh=mesh,
            kv_budget=budget,
            by_budget={} if budget is None else {budget: (engine, eval_engine)},
        )

    def set_kv_budget(self, budget: int) -> None:
        """Roll out and evaluate with KV budget `budget` (tokens) from the next rollout on.

        Each budget's engines are built the first time it is asked for and kept: their programs
        compile once, and their page pools exist only while a rollout runs (an engine allocates
        its cache per `generate`), so a budget not in use holds no KV memory."""
        if self.kv_budget is None:
            raise ValueError("set_kv_budget needs a compressed KV cache (rollout.kv.policy)")
        if budget not in self.by_budget:
            rollout = self.engine.config.with_budget(budget)
            self.by_budget[budget] = _engines(self.model, rollout, self.mesh)
        self.engine, self.eval_engine = self.by_budget[budget]
        self.kv_budget = budget

    @property
    def version(self) -> int:
        """The weight version the sampler holds."""
        return self.receiver.version

    def sync(self, transport: Transport | OpenTransport) -> list[ApplyEvent]:
        """Apply every patch (or anchor) newer than the held version; each event says whether it
        was verified bit-identical. A `PartsReceiver` takes the location's sub-transports."""
        return self.receiver.sync(transport)

    def params(self):
        """The sampler's weights: its published bits, cast to the model's parameter dtypes."""
        bits = self.receiver.tree(self.treedef, self.names)
        return published_params(bits, self.like, self.publish_dtype)

    def rollout(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        *,
        stop=None,
        refresh=None,
        recompute_cache: bool = False,
    ) -> RolloutResult:
        """Sample `rollout.n_samples` completions per prompt with the held weights; `stop`: the
        engine's hook, asked between decode chunks (`RolloutAborted` when it says so);
        `refresh() -> bool`, asked there too: True when it synced newer weights, which the
        sequences in flight continue with (partial rollouts; `recompute_cache`: each
        sequence's cache rebuilt with them, see `RolloutEngine.generate`)."""

        def newer():
            return (self.params(), self.version) if refresh() else None

        return self.engine.generate(
            prompts,
            params=self.params(),
            weight_version=self.version,
            seeds=seeds,
            stop=stop,
            refresh=None if refresh is None else newer,
            recompute_cache=recompute_cache,
        )

    def evaluate(
        self,
        examples: list[Example],
        prompts: list[list[int]],
        tokenizer,
        reward_fn,
        *,
        dense: bool = False,
        sampled: bool = True,
        samples: int = 0,
    ) -> dict[str, float]:
        """Held-out reward of the held weights on `examples` (`prompts`: their token ids): the
        mean over a group of completions per prompt sampled like the training rollouts, with
        fixed seeds (`val/reward_mean`: the policy RL improves; left out when not `sampled`),
        and of one greedy completion per prompt (`val/greedy_reward_mean`); both decode with
        the rollouts' KV cache. `dense` (with a compressed cache): the same decoded with the
        full cache (`val/dense_reward_mean`, `val/dense_greedy_reward_mean`). `samples`: the
        sampled group's size per prompt (0: the rollouts' `n_samples`)."""
        if not examples:
            return {}
        params = self.params()
        seeds = list(range(len(prompts)))
        out = {}
        engines = [("val/", self.engine), ("val/greedy_", self.eval_engine)]
        if dense and self.kv_budget is not None:
            if self.dense_engines is None:
                full = dataclasses.replace(self.engine.config, kv=None)
                self.dense_engines = _engines(self.model, full, self.mesh)
            engines += [("val/dense_", self.dense_engines[0])]
            engines += [("val/dense_greedy_", self.dense_engines[1])]
        for prefix, engine in engines if sampled else engines[1::2]:
            n = samples if samples and engine.config.temperature > 0 else None  # greedy: 1
            result = engine.generate(prompts, params=params, seeds=seeds, n_samples=n)
            group = len(result.prompt_ids) // len(prompts)
            texts = completion_texts(result, tokenizer)
            rewards = compute_rewards(reward_fn, examples, texts, group_size=group)
            out[f"{prefix}reward_mean"] = float(rewards.mean())
            out[f"{prefix}response_length_mean"] = float(result.completion_lens.mean())
        return out
