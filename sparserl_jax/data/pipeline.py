"""grain pipelines: examples -> (shard) -> shuffle -> repeat -> batch, with checkpointable state.

    it = prompt_iterator(cfg)                 # a grain DatasetIterator of PromptBatch
    batch = next(it)                          # batch.prompts, batch.answers, batch.examples
    state = it.get_state()                    # a small JSON-able dict (save it in the checkpoint)
    it = prompt_iterator(cfg, state=state)    # resumes: the next batches are exactly the same

Determinism: a synthetic example is a pure function of `(seed, split, index)`; a file's examples
are its valid rows in order; the order of rows is grain's index shuffle seeded by `cfg.seed`,
reshuffled every epoch. Batches therefore depend only on the config and the position, never on
threads or timing, which is what makes resume-equals-uninterrupted hold exactly.

Multi-host: each process passes its `shard_index`/`shard_count` (e.g. `jax.process_index()` and
`jax.process_count()`) and reads the rows `shard_index::shard_count`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from jaxtyping import Bool, Int

from sparserl_jax.data.arithmetic import longest_arithmetic_prompt, make_arithmetic_example
from sparserl_jax.data.config import DataConfig
from sparserl_jax.data.countdown import longest_countdown_prompt, make_countdown_example
from sparserl_jax.data.files import load_file_examples
from sparserl_jax.data.records import DataError, Example, LoadReport, PromptBatch, make_batch

SPLITS: tuple[str, ...] = ("train", "eval")
LISTED = 3  # long prompts named in the log line

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PromptLimit:
    """The longest prompt the rollout takes (`rollout.max_prompt_len`), in `tokenizer`'s tokens
    (as `encode_prompts` counts them: with the BOS when `add_bos`)."""

    tokenizer: Any
    max_len: int
    add_bos: bool = True

    def length(self, example: Example) -> int:
        return len(self.tokenizer.encode(example.prompt, add_bos=self.add_bos))

    def fits(self, num_chars: int | None) -> bool:
        """Whether every prompt of at most `num_chars` characters (None: unknown) surely fits,
        from the tokenizer's bound alone (`max_tokens`; False when it has none)."""
        max_tokens = getattr(self.tokenizer, "max_tokens", None)
        bound = None if num_chars is None or max_tokens is None else max_tokens(num_chars)
        return bound is not None and bound + int(self.add_bos) <= self.max_len


def _long_prompts(long: list[tuple[Example, int]], read: int, cfg, limit, split: str) -> None:
    """Refuse (`data.long_prompts=error`) or log in one line the prompts of `long` (example,
    tokens), found among `read` examples of `split`."""
    if not long:
        return
    first, n = long[0]
    if cfg.long_prompts == "error":
        raise DataError(
            f"{split} prompt {first.source} ({first.prompt[:40]!r}...) is {n} tokens, more "
            f"than rollout.max_prompt_len={limit.max_len}; raise rollout.max_prompt_len or set "
            "data.long_prompts=skip to leave such prompts out"
        )
    log.warning(
        "data (%s): skipped %d of %d prompts longer than rollout.max_prompt_len=%d tokens "
        "(data.long_prompts=skip); first: %s",
        split,
        len(long),
        read,
        limit.max_len,
        "; ".join(f"{e.source} ({k} tokens)" for e, k in long[:LISTED]),
    )


def _fitting(ds: grain.MapDataset, cfg: DataConfig, limit: PromptLimit, split: str):
    """`ds` without the examples whose prompt is longer than `limit` (see `_long_prompts`).
    Reads every prompt once (`error` stops at the first long one); the same `ds` back when all
    fit, so batches and iterator states are those of the unfiltered pipeline."""
    long: list[tuple[Example, int]] = []
    keep: list[int] = []
    for i in range(len(ds)):
        n = limit.length(example := ds[i])
        if n <= limit.max_len:
            keep.append(i)
        else:
            long.append((example, n))
            if cfg.long_prompts == "error":
                break
    _long_prompts(long, len(ds), cfg, limit, split)
    if not long:
        return ds
    if not keep:
        raise DataError(
            f"every {split} prompt is longer than rollout.max_prompt_len={limit.max_len} tokens"
        )
    base = ds
    return grain.MapDataset.source(keep).map(lambda i: base[int(i)])


def example_source(
    cfg: DataConfig, *, split: str = "train", limit: PromptLimit | None = None
) -> tuple[grain.MapDataset, LoadReport]:
    """All examples of `split` as a random-access `grain.MapDataset[Example]`, and the load
    report (empty for the generated tasks). With `limit`, prompts longer than it are left out
    or refused (`data.long_prompts`); every prompt is read for that, unless the task's longest
    possible prompt surely fits (a generated task and a tokenizer with `max_tokens`)."""
    ds, report = _all_examples(cfg, split)
    if limit is None or limit.fits(_longest_prompt(cfg)):
        return ds, report  # a generated task whose longest possible prompt fits: nothing to read
    return _fitting(ds, cfg, limit, split), report


def _longest_prompt(cfg: DataConfig) -> int | None:
    """An upper bound on the characters of a generated task's prompts (None for files)."""
    if cfg.task == "arithmetic":
        return longest_arithmetic_prompt(cfg.arithmetic)
    if cfg.task == "countdown":
        return longest_countdown_prompt(cfg.countdown)
    return None


def _all_examples(cfg: DataConfig, split: str) -> tuple[grain.MapDataset, LoadReport]:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} unknown; expected one of {SPLITS}")
    if cfg.task == "arithmetic":
        make = functools.partial(
            make_arithmetic_example, cfg.arithmetic, seed=cfg.seed, split=split
        )
        n = cfg.arithmetic.num_examples
    elif cfg.task == "countdown":
        make = functools.partial(make_countdown_example, cfg.countdown, seed=cfg.seed, split=split)
        n = cfg.countdown.num_examples
    else:
        path = cfg.path if split == "train" else cfg.eval_path
        if path is None:
            raise DataError(f"split 'eval' of task {cfg.task!r} needs data.eval_path")
        examples, report = load_file_examples(cfg, path, split=split)
        return grain.MapDataset.source(examples), report
    return grain.MapDataset.range(n).map(lambda i: make(index=int(i))), LoadReport()


def prompt_dataset(
    cfg: DataConfig,
    *,
    split: str = "train",
    shard_index: int = 0,
    shard_count: int = 1,
    limit: PromptLimit | None = None,
) -> tuple[grain.IterDataset, LoadReport]:
    """The batched pipeline (`grain.IterDataset[PromptBatch]`) and the source's load report;
    `limit`: see `example_source`."""
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    ds, report = example_source(cfg, split=split, limit=limit)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    if len(ds) == 0:
        raise DataError(f"shard {shard_index}/{shard_count} of the {split} data is empty")
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat(cfg.num_epochs)
    ds = ds.batch(cfg.batch_size, drop_remainder=cfg.drop_remainder, batch_fn=make_batch)
    if len(ds) == 0:
        raise DataError(
            f"{split} data has fewer rows ({report.kept or 'n/a'}) than one batch of "
            f"{cfg.batch_size} with drop_remainder on"
        )
    options = grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=4)
    return ds.to_iter_dataset(options), report


def prompt_iterator(
    cfg: DataConfig,
    *,
    split: str = "train",
    state: Mapping[str, Any] | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    limit: PromptLimit | None = None,
) -> grain.DatasetIterator:
    """An iterator of `PromptBatch`; `get_state()` / `set_state()` checkpoint its position.

    `state` (from an earlier `get_state()`) resumes where that iterator stood; `limit`: see
    `example_source`.
    """
    ds, _ = prompt_dataset(
        cfg, split=split, shard_index=shard_index, shard_count=shard_count, limit=limit
    )
    return resume_iterator(ds, state)


def iterator_state(it: grain.DatasetIterator) -> dict:
    """`it.get_state()` in plain JSON types (numpy scalars become Python numbers), for a
    checkpoint's metadata; `resume_iterator` takes it back."""

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x.item() if isinstance(x, np.generic) else x

    return plain(it.get_state())


def resume_iterator(ds: grain.IterDataset, state: Mapping[str, Any] | None = None):
    """An iterator over `ds` (from `prompt_dataset`) at `state` (None: the beginning)."""
    it = iter(ds)
    if state is not None:
        it.set_state(dict(state))
    return it


def eval_examples(
    cfg: DataConfig, num: int | None = None, *, limit: PromptLimit | None = None
) -> list[Example]:
    """The first `num` (all when None) examples of the eval split, unshuffled: a fixed held-out
    set for before/after reward numbers. With `limit`, longer prompts are passed over (or
    refused, `data.long_prompts`); only the rows up to the `num`-th that fits are read."""
    if num == 0:  # no held-out set: the eval split is not read
        return []
    ds, _ = example_source(cfg, split="eval")
    n = len(ds) if num is None else min(num, len(ds))
    if limit is None:
        return [ds[i] for i in range(n)]
    out, long, read = [], [], 0
    for read in range(1, len(ds) + 1):
        example = ds[read - 1]
        if (k := limit.length(example)) <= limit.max_len:
            out.append(example)
        else:
            long.append((example, k))
            if cfg.long_prompts == "error":
                break
        if len(out) == n:
            break
    _long_prompts(long, read, cfg, limit, "eval")
    return out


def sft_pairs(cfg: DataConfig, num: int, *, split: str = "train") -> list[tuple[str, str]]:
    """`num` (prompt, ideal completion) pairs, unshuffled, for an SFT warm start.

    Arithmetic completions carry the scratchpad; countdown's give a solution; GSM8K rows give
    their `#### 42` reasoning text (rows without one are skipped).
    """
    ds, _ = example_source(cfg, split=split)
    pairs: list[tuple[str, str]] = []
    for i in range(len(ds)):
        if len(pairs) == num:
            break
        ex = ds[i]
        if ex.completion is not None:
            pairs.append((ex.prompt, ex.completion))
    if len(pairs) < num:
        raise DataError(f"only {len(pairs)} {split} examples have an SFT completion, {num} asked")
    return pairs


def encode_prompts(
    batch: PromptBatch | Sequence[Example],
    tokenizer,
    *,
    add_bos: bool = True,
    max_len: int | None = None,
) -> list[list[int]]:
    """Token ids of each prompt (as the rollout engine takes them).

    With `max_len` (the rollout's `max_prompt_len`), a longer prompt is a `DataError` naming its
    index in the batch, its source and the setting.
    """
    examples = batch.examples if isinstance(batch, PromptBatch) else batch
    out = []
    for i, e in enumerate(examples):
        ids = tokenizer.encode(e.prompt, add_bos=add_bos)
        if max_len is not None and len(ids) > max_len:
            raise DataError(
                f"prompt {i} of the batch ({e.source}, {e.prompt[:40]!r}...) is {len(ids)} "
                f"tokens, more than rollout.max_prompt_len={max_len}; raise "
                "rollout.max_prompt_len or drop the long rows from the data"
            )
        out.append(ids)
    return out


@dataclasses.dataclass(frozen=True)
class SFTBatch:
    """Right-padded `prompt + completion + eos` sequences.

    `loss_mask_bt[b, t]` is True where `tokens_bt[b, t]` is a completion token (or the eos) that
    the model should predict: train on logits `[:, :-1]` against targets `tokens_bt[:, 1:]` with
    `loss_mask_bt[:, 1:]`.
    """

    tokens_bt: Int[np.ndarray, "B T"]
    loss_mask_bt: Bool[np.ndarray, "B T"]
    lengths_b: Int[np.ndarray, " B"]


def sft_batch(
    pairs: Sequence[tuple[str, str]],
    tokenizer,
    *,
    max_len: int,
    add_bos: bool = True,
    truncate: bool = False,
) -> SFTBatch:
    """Tokenise (prompt, completion) pairs into a `[B, max_len]` SFT batch.

    A sequence longer than `max_len` is an error naming it unless `truncate`, which cuts it (and
    so its eos: the model then never sees that sequence end).
    """
    tokens = np.full((len(pairs), max_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(pairs), max_len), bool)
    lengths = np.zeros(len(pairs), np.int32)
    for b, (prompt, completion) in enumerate(pairs):
        p = tokenizer.encode(prompt, add_bos=add_bos)
        c = tokenizer.encode(completion) + [tokenizer.eos_ids[0]]
        seq = p + c
        if len(seq) > max_len and not truncate:
            raise ValueError(
                f"SFT pair {b} ({prompt!r}) is {len(seq)} tokens, more than max_len={max_len}"
            )
        seq = seq[:max_len]
        tokens[b, : len(seq)] = seq
        mask[b, len(p) : len(seq)] = True
        lengths[b] = len(seq)
    return SFTBatch(tokens, mask, lengths)
