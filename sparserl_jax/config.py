"""Typed configuration: frozen dataclasses as the schema, YAML presets, dotted overrides.

    cfg = load_config("configs/demo.yaml", ["model.dtype=float32", "generate.max_new_tokens=64"])

- Every section is a frozen keyword-only dataclass that validates itself in `__post_init__`.
- `from_dict` builds a dataclass from nested dicts and checks every value against the field's
  type. An unknown key is an error naming the closest valid keys; a wrong type names the field,
  the value and the expected type.
- Overrides are `dotted.key=value`; the value is parsed as YAML (`3`, `true`, `null`, `[1, 2]`).
- Floats also accept strings such as `1e-6`, which YAML 1.1 (PyYAML) reads as strings.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml

from sparserl_jax.data.config import DataConfig
from sparserl_jax.decoupled.config import AsyncConfig, ExchangeConfig
from sparserl_jax.models.config import ModelConfig
from sparserl_jax.models.hf import read_hf_config
from sparserl_jax.models.presets import model_preset
from sparserl_jax.parallel.sharding import MeshConfig
from sparserl_jax.rl.advantages import GROUP_ESTIMATORS, AdvantageEstimator
from sparserl_jax.rl.config import LearnerConfig
from sparserl_jax.rollout.config import GenerateConfig, RolloutConfig
from sparserl_jax.sft import SFTConfig
from sparserl_jax.sync.publisher import SyncConfig


class ConfigError(ValueError):
    """A config value or key that does not fit the schema (the message names it)."""


# ---------------------------------------------------------------------------------------------
# schema
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Where the model comes from and how it computes.

    Set either `hf_dir` (weights and architecture from a checkpoint) or a random model's
    architecture: `preset`, `arch`, or both (`arch`'s keys then replace the preset's fields).

    Attributes:
      hf_dir: a local Hugging Face checkpoint directory (Llama-3, Qwen2/2.5, Qwen3). When set,
        the architecture comes from its `config.json` and `preset`/`arch` must be left out.
      preset: a name in `sparserl_jax.models.MODEL_PRESETS` (e.g. `qwen2.5-0.5b`, `char-tiny`);
        an unknown name is an error naming the closest ones.
      arch: the architecture of a randomly initialised model (when `hf_dir` is null): a
        `ModelConfig` or a mapping of its fields, all of them without `preset`, any of them on
        top of it (`head_dim` is not re-derived). Always the resolved `ModelConfig` after init,
        carrying this section's dtype/param_dtype/remat/attention/attention_block/mlp_chunk;
        a mapping that sets one of them to another value than this section is an error.
      dtype: compute dtype. param_dtype: storage dtype of the (master) parameters.
      remat: rematerialise blocks in the backward pass.
      attention: teacher-forcing attention (`ModelConfig.attention`): auto (splash on TPU,
        cuDNN on GPU, chunked elsewhere), dense (the `[T, T]` reference), chunked, cudnn, splash.
      attention_block: the query/key block of the chunked path and splash (tokens).
      mlp_chunk: teacher forcing runs the SwiGLU over blocks of this many tokens when a sequence
        is longer, each rematerialised in the backward (`ModelConfig.mlp_chunk`); 0: whole.
      seed: initialisation seed of a random model.
    """

    hf_dir: str | None = None
    preset: str | None = None
    arch: Any = None  # ModelConfig | Mapping[str, Any] | None; a ModelConfig or None after init
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: bool = False
    attention: Literal["auto", "dense", "chunked", "cudnn", "splash"] = "auto"
    attention_block: int = 512
    mlp_chunk: int = 4096
    seed: int = 0

    def settings(self) -> dict[str, Any]:
        """The `ModelConfig` fields this section sets (the same in `arch` or an error)."""
        names = ("dtype", "param_dtype", "remat", "attention", "attention_block", "mlp_chunk")
        return {name: getattr(self, name) for name in names}

    def __post_init__(self):
        if (self.hf_dir is None) == (self.arch is None and self.preset is None):
            raise ConfigError(
                "model: set exactly one of model.hf_dir and model.arch/model.preset (a preset's "
                "fields can be overridden by model.arch)"
            )
        if self.hf_dir is not None:
            return
        fields = {}
        if self.preset is not None:
            try:
                preset = model_preset(self.preset)
            except ValueError as e:
                raise ConfigError(f"model.preset: {e}") from None
            fields = {f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)}
        arch, section = self.arch, self.settings()
        if arch is None:
            arch = preset
        elif isinstance(arch, Mapping):
            for key in section.keys() & arch.keys():
                if arch[key] != section[key]:
                    raise ConfigError(
                        f"model.arch.{key} = {arch[key]!r} but model.{key} = {section[key]!r}: "
                        f"model.{key} is the one used; set it there only"
                    )
            arch = from_dict(ModelConfig, {**fields, **arch}, prefix="model.arch")
        elif not isinstance(arch, ModelConfig):
            raise ConfigError(
                f"model.arch = {arch!r} ({type(arch).__name__}) but expected a mapping of "
                "ModelConfig fields"
            )
        object.__setattr__(self, "arch", arch.replace(**section))

    def model_config(self) -> ModelConfig:
        """The resolved architecture (reads `config.json` when `hf_dir` is set)."""
        if self.arch is not None:
            return self.arch
        return read_hf_config(self.hf_dir, **self.settings())


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """`char`: the built-in character tokenizer (synthetic tasks). `hf`: a local `tokenizer.json`
    from `path` (defaults to `model.hf_dir`), special ids from the checkpoint's config."""

    kind: Literal["char", "hf"] = "char"
    path: str | None = None


Topology = Literal["colocated", "split"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The RL loop.

    Attributes:
      steps: RL steps (one rollout batch each, reused for up to `learner.gating.max_passes`).
      seed: rollout seed; step s samples with keys derived from `(seed, s)`.
      advantage_estimator: `grpo`, `dr_grpo`, `dapo`, `rloo`, `reinforce_pp` or
        `reinforce_pp_baseline` (verl `algorithm.adv_estimator`); groups are
        `rollout.n_samples` wide.
      advantages_over_kept: group advantages over the samples the correction keeps, not the
        full group as Sparse-RL (`rl.kept_group_advantages`; pi_old from a separate forward).
      topology: `colocated` or `split` (trainer and sampler on disjoint devices).
      sampler_devices: with `split`, how many devices (the last ones) the sampler gets; the
        trainer mesh (`mesh:` section) is laid over the rest. The sampler's mesh is data x
        fsdp x tensor with `sampler_tensor` on tensor (weights, heads, vocabulary),
        `sampler_fsdp` on fsdp (weights split by their hidden dim: for weights that do not fit
        a chip; with `rollout.fsdp_shards` each fsdp shard also holds its own slots and the
        weights are never gathered), the rest on data (each data shard its own rollout slots
        and KV pages).
      save_every: checkpoint every this many steps (and at the end, and on SIGTERM).
      keep_checkpoints: how many checkpoints to keep.
      async_checkpoint: save in the background.
      resume: continue from the newest checkpoint in `run_dir` when there is one.
      eval_every: greedy evaluation on held-out prompts every this many steps (0: only before
        the first and after the last step); `eval_examples` prompts.
      eval_dense: with a compressed KV cache, the held-out evaluation also decodes with the
        full cache (`val/dense_reward_mean` sampled, `val/dense_greedy_reward_mean`): the
        trained policy's quality apart from the eviction its rollouts and `val/` figures
        decode with. Training is unchanged (the extra decodes only read the weights).
      eval_sampled: also decode each held-out prompt's group of sampled completions
        (`val/reward_mean`); false keeps only the greedy completion (`val/greedy_reward_mean`,
        verl's default `do_sample: false`), a group's worth less decoding per prompt.
      eval_samples: completions sampled per held-out prompt (0: `rollout.n_samples`, a
        training group); 1 spreads the same decoding over more prompts (a large held-out set
        read at the training temperature, one sample each).
      tensorboard: also write TensorBoard event files (needs tensorboardX).
      progress: show a progress bar with ETA on the console.
      plot: write `metrics.png` in the run directory at the end.
    """

    steps: int = 100
    seed: int = 0
    advantage_estimator: AdvantageEstimator = "grpo"
    advantages_over_kept: bool = False
    topology: Topology = "colocated"
    sampler_devices: int = 1
    sampler_tensor: int = 1
    sampler_fsdp: int = 1
    save_every: int = 50
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    resume: bool = True
    eval_every: int = 0
    eval_examples: int = 64
    eval_dense: bool = False
    eval_sampled: bool = True
    eval_samples: int = 0
    tensorboard: bool = False
    progress: bool = True
    plot: bool = True

    def __post_init__(self):
        if self.steps < 0:
            raise ConfigError(f"train.steps must be >= 0, got {self.steps}")
        if self.advantages_over_kept and self.advantage_estimator not in GROUP_ESTIMATORS:
            raise ConfigError(
                f"train.advantages_over_kept needs a group estimator {GROUP_ESTIMATORS}, got "
                f"train.advantage_estimator={self.advantage_estimator!r}"
            )
        if self.topology not in ("colocated", "split"):
            raise ConfigError(
                f"train.topology {self.topology!r} unknown; expected colocated, split"
            )
        split = self.sampler_tensor * self.sampler_fsdp
        if min(self.sampler_devices, self.sampler_tensor, self.sampler_fsdp) < 1 or (
            self.sampler_devices % split
        ):
            raise ConfigError(
                f"train.sampler_devices={self.sampler_devices} must be >= 1 and divide by "
                f"train.sampler_tensor={self.sampler_tensor} x "
                f"train.sampler_fsdp={self.sampler_fsdp}"
            )
        if self.save_every < 1 or self.keep_checkpoints < 1:
            raise ConfigError(
                f"train.save_every and train.keep_checkpoints must be >= 1, got "
                f"{self.save_every}, {self.keep_checkpoints}"
            )
        if min(self.eval_every, self.eval_examples, self.eval_samples) < 0:
            raise ConfigError(
                "train.eval_every, train.eval_examples and train.eval_samples must be >= 0"
            )

    @property
    def evaluation(self) -> dict[str, bool | int]:
        """How the held-out set is decoded: `Sampler.evaluate`'s keyword arguments."""
        return {
            "dense": self.eval_dense,
            "sampled": self.eval_sampled,
            "samples": self.eval_samples,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The whole experiment: one section per component, each validated by its own dataclass."""

    model: ModelSpec
    mesh: MeshConfig = MeshConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    generate: GenerateConfig = GenerateConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    sft: SFTConfig = SFTConfig()
    train: TrainConfig = TrainConfig()
    exchange: ExchangeConfig = ExchangeConfig()
    # `async` is a Python keyword: the YAML key is `async`, the attribute `async_`.
    async_: AsyncConfig = dataclasses.field(default=AsyncConfig(), metadata={"key": "async"})
    run_dir: str = "runs/default"

    def __post_init__(self):
        if self.learner.attention_mask == "replay" and not self.rollout.record_evictions:
            raise ConfigError("learner.attention_mask=replay needs rollout.record_evictions=true")


# ---------------------------------------------------------------------------------------------
# dict -> dataclass with type checking
# ---------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against type `tp`, converting YAML forms (list -> tuple, '1e-6' -> float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        candidates = [a for a in args if a is not type(None)]
        # A mapping can only be a dataclass and a list only a sequence: convert straight away so
        # the error from inside (an unknown nested key, say) reaches the user unchanged.
        if isinstance(value, Mapping):
            candidates = [a for a in candidates if dataclasses.is_dataclass(a)] or candidates
        if len(candidates) == 1:
            return _convert(value, candidates[0], where)
        for arg in candidates:
            try:
                return _convert(value, arg, where)
            except ConfigError:
                pass
        raise ConfigError(
            f"{where} = {value!r} ({type(value).__name__}) but expected {_type_name(tp)}"
        )
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{where} = {value!r} is not {_type_name(tp)}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{where} = {value!r} ({type(value).__name__}) but expected a mapping for "
                f"{tp.__name__}"
            )
        return from_dict(tp, value, prefix=where)
    if origin in (tuple, list, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r} ({type(value).__name__}) but expected a list")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is not list else items
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = [m.value for m in tp]
            raise ConfigError(f"{where} = {value!r} is not one of {allowed}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r} (bool) but expected float")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} = {value!r} ({type(value).__name__}) but expected float")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} = {value!r} ({type(value).__name__}) but expected int")
    if tp in (bool, str):
        if type(value) is tp:
            return value
        raise ConfigError(
            f"{where} = {value!r} ({type(value).__name__}) but expected {tp.__name__}"
        )
    raise ConfigError(f"{where}: unsupported field type {tp!r}")


def _hints(cls) -> dict[str, Any]:
    # Each section's annotations resolve in its own module (they may be strings there).
    return typing.get_type_hints(cls, globalns=vars(sys.modules[cls.__module__]))


def from_dict(cls, data: Mapping[str, Any], *, prefix: str = ""):
    """Build dataclass `cls` from a nested mapping, checking names and types."""
    fields = {_key(f): f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            valid = sorted(fields)
            close = difflib.get_close_matches(str(key), valid, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
            raise ConfigError(f"unknown key {where!r}; {hint}valid keys here: {valid}")
        kwargs[fields[key].name] = _convert(value, hints[fields[key].name], where)
    missing = [
        name
        for name, f in fields.items()
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = prefix or cls.__name__
        raise ConfigError(f"{where}: missing required keys {missing}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from e


def _key(f: dataclasses.Field) -> str:
    """A field's key in YAML: its name, or `metadata["key"]` where the name is a keyword."""
    return f.metadata.get("key", f.name)


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (YAML-safe)."""
    if dataclasses.is_dataclass(obj):
        return {_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply `a.b.c=value` overrides to a nested dict (a copy); values are parsed as YAML."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r} has an empty key part")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def load_config(
    path: str | os.PathLike | None, overrides: Sequence[str] = (), *, cls: type = Config
):
    """Read a YAML preset (or start from nothing), apply overrides, validate into `cls`."""
    data: dict = {}
    if path is not None:
        with open(path) as f:
            loaded = yaml.safe_load(f)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    try:
        return from_dict(cls, apply_overrides(data, overrides))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None
