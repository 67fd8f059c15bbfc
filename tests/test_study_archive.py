"""`benchmarks/study_archive.py` on a study directory laid out by hand: what is kept, what is
left out, and the SFT start that voids the runs of another."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.study_archive import ArchiveError, restore_archive, save_archive  # noqa: E402


def _run(root: Path, rel: str, *, done: str | None, steps=(0,)) -> None:
    run = root / rel
    for s in steps:
        (run / "checkpoints" / str(s)).mkdir(parents=True)
        (run / "checkpoints" / str(s) / "state").write_bytes(b"x" * 10)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    if done is not None:
        (run / "done.json").write_text(json.dumps({"config": {}, "summary": {"id": done}}))


def _study(root: Path, sft="a") -> Path:
    _run(root, "sft", done=sft)
    (root / "sft" / "sft_progress").mkdir()
    _run(root, "signature/b8", done="sig")
    _run(root, "runs/dense_s0", done="d0", steps=(0, 10))
    _run(root, "runs/corrected_s0_b8", done=None, steps=(0, 10))  # cut off: left out
    (root / "jax_cache").mkdir()
    return root


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_archive_keeps_the_sft_start_and_finished_runs_without_checkpoints(tmp_path):
    out, archive = _study(tmp_path / "out"), tmp_path / "archive"
    assert save_archive(out, archive) == ["sft", "runs/dense_s0", "signature/b8"]
    assert _files(archive) == [
        "archive.json",
        "runs/dense_s0/done.json",
        "runs/dense_s0/metrics.jsonl",
        "sft/checkpoints/0/state",
        "sft/done.json",
        "sft/metrics.jsonl",
        "signature/b8/done.json",
        "signature/b8/metrics.jsonl",
    ]
    assert save_archive(out, archive) == []
    # A copy a crash left half-renamed (a finished run under a dot name) is no run.
    _run(out, "runs/.dense_s1.tmp99", done="d1")
    assert save_archive(out, archive) == []
    # On a machine without `out`: everything back but the left-out run; nothing finished in
    # `out` is overwritten, an unfinished run of the same name is replaced.
    out.rename(tmp_path / "old")
    _run(out, "runs/dense_s0", done=None, steps=(0,))
    assert restore_archive(archive, out) == ["sft", "runs/dense_s0", "signature/b8"]
    assert not (out / "runs" / "dense_s0" / "checkpoints").exists()
    assert (out / "sft" / "checkpoints" / "0" / "state").read_bytes() == b"x" * 10
    assert restore_archive(archive, out) == []


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"
)
def test_an_archive_in_the_repository_is_committed_whole(tmp_path):
    """An archive kept under `docs/studies/` (as the README's studies are) must not lose a
    file to `.gitignore`: a `runs/` pattern that matched at any depth once left every archived
    arm out of the commits, so the next machine had the SFT start and the signature only."""
    out, archive = _study(tmp_path / "out"), tmp_path / "archive"
    save_archive(out, archive)
    paths = [f"docs/studies/any_study/{f}" for f in _files(archive)]
    check = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(paths),
        capture_output=True,
        text=True,
    )
    assert check.returncode == 1, f"git ignores: {check.stdout.split()}"  # 1: none ignored


def test_a_new_sft_start_voids_the_archived_runs_and_refuses_a_mixed_restore(tmp_path):
    out, archive = _study(tmp_path / "out"), tmp_path / "archive"
    save_archive(out, archive)
    (out / "sft" / "done.json").write_text(json.dumps({"config": {}, "summary": {"id": "b"}}))
    for gone in ("signature", "runs"):
        for p in sorted((out / gone).rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    assert save_archive(out, archive) == ["sft"]
    assert not (archive / "runs").exists() and not (archive / "signature").exists()
    other = _study(tmp_path / "other", sft="c")
    with pytest.raises(ArchiveError, match="archive of --out"):
        save_archive(other, archive)
    (out / "sft" / "done.json").write_text(json.dumps({"config": {}, "summary": {"id": "c"}}))
    with pytest.raises(ArchiveError, match="another SFT start"):
        restore_archive(archive, out)
    with pytest.raises(ArchiveError, match="not a study archive"):
        restore_archive(tmp_path / "other", tmp_path / "other")
