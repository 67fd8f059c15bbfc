"""The README's Python examples run as written.

Each ```python block is read from README.md and executed. What a block leaves to the reader (a
model, a batch, a loss) is supplied by a small namespace of test doubles; where a block names a
path on the user's machine or a production size, the test swaps in a temporary path or a smaller
number through an explicit replacement table, and checks the replaced text is really in the block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparserl_jax.models import CharTokenizer, to_hf
from sparserl_jax.testing import tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def _block(first_import: str) -> str:
    """The README block that contains `first_import` (exactly one)."""
    found = [b for b in BLOCKS if first_import in b]
    assert len(found) == 1, f"{len(found)} README blocks contain {first_import!r}"
    return found[0]


def _run(code: str, namespace: dict, replace: dict[str, str] | None = None) -> dict:
    for old, new in (replace or {}).items():
        assert old in code, f"the README block no longer contains {old!r}"
        code = code.replace(old, new)
    exec(compile(code, str(README), "exec"), namespace)
    return namespace


def test_every_block_is_covered():
    # A new README block needs a test here.
    assert len(BLOCKS) == 8


def _rl_batch(vocab: int, rows: int, width: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, width), bool)
    mask[:, width // 2 :] = True
    return {
        "tokens_bt": jnp.asarray(rng.integers(0, vocab, (rows, width)), jnp.int32),
        "mask_bt": jnp.asarray(mask),
        "sampler_logp_bt": jnp.asarray(np.where(mask, -rng.uniform(0.5, 3.0, mask.shape), 0.0)),
        "rewards_b": jnp.asarray(rng.integers(0, 2, rows), jnp.float32),
    }


@pytest.mark.slow
def test_training_from_python(tmp_path):
    code = _block("from sparserl_jax.train import train")
    ns = _run(
        code,
        {},
        {
            "configs/demo.yaml": "configs/tiny.yaml",
            '"train.steps=10"': '"train.steps=2", "data.batch_size=4"',  # 8 rows: 8 devices
            "runs/try": str(tmp_path / "try"),
        },
    )
    assert ns["summary"]["end_step"] == 2


def test_load_checkpoint_and_generate(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    ckpt = to_hf(tiny_model(), tmp_path / "ckpt")
    words = ["<s>", "</s>", "The", "capital", "of", "France", "is", "12", "*", "7", "=", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    ns = _run(
        _block("from sparserl_jax.models import from_hf"),
        {},
        {"/ckpt/Qwen2.5-0.5B-Instruct": str(ckpt), "/tmp/exported": str(tmp_path / "out")},
    )
    assert ns["out"].completion_lens[0] >= 1
    assert (tmp_path / "out" / "config.json").exists()


@pytest.mark.slow
def test_sharded_model():
    # The block's 57M-parameter model costs most of a minute on 8 fake CPU devices; the mesh,
    # the sharding and the three jitted calls are the same at 2 layers and a 512 vocab.
    ns = _run(
        _block("from sparserl_jax.models import ModelConfig, Transformer, DenseKVCache"),
        {},
        {"vocab_size=32000": "vocab_size=512", "num_layers=8": "num_layers=2"},
    )
    assert ns["logits"].shape == (8, 128, 512)
    assert ns["step_logits"].shape[0] == 8


def test_rl_math_in_your_own_loop():
    vocab, width = 11, 12
    data = _rl_batch(vocab, rows=8, width=width)
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "embed": 0.1 * jax.random.normal(keys[0], (vocab, 16)),
        "head": 0.1 * jax.random.normal(keys[1], (16, vocab)),
    }
    ns = _run(
        _block("lm_head_grad_energy,"),
        {"params": params, "apply_fn": lambda p, t: p["embed"][t] @ p["head"], **data},
    )
    assert 1 <= int(ns["k"]) <= 4
    assert np.isfinite(float(ns["metrics"].mismatch_kl))


def test_learner_on_a_mesh():
    model = tiny_model()
    ns = _run(_block("    Learner,\n    LearnerConfig,"), {"model": model, **_rl_batch(67, 16, 10)})
    assert 1 <= len(ns["history"]) <= 4


def test_rollout_engine():
    model = tiny_model()
    tok = CharTokenizer()
    params = nnx.to_pure_dict(nnx.state(model))
    ns = _run(
        _block("from sparserl_jax.rollout import RolloutConfig, RolloutEngine, dense_logprobs"),
        {
            "model": model,
            "tok": tok,
            "prompts": [tok.encode("1+2=", add_bos=True), tok.encode("7*6=", add_bos=True)],
            "published_params": params,
        },
        {"num_slots=64": "num_slots=4", "max_new_tokens=2048": "max_new_tokens=24"},
    )
    assert ns["tokens_bt"].shape[0] == 16
    assert (ns["result"].weight_version == 3).all()


def test_weight_sync():
    rng = np.random.default_rng(0)
    master = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)}

    def train_step(m):
        return jax.tree.map(lambda x: x + 1e-2 * jnp.sign(x), m)

    ns = _run(
        _block("from sparserl_jax.sync import InProcessTransport"),
        {"master": master, "train_step": train_step},
    )
    assert ns["receiver"].version == 3


def test_pulse_loco():
    def loss_fn(params, batch):
        return jnp.mean((params["w"][None] - batch) ** 2)  # batch: [B, 8]

    def batches_for(k, r):
        return jnp.full((10, 2, 8), float(k + r), jnp.float32)  # [H, B, ...]

    ns = _run(
        _block("from sparserl_jax.sync import LoCoConfig, LoCoTrainer"),
        {
            "loss_fn": loss_fn,
            "params": {"w": jnp.zeros((8,), jnp.float32)},
            "rounds": 2,
            "batches_for": batches_for,
        },
    )
    assert ns["params"]["w"].shape == (8,)
