"""Where a run's files live: a local directory, or a URL every host reaches (`gs://bucket/run/`,
`s3://bucket/run/`), one home for the run directory's reads and writes.

A local `run_dir` behaves as it always has (files appended, fsynced, replaced by rename). A URL
is reached through `etils.epath` (gcsfs or s3fs underneath; Orbax reaches it the same way), and
object stores differ from a file system in three ways this module absorbs:
- no append: a `JsonlFile` keeps its rows in memory (its one writer, the trainer's leader, is
  fenced) and `flush()` reads the object and writes it back whole with them in one PUT, which
  readers see whole or not at all. Rows reach the store at each flush (the trainer flushes
  once per step and before every checkpoint, so the rows a checkpoint counts are stored before
  it); GCS allows about one write per second to one object, which a flush per step respects.
  Each flush rewrites the file: fine for the ledger and metrics of ~10^4 steps.
- no rename: `write_text` is one PUT (already atomic), `move_tree` copies then deletes.
- no directories: `mkdir` is a no-op there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from etils import epath

__all__ = ["JsonlFile", "is_url", "move_tree", "remove_tree", "run_path", "write_text"]

# The URL schemes a run directory may use, and the package `etils.epath` reaches each through.
SCHEMES = {"gs": "gcsfs", "s3": "s3fs"}


def is_url(run_dir: str | os.PathLike) -> bool:
    """Whether `run_dir` names an object store (`gs://...`, `s3://...`) rather than a path."""
    return bool(re.match(r"^[a-z][a-z0-9+.-]*://", str(run_dir)))


def run_path(run_dir: str | os.PathLike) -> Path | epath.Path:
    """`run_dir` as a path object: a local `Path` (absolute) or an `epath.Path` for a URL.
    Raises ValueError (one line) for a scheme no backend reaches or a backend not installed."""
    if not is_url(run_dir):
        return Path(run_dir).absolute()
    scheme = str(run_dir).split("://", 1)[0]
    if scheme == "file":
        return Path(str(run_dir)[len("file://") :]).absolute()
    if scheme not in SCHEMES:
        raise ValueError(
            f"run_dir {str(run_dir)!r}: a run directory is a local path, gs://bucket/dir or "
            f"s3://bucket/dir, not {scheme}://"
        )
    if importlib.util.find_spec(SCHEMES[scheme]) is None:
        extra = "gcs" if scheme == "gs" else "s3"
        raise ValueError(
            f"run_dir {str(run_dir)!r} needs the {SCHEMES[scheme]} package: "
            f"pip install 'sparserl-jax[{extra}]'"
        )
    return epath.Path(str(run_dir).rstrip("/"))


def write_text(path: Path | epath.Path, text: str) -> None:
    """Replace `path` with `text` atomically: a reader sees the old or the new text, never a
    part (locally a temp file, fsynced, renamed over it; on an object store one PUT)."""
    if not isinstance(path, Path):
        path.write_text(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_tree(path: Path | epath.Path) -> None:
    """Delete `path` and everything under it; nothing there is fine."""
    if isinstance(path, Path):
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.rmtree()


def move_tree(src: Path | epath.Path, dst: Path | epath.Path) -> None:
    """Move the tree `src` to `dst` (an object store: copy every object, then delete)."""
    if isinstance(src, Path):
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dst))
        return
    for f in list(_files(src)):
        f.copy(dst / f.relative_to(src))
    src.rmtree()


def _files(path: epath.Path):
    """Every object under `path` (listed level by level: a store has no recursive glob)."""
    for child in path.iterdir():
        if child.is_dir():
            yield from _files(child)
        else:
            yield child


class JsonlFile:
    """A JSON-lines file the run appends rows to (the ledger, the metrics).

    Local: each `append` is written, flushed and fsynced at once. On an object store rows are
    held until `flush()` (module docstring). `rows()` skips a torn last line (a kill mid-write
    of a local file) and names any other line that is not JSON.
    """

    def __init__(self, path: Path | epath.Path):
        self.path = path
        self.local = isinstance(path, Path)
        self._text: str | None = None  # an object store's content, as last flushed
        self._held: list[str] = []  # rows appended since, not yet flushed

    def _read(self) -> str:
        if not self.local and self._text is not None:
            return self._text
        text = self.path.read_text() if self.path.exists() else ""
        if not self.local:
            self._text = text
        return text

    def rows(self) -> list[dict[str, Any]]:
        """The complete rows, those held for the next flush included."""
        out = []
        lines = self._read().splitlines(keepends=True) + self._held
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            if not line.endswith("\n"):
                break
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    break
                raise ValueError(f"{self.path}: line {i + 1} is not JSON: {line[:80]!r}") from None
        return out

    def append(self, rows: list[dict[str, Any]]) -> None:
        lines = [json.dumps(r) + "\n" for r in rows]
        if not self.local:
            self._held.extend(lines)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())

    def flush(self) -> None:
        """Store the rows appended since the last flush (a no-op locally: they are). The
        object is read again first, so a writer that should have been the only one but was
        not (an old trainer woken after its successor started) adds its rows after the
        other's instead of putting back the content it last saw (for the ledger, rows that
        then do not count); two flushes whose read and write overlap still lose one's rows:
        an object store has no append."""
        if self.local or not self._held:
            return
        self._text = None
        text = self._read() + "".join(self._held)
        write_text(self.path, text)
        self._text, self._held = text, []

    def replace(self, rows: list[dict[str, Any]]) -> None:
        """Make the file hold exactly `rows`, atomically (a resume cutting back what it redoes;
        a missing file stays missing when `rows` is empty)."""
        self._held = []
        if not rows and not self.path.exists():
            return
        text = "".join(json.dumps(r) + "\n" for r in rows)
        write_text(self.path, text)
        if not self.local:
            self._text = text
