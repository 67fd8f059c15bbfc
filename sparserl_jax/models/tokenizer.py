"""Tokenizers: a local Hugging Face `tokenizer.json`, and a character tokenizer for synthetic tasks.

Both expose the same small surface: `encode`, `decode`, `vocab_size`, `bos_id`, `eos_ids`,
`pad_id`, and `max_tokens(num_chars)` (a bound from a text's length, or None).
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from pathlib import Path

from sparserl_jax.models.hf import CheckpointError, read_json


class CharTokenizer:
    """One id per character; ids 0..3 are <pad>, <bos>, <eos>, <unk>.

    The default alphabet covers digits, arithmetic, letters, space, newline and punctuation: what
    the synthetic verifiable tasks need.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    DEFAULT_ALPHABET = (
        string.digits + "+-*/=()<>.,:;?!' \n" + string.ascii_lowercase + string.ascii_uppercase
    )

    def __init__(self, alphabet: str | None = None):
        alphabet = self.DEFAULT_ALPHABET if alphabet is None else alphabet
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self._to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}
        self.pad_id, self.bos_id, self.unk_id = 0, 1, 3
        self.eos_ids: tuple[int, ...] = (2,)

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def vocab_size(self) -> int:
        return len(self.SPECIALS) + len(self.alphabet)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self._to_id.get(c, self.unk_id) for c in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def max_tokens(self, num_chars: int) -> int | None:
        """The most tokens (no BOS/EOS) a text of `num_chars` characters encodes to: one each."""
        return num_chars

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        out = []
        n = len(self.SPECIALS)
        for i in ids:
            i = int(i)
            if i < n:
                if not skip_special:
                    out.append(self.SPECIALS[i])
            elif i < self.vocab_size:
                out.append(self.alphabet[i - n])
            elif not skip_special:
                out.append("<unk>")
        return "".join(out)


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a local directory, with special ids from the checkpoint.

    Special ids are read, in order of precedence, from `config.json` (`bos_token_id`,
    `eos_token_id` (int or list), `pad_token_id`), then `generation_config.json`, then the token
    strings in `tokenizer_config.json`. A missing pad id falls back to the first eos id.
    A file that is corrupt or malformed, or an eos id that is no id of the tokenizer's
    vocabulary, is a `CheckpointError` naming it.
    """

    def __init__(self, tokenizer, *, bos_id: int | None, eos_ids: tuple[int, ...], pad_id: int):
        self._tok = tokenizer
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.pad_id = pad_id

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> HFTokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"{tok_file} not found (a local tokenizer.json is required)")
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception)
            raise CheckpointError(f"{tok_file}: not a readable tokenizer ({e})") from e

        def read(name: str) -> dict:
            f = path / name
            out = read_json(f) if f.exists() else {}
            if not isinstance(out, dict):
                raise CheckpointError(f"{f}: expected a JSON object, got {type(out).__name__}")
            return out

        config, gen, tcfg = (
            read("config.json"),
            read("generation_config.json"),
            read("tokenizer_config.json"),
        )

        def token_id(key: str) -> tuple[int | list[int] | None, str]:
            """The id(s) and the file they come from."""
            for src, name in ((config, "config.json"), (gen, "generation_config.json")):
                if src.get(f"{key}_token_id") is not None:
                    return src[f"{key}_token_id"], name
            token = tcfg.get(f"{key}_token")
            if isinstance(token, dict):
                token = token.get("content")
            found = tok.token_to_id(token) if isinstance(token, str) else None
            return found, "tokenizer_config.json"

        bos, _ = token_id("bos")
        eos, source = token_id("eos")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if not eos_ids:
            raise CheckpointError(
                f"{path}: no eos token id in config.json, generation_config.json or "
                "tokenizer_config.json"
            )
        n = tok.get_vocab_size(with_added_tokens=True)
        for i in eos_ids:  # a stop id the model never emits: completions that never end
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                raise CheckpointError(
                    f"{path}: eos_token_id {i!r} ({source}) is not an id of the tokenizer's "
                    f"vocabulary [0, {n})"
                )
        pad, _ = token_id("pad")
        pad = pad[0] if isinstance(pad, list) else pad
        return cls(
            tok,
            bos_id=bos if not isinstance(bos, list) else bos[0],
            eos_ids=eos_ids,
            pad_id=eos_ids[0] if pad is None else pad,
        )

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no bos token")
            ids = [self.bos_id] + ids
        return ids + ([self.eos_id] if add_eos else [])

    def max_tokens(self, num_chars: int) -> int | None:
        """None: a bound from the length alone is not claimed for an arbitrary tokenizer (a
        normalizer or template may add tokens), so callers measure each text."""
        return None

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)


Tokenizer = CharTokenizer | HFTokenizer
