"""GSM8K-style question/answer files: JSONL or Parquet, with malformed rows counted or refused.

A row needs a non-empty string under `question_field` and a numeric gold answer under
`answer_field`: a number, a string that is one number (`1,234`, `-3.5`), or GSM8K's reasoning text
ending in `#### 42`. Rows that fail are skipped and counted by reason in a `LoadReport`:

  bad_json            the JSONL line does not parse
  not_an_object       the JSONL line is not a JSON object
  missing_field       the question or answer field is absent (or null)
  bad_question        the question is not a non-empty string
  non_numeric_answer  no number could be read from the answer

With `strict=True` the first such row raises `DataError` naming `file:line` (JSONL, 1-based line
numbers; blank lines are skipped but counted as lines) or `file:row N` (Parquet, 1-based).

Parquet needs `pyarrow`; without it reading a Parquet file raises an ImportError saying so.
"""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sparserl_jax.data.config import DataConfig
from sparserl_jax.data.extract import extract_gold_number, format_number
from sparserl_jax.data.records import DataError, Example, LoadReport

log = logging.getLogger(__name__)

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")


def expand_paths(path: str) -> list[Path]:
    """A file, or the sorted files matching a glob; FileNotFoundError when nothing matches."""
    if any(c in path for c in "*?["):
        paths = sorted(Path(p) for p in glob.glob(path))
        if not paths:
            raise FileNotFoundError(f"data path {path!r}: the glob matches no file")
        return paths
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data path {path!r}: no such file")
    return [p]


def file_format(path: Path, configured: str) -> str:
    if configured != "auto":
        return configured
    name = path.name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    raise DataError(
        f"{path}: cannot tell the format from the extension; expected one of "
        f"{_JSONL_SUFFIXES + _PARQUET_SUFFIXES} or set data.file_format to 'jsonl' or 'parquet'"
    )


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any, tuple[str, str] | None]]:
    """(where, row, None) or (where, None, (reason, detail)) per non-blank line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield where, None, ("bad_json", str(e))
                continue
            if not isinstance(row, dict):
                yield where, None, ("not_an_object", f"got {type(row).__name__}")
                continue
            yield where, row, None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any, tuple[str, str] | None]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: `pip install pyarrow` "
            "(or convert the file to JSONL)"
        ) from e
    table = pq.read_table(path)
    for i, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}:row {i}", row, None


def load_file_examples(
    cfg: DataConfig, path: str, *, split: str = "train"
) -> tuple[list[Example], LoadReport]:
    """All valid rows of the file(s) at `path` as `Example`s, and the report of what was skipped.

    Raises `DataError` on the first malformed row when `cfg.strict`, and whenever no row is valid.
    """
    examples: list[Example] = []
    report = LoadReport()
    for p in expand_paths(path):
        fmt = file_format(p, cfg.file_format)
        rows = _jsonl_rows(p) if fmt == "jsonl" else _parquet_rows(p)
        for where, row, error in rows:
            report.rows += 1
            if error is not None:
                reason, detail = error
            else:
                reason, detail, example = _to_example(cfg, row, where, len(examples), split)
                if example is not None:
                    examples.append(example)
                    report.kept += 1
                    continue
            if cfg.strict:
                raise DataError(f"{where}: {reason}: {detail} (data.strict is on)")
            report.add_error(reason, where, detail)
    if report.num_malformed:
        log.warning("data %s (%s): %s", path, split, report.summary())
    if not examples:
        raise DataError(f"data path {path!r} has no valid rows: {report.summary()}")
    return examples, report


def _to_example(
    cfg: DataConfig, row: dict, where: str, index: int, split: str
) -> tuple[str, str, Example | None]:
    q_field, a_field = cfg.question_field, cfg.answer_field
    if row.get(q_field) is None:
        return "missing_field", f"no {q_field!r} (fields: {sorted(row)[:8]})", None
    if row.get(a_field) is None:
        return "missing_field", f"no {a_field!r} (fields: {sorted(row)[:8]})", None
    question, raw_answer = row[q_field], row[a_field]
    if not isinstance(question, str) or not question.strip():
        return "bad_question", f"{q_field!r} is {question!r:.60}, not a non-empty string", None
    gold = extract_gold_number(raw_answer)
    if gold is None:
        return "non_numeric_answer", f"{a_field!r} is {raw_answer!r:.60}", None
    # GSM8K-style reasoning (`... #### 42`) doubles as an SFT completion.
    completion = raw_answer if isinstance(raw_answer, str) and "####" in raw_answer else None
    example = Example(
        prompt=cfg.prompt_template.format(question=question),
        answer=format_number(gold),
        task="gsm8k",
        source=where,
        index=index,
        completion=completion,
    )
    return "", "", example
