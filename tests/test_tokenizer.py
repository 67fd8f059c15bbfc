"""Character tokenizer and local Hugging Face tokenizer.json loading."""

import json

import pytest

from sparserl_jax.models.tokenizer import CharTokenizer, HFTokenizer


def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    text = "12+34=46\nAnswer: 46."
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text
    assert tok.decode([tok.pad_id, *tok.encode("7")], skip_special=False) == "<pad>7"
    assert tok.encode("é") == [tok.unk_id]
    assert max(tok.encode(CharTokenizer.DEFAULT_ALPHABET)) == tok.vocab_size - 1


def _write_hf_tokenizer(path, *, config=None, tokenizer_config=None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def test_hf_tokenizer_ids_from_config(tmp_path):
    path = _write_hf_tokenizer(
        tmp_path / "a", config={"bos_token_id": 0, "eos_token_id": [1, 2], "pad_token_id": None}
    )
    tok = HFTokenizer.from_dir(path)
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (0, (1, 2), 1)
    assert tok.encode("hello world", add_bos=True, add_eos=True) == [0, 3, 4, 1]
    assert tok.decode([3, 4]) == "hello world"
    assert tok.vocab_size == 6


def test_hf_tokenizer_ids_from_token_strings(tmp_path):
    path = _write_hf_tokenizer(
        tmp_path / "b",
        tokenizer_config={"eos_token": "</s>", "pad_token": {"content": "<pad>"}},
    )
    tok = HFTokenizer.from_dir(path)
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (None, (1,), 2)
    with pytest.raises(ValueError, match="no bos token"):
        tok.encode("hello", add_bos=True)


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    path = _write_hf_tokenizer(tmp_path / "c")
    with pytest.raises(ValueError, match="no eos token id"):
        HFTokenizer.from_dir(path)
