"""Hugging Face checkpoints: read and write Llama / Qwen2 / Qwen3 directories, never the network.

`from_hf(path)` reads `config.json` plus `model.safetensors` or a sharded set listed in
`model.safetensors.index.json`; `to_hf(model, path)` writes a directory `transformers` loads.
Layout differences are handled here only: HF stores projections as `[out, in]`, the model as
`[in, out]`, q/k/v as `[D, N * H]` for heads a multiple of 128 wide and `[D, N, H]` otherwise
(`ModelConfig.fused_heads`), `o_proj` split per head (`[N, H, D]`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from sparserl_jax.models.config import ModelConfig, RopeScaling
from sparserl_jax.models.transformer import Transformer

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_HF_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CheckpointError(ValueError):
    """A Hugging Face directory that cannot be loaded as asked (names the file and tensor)."""


def read_json(file: Path) -> Any:
    """The parsed JSON of `file` (which must exist); a `CheckpointError` naming it and the
    place of the fault when it is not JSON."""
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{file}: malformed JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: not UTF-8 text (byte {e.start})") from e


def read_hf_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The `ModelConfig` of the Hugging Face directory `path` (its `config.json`); every fault
    (missing, malformed, a missing key, an unsupported feature) is a `CheckpointError` naming
    the file."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file} not found (expected a local Hugging Face directory)")
    hf = read_json(file)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(hf).__name__}")
    try:
        return config_from_hf(hf, **overrides)
    except KeyError as e:
        raise CheckpointError(f"{file}: no {e.args[0]!r} key (needed to build the model)") from e
    except (TypeError, ValueError) as e:  # CheckpointError included: add the file
        raise CheckpointError(f"{file}: {e}") from e


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ---------------------------------------------------------------------------------------------


def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` and
    # `rope_scaling`. Accept both.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaled = [d for d in (params, scaling) if d.get("rope_type", d.get("type")) != "default"]
    scaled = [d for d in scaled if d.get("rope_type", d.get("type"))]
    if not scaled:
        return float(theta), None
    types = {d.get("rope_type", d.get("type")) for d in scaled}
    if len(types) > 1:
        raise CheckpointError(f"rope_parameters and rope_scaling disagree: {sorted(types)}")
    merged = scaled[0]
    rope_type = types.pop()
    if rope_type not in ("llama3", "linear"):
        raise CheckpointError(
            f"RoPE scaling type {rope_type!r} is not supported (supported: default, llama3, linear)"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    kwargs = {k: merged[k] for k in keys if k in merged}
    return float(theta), RopeScaling(rope_type=rope_type, **kwargs)


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """Build a `ModelConfig` from a parsed Hugging Face `config.json`.

    The family comes from `architectures` (a class in `ARCHITECTURES`), or from `model_type`
    when no class is named. A named class that is not supported is refused even when
    `model_type` is (`Qwen2ForSequenceClassification` has model_type `qwen2`): another head on
    the same backbone would load as a causal LM; the error names both.

    Raises `CheckpointError` for an architecture or feature this model does not implement.
    """
    archs = hf.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    model_type = hf.get("model_type")
    if family is None and archs and model_type in _HF_ARCH:
        raise CheckpointError(
            f"architectures {archs} is not supported, though model_type {model_type!r} is: "
            f"this loads only {sorted(ARCHITECTURES)} (set architectures to "
            f"[{_HF_ARCH[model_type]!r}] if the weights are that model's)"
        )
    if family is None:
        family = model_type if model_type in _HF_ARCH else None
    if family is None:
        raise CheckpointError(
            f"unsupported architecture {archs or hf.get('model_type')!r}; supported: "
            f"{sorted(ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window=true is not supported (full attention only)")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise CheckpointError(f"layer_types {sorted(set(layer_types))} not supported")
    theta, scaling = _rope_from_hf(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    num_heads = hf["num_attention_heads"]
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        intermediate_size=hf["intermediate_size"],
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama and Qwen3 put biases on q/k/v/o when asked.
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        family=family,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def config_to_hf(cfg: ModelConfig, *, torch_dtype: str) -> dict:
    """The `config.json` dict for `cfg` (legacy `rope_theta`/`rope_scaling` keys, read by all
    transformers versions)."""
    if cfg.family == "qwen2" and (cfg.o_bias or not cfg.qkv_bias):
        raise CheckpointError("Qwen2 needs qkv_bias=True and o_bias=False to be exportable")
    if cfg.family in ("llama", "qwen3") and cfg.qkv_bias != cfg.o_bias:
        raise CheckpointError(f"{cfg.family} exports biases on q/k/v/o together or not at all")
    if (cfg.family == "qwen3") != cfg.qk_norm:
        raise CheckpointError("qk_norm is exportable only as family qwen3")
    hf = {
        "architectures": [_HF_ARCH[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }
    if cfg.family != "qwen2":
        hf["attention_bias"] = cfg.qkv_bias
    if cfg.family == "llama":
        hf["mlp_bias"] = cfg.mlp_bias
    elif cfg.mlp_bias:
        raise CheckpointError(f"mlp_bias is not exportable for {cfg.family}")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type != "default":
        rs = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": rs.rope_type, "factor": rs.factor}
        if rs.rope_type == "llama3":
            hf["rope_scaling"].update(
                low_freq_factor=rs.low_freq_factor,
                high_freq_factor=rs.high_freq_factor,
                original_max_position_embeddings=rs.original_max_position_embeddings,
            )
    if cfg.family in ("qwen2", "qwen3"):
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    return hf


# ---------------------------------------------------------------------------------------------
# tensor name mapping
# ---------------------------------------------------------------------------------------------

# Each entry: (HF name, model path, to_model(hf array), to_hf(model array)).
Mapping = tuple[str, tuple, Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def tensor_mapping(cfg: ModelConfig) -> list[Mapping]:
    """Every HF tensor name with its place in the model and the layout transforms both ways."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def in_proj(heads: int):  # HF [heads*H, D] <-> model [D, heads*H] or [D, heads, H]
        if cfg.fused_heads:
            return transpose
        return (lambda w: w.T.reshape(d, heads, h), lambda w: w.reshape(d, heads * h).T)

    def head_bias(heads: int):  # HF [heads*H] <-> model [heads, H]
        return (lambda b: b.reshape(heads, h), lambda b: b.reshape(heads * h))

    out_proj = (lambda w: w.T.reshape(n, h, d), lambda w: w.reshape(n * h, d).T)
    transpose = (lambda w: w.T, lambda w: w.T)
    same = (_identity, _identity)

    entries: list[Mapping] = [("model.embed_tokens.weight", ("embed", "embedding"), *same)]
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", ("layers", i)
        attn, mlp = p + "self_attn.", p + "mlp."
        entries += [
            (p + "input_layernorm.weight", (*m, "input_norm", "weight"), *same),
            (p + "post_attention_layernorm.weight", (*m, "post_attn_norm", "weight"), *same),
            (attn + "q_proj.weight", (*m, "attn", "q_proj"), *in_proj(n)),
            (attn + "k_proj.weight", (*m, "attn", "k_proj"), *in_proj(k)),
            (attn + "v_proj.weight", (*m, "attn", "v_proj"), *in_proj(k)),
            (attn + "o_proj.weight", (*m, "attn", "o_proj"), *out_proj),
            (mlp + "gate_proj.weight", (*m, "mlp", "gate_proj"), *transpose),
            (mlp + "up_proj.weight", (*m, "mlp", "up_proj"), *transpose),
            (mlp + "down_proj.weight", (*m, "mlp", "down_proj"), *transpose),
        ]
        if cfg.qkv_bias:
            entries += [
                (attn + "q_proj.bias", (*m, "attn", "q_bias"), *head_bias(n)),
                (attn + "k_proj.bias", (*m, "attn", "k_bias"), *head_bias(k)),
                (attn + "v_proj.bias", (*m, "attn", "v_bias"), *head_bias(k)),
            ]
        if cfg.o_bias:
            entries.append((attn + "o_proj.bias", (*m, "attn", "o_bias_"), *same))
        if cfg.qk_norm:
            entries += [
                (attn + "q_norm.weight", (*m, "attn", "q_norm", "weight"), *same),
                (attn + "k_norm.weight", (*m, "attn", "k_norm", "weight"), *same),
            ]
        if cfg.mlp_bias:
            entries += [
                (mlp + "gate_proj.bias", (*m, "mlp", "gate_bias"), *same),
                (mlp + "up_proj.bias", (*m, "mlp", "up_bias"), *same),
                (mlp + "down_proj.bias", (*m, "mlp", "down_bias"), *same),
            ]
    entries.append(("model.norm.weight", ("final_norm", "weight"), *same))
    if not cfg.tie_embeddings:
        entries.append(("lm_head.weight", ("lm_head", "kernel"), *transpose))
    return entries


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        files = {name: path / fname for name, fname in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.exists()})
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
        return files
    if single.exists():
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    found = sorted(p.name for p in path.glob("*.safetensors"))
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {path} (found: {found or 'none'})"
    )


def _read_tensors(
    files: dict[str, Path], names: list[str], *, dtypes_only: bool = False
) -> Iterator[tuple[str, np.ndarray | str]]:
    """(name, tensor) of `names`, file by file; `dtypes_only`: (name, the dtype in the header,
    e.g. `BF16`, `I8`) without reading the tensors."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for fname, members in by_file.items():
        with _open_safetensors(fname) as f:
            for name in members:
                try:
                    yield name, f.get_slice(name).get_dtype() if dtypes_only else f.get_tensor(name)
                except SafetensorError as e:
                    raise CheckpointError(f"{fname}: cannot read tensor {name} ({e})") from e


def _open_safetensors(file: Path):
    """`safe_open(file)`; a truncated file or a bad header is a `CheckpointError` naming it."""
    try:
        return safe_open(file, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e


def from_hf(
    path: str | os.PathLike,
    *,
    dtype: str | jnp.dtype = "float32",
    param_dtype: str | jnp.dtype = "float32",
    remat: bool = False,
    **overrides,
) -> Transformer:
    """Load a local Hugging Face Llama / Qwen2 / Qwen3 checkpoint directory.

    Args:
      path: directory with `config.json` and `model.safetensors` (or a sharded set with
        `model.safetensors.index.json`). Nothing is fetched from the network.
      dtype: compute dtype. param_dtype: storage dtype of the parameters.
      remat: rematerialise blocks in the backward pass.
      overrides: other `ModelConfig` fields that are no part of the checkpoint (`attention`,
        `attention_block`, `mlp_chunk`).

    Raises:
      CheckpointError: unsupported architecture, missing or unexpected tensors, a shape
        mismatch, a tensor stored in an integer dtype.
    """
    path = Path(path)
    cfg = read_hf_config(path, dtype=dtype, param_dtype=param_dtype, remat=remat, **overrides)
    mapping = tensor_mapping(cfg)
    files = _weight_files(path)
    expected = {hf_name for hf_name, *_ in mapping}
    missing = sorted(expected - set(files))
    if missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:8]} ({len(missing)} in all)")
    extra = set(files) - expected
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding); rotary caches
    # from old exports are buffers, not weights. Anything else is a model we would load wrongly.
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
    extra = sorted(n for n in extra if n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors {extra[:8]} ({len(extra)} in all)")

    for hf_name, stored in _read_tensors(files, sorted(expected), dtypes_only=True):
        if stored.startswith(("I", "U", "BOOL")):  # quantized, say: refused before any read
            stored = stored.lower().replace("i", "int").replace("u", "uint")  # I8 -> int8
            raise CheckpointError(
                f"{files[hf_name]}: {hf_name} is stored as {stored}, not a float dtype "
                "(dequantize the checkpoint first)"
            )
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    by_name = {hf_name: (mpath, to_model, to_hf) for hf_name, mpath, to_model, to_hf in mapping}
    for hf_name, tensor in _read_tensors(files, sorted(expected)):
        mpath, to_model, to_hf_fn = by_name[hf_name]
        var = flat[mpath]
        hf_shape = to_hf_fn(np.zeros(var.shape, np.int8)).shape
        if tensor.shape != hf_shape:
            raise CheckpointError(
                f"{files[hf_name]}: {hf_name}: shape {tensor.shape} in the checkpoint, but "
                f"config.json implies {hf_shape}"
            )
        value = to_model(tensor).astype(np.float32)
        var.set_value(jnp.asarray(value).astype(cfg.weight_dtype))
    nnx.update(model, state)
    return model


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def to_hf(
    model: Transformer,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write `model` as a Hugging Face directory (`config.json`, safetensors, index if sharded).

    Args:
      dtype: storage dtype of the written tensors; defaults to the model's `param_dtype`.
      max_shard_bytes: split into `model-0000i-of-0000n.safetensors` shards above this size.
    """
    cfg = model.cfg
    out_dtype = dtype or cfg.param_dtype
    np_dtype = _NP_DTYPES[out_dtype]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {}
    for hf_name, mpath, _, to_hf_fn in tensor_mapping(cfg):
        value = np.asarray(jax.device_get(flat[mpath].get_value()).astype(np.float32))
        tensors[hf_name] = np.ascontiguousarray(to_hf_fn(value)).astype(np_dtype)

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata=meta)
            weight_map.update({name: fname for name in shard})
        index = {
            "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
            "weight_map": weight_map,
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config = config_to_hf(cfg, torch_dtype=out_dtype)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    return path
