"""Build the objects a config names: the (sharded) model and the tokenizer."""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh

from sparserl_jax.config import ModelSpec, TokenizerConfig
from sparserl_jax.models.hf import from_hf
from sparserl_jax.models.tokenizer import CharTokenizer, HFTokenizer
from sparserl_jax.models.transformer import Transformer
from sparserl_jax.parallel.sharding import create_sharded, shard_model


def build_model(spec: ModelSpec, mesh: Mesh | None = None) -> Transformer:
    """A random model from `spec.arch` or a local HF checkpoint, laid out on `mesh` if given."""
    if spec.hf_dir is not None:
        model = from_hf(spec.hf_dir, **spec.settings())  # the section's attention too
        return shard_model(model, mesh) if mesh is not None else model
    cfg = spec.model_config()

    def make():
        return Transformer(cfg, rngs=nnx.Rngs(spec.seed))

    return create_sharded(make, mesh) if mesh is not None else make()


def build_tokenizer(cfg: TokenizerConfig, spec: ModelSpec) -> CharTokenizer | HFTokenizer:
    """The tokenizer; checks that its ids fit the model's vocabulary."""
    if cfg.kind == "char":
        tok = CharTokenizer()
    else:
        path = cfg.path or spec.hf_dir
        if path is None:
            raise ValueError("tokenizer.kind=hf needs tokenizer.path or model.hf_dir")
        tok = HFTokenizer.from_dir(path)
    vocab = spec.model_config().vocab_size
    if tok.vocab_size > vocab:
        raise ValueError(
            f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is {vocab}"
        )
    return tok
