"""A study's durable part, kept where its `runs/` is not: in the repository.

A study of many long runs outlives the machine it runs on (a session's `runs/` is gone on the
next machine; the SFT start alone is 90 minutes of CPU). `save_archive` copies out of a study's
output directory what the study needs to go on without redoing work, small enough to commit:

- `sft/`: the shared warm start with its step-0 checkpoint (the one checkpoint kept: every arm
  starts from its bits) and its `done.json`;
- every finished run under `signature/` and `runs/` (its `done.json` holds its config): its
  metrics, config and summary, without checkpoints (the report reads only these);
- `archive.json`: the output directory it came from (the runs' configs name their directories,
  so an archive restores into that directory only).

Runs not finished are left out: without their checkpoints they could not resume anyway.
`restore_archive` copies back what the output directory lacks (a finished run in the archive
replaces an unfinished one of the same name; nothing finished is overwritten). A finished run
restored without checkpoints cannot seed another (a held-out decode of its final weights not
done before): `benchmarks.repro_sparse_rl` says so in one line.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["ArchiveError", "restore_archive", "save_archive"]

_MANIFEST = "archive.json"
_SKIP = ("checkpoints", "sft_progress", "jax_cache")


class ArchiveError(ValueError):
    """An archive that does not belong to this output directory, or is not an archive."""


def _finished(run: Path) -> bool:
    return (run / "done.json").is_file()


def _copy_tree(src: Path, dst: Path, *, keep_step: int | None = None) -> None:
    """`src` into `dst` atomically (a temporary sibling renamed over it): every file but
    checkpoints, progress and caches, except checkpoint `keep_step` when given."""
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(*_SKIP))
    if keep_step is not None:
        shutil.copytree(src / "checkpoints" / str(keep_step), tmp / "checkpoints" / str(keep_step))
    old = dst.with_name(f".{dst.name}.old{os.getpid()}")
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)


def _same(run: Path, other: Path) -> bool:
    """Whether `other` holds the same finished run as `run` (the same `done.json`)."""
    return (
        _finished(other) and (run / "done.json").read_bytes() == (other / "done.json").read_bytes()
    )


def _runs(root: Path) -> list[Path]:
    """The finished runs of a study directory (or an archive) under `signature/` and `runs/`
    (not a copy `_copy_tree` left half-renamed by a crash, `.<name>.tmp<pid>`/`.old<pid>`)."""
    return sorted(
        p
        for group in ("signature", "runs")
        for p in (root / group).glob("*")
        if _finished(p) and not p.name.startswith(".")
    )


def _check_manifest(archive: Path, out: Path) -> None:
    manifest = archive / _MANIFEST
    if not manifest.is_file():
        raise ArchiveError(f"{archive}: not a study archive (no {_MANIFEST})")
    recorded = json.loads(manifest.read_text())["out"]
    if Path(recorded) != out:
        raise ArchiveError(
            f"{archive} is the archive of --out {recorded}, not of {out}: its runs' configs name "
            f"their directories under {recorded}; run with --out {recorded}"
        )


def save_archive(out: Path, archive: Path) -> list[str]:
    """Copy the finished part of the study in `out` into `archive` (module docstring); returns
    the runs written (relative names). Runs already in the archive are rewritten only when
    `out` holds them finished."""
    out, archive = Path(out), Path(archive)
    if (archive / _MANIFEST).exists():
        _check_manifest(archive, out)
    archive.mkdir(parents=True, exist_ok=True)
    (archive / _MANIFEST).write_text(json.dumps({"out": str(out)}) + "\n")
    written = []
    sft = out / "sft"
    if _finished(sft) and (sft / "checkpoints" / "0").is_dir() and not _same(sft, archive / "sft"):
        # A new SFT start voids every run of the old one (as the study does in `out`).
        for old in ("signature", "runs"):
            shutil.rmtree(archive / old, ignore_errors=True)
        _copy_tree(sft, archive / "sft", keep_step=0)
        written.append("sft")
    for run in _runs(out):
        rel = run.relative_to(out)
        dst = archive / rel
        if _same(run, dst):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        _copy_tree(run, dst)
        written.append(str(rel))
    return written


def restore_archive(archive: Path, out: Path) -> list[str]:
    """Copy into `out` what `archive` holds and `out` lacks finished; returns the runs copied."""
    archive, out = Path(archive), Path(out)
    _check_manifest(archive, out)
    if _finished(out / "sft") and not _same(out / "sft", archive / "sft"):
        raise ArchiveError(
            f"{out} holds another SFT start than the archive {archive}: its runs descend from "
            "the archive's; move one of them aside"
        )
    copied = []
    for src in ([archive / "sft"] if _finished(archive / "sft") else []) + _runs(archive):
        rel = src.relative_to(archive)
        if _finished(out / rel):
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        _copy_tree(src, out / rel, keep_step=0 if rel == Path("sft") else None)
        copied.append(str(rel))
    return copied
