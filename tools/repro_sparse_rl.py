"""Sparse-RL on our stack: dense vs naive sparse vs corrected (vs TIS only, vs the adaptive budget,
vs eviction replay) rollouts from one shared SFT start (docs/reproductions.md).

    python tools/repro_sparse_rl.py                       # configs/repro_sparse_rl.yaml, all arms,
                                                          # budgets L/8, L/4, seeds 0 1 2
    python tools/repro_sparse_rl.py --budgets 36 --seeds 0 --steps 12 --arms dense naive corrected
    python tools/repro_sparse_rl.py --quick               # configs/tiny.yaml, 2 steps, dense,
                                                          # corrected and replay, budget L/4,
                                                          # seed 0 (CI smoke)
    python tools/repro_sparse_rl.py --signature-only      # the SFT start decoded sparse vs dense

The study runs in pieces: run the same command again (or with more seeds) and it keeps every
finished run (its `done.json` holds the same config) and resumes a run cut off mid-way from its
newest checkpoint. `--finished-only` reports what is on disk without starting or resuming
anything (runs not finished are left out, one line each), e.g. while other pieces still run.

The signature at L/4 is checked before any arm runs (`SIGNATURE` in the logic module): when it
fails, the tool prints which part on stderr and in the JSON (`signature_failures`), runs no arm
and exits with status 2 (`--no-signature-check` runs the arms anyway; `--quick` never checks).

Writes under --out: `sft/` (the shared warm start), `signature/b<B>/` (the SFT model decoded with
each budget, no training), `runs/<arm>_s<seed>[_b<B>]/` (each run's metrics.jsonl; with
`--heldout N`, `..._heldout<N>_b<B>/`: its final weights decoded on N held-out prompts, one
greedy and one sampled completion each, dense and at budget B, for every arm alike), `raw.json`,
`curves.png` (training reward per budget, mean over seeds with a min-max band), `table.md` (a
row per arm and budget: ratios to dense with their intervals, peak KV, evictions, rejections).
Prints one line per finished run, then one JSON line: the signature, a cell per (arm, budget)
with means over seeds, and the issue's targets at budgets <= L/4. `--set KEY=VALUE`
(repeatable) overrides any config key in every run. Logic: benchmarks/repro_sparse_rl.py.

`--steps 200 --extend-from 100` makes 200-step runs from the 100-step ones: each arm's
`<name>_t200` continues `<name>` from its checkpoint 100 and metrics (`<name>` run first if not
done): the same runs as from step 0, at half the cost.

`--archive DIR` keeps the study's durable part where `runs/` is not (a new machine has none):
the SFT start with its step-0 checkpoint and every finished run's metrics, no other checkpoint
(benchmarks/study_archive.py). It fills --out from DIR first, and DIR from --out at the end:

    python tools/repro_sparse_rl.py --out runs/x --archive docs/studies/x ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.repro_sparse_rl import (  # noqa: E402
    ARMS,
    NotFinished,
    RunStopped,
    Study,
    markdown_table,
    plot_study,
    run_study,
    summarise,
)
from benchmarks.study_archive import ArchiveError, restore_archive, save_archive  # noqa: E402

QUICK = (
    "sft.steps=2",
    "data.batch_size=4",  # 8 rows: one per device of the tests' 8-device CPU mesh
    "train.eval_examples=4",
    "train.eval_every=0",
    "train.save_every=2",
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=None, help="default configs/repro_sparse_rl.yaml")
    p.add_argument("--out", default="runs/repro_sparse_rl_study")
    p.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=None)
    p.add_argument("--budgets", nargs="+", type=int, default=None, help="default L/8 L/4")
    p.add_argument("--no-signature-check", action="store_true")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default 0 1 2")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--heldout",
        type=int,
        default=0,
        metavar="N",
        help="also decode each run's final weights on N held-out prompts (one greedy and one "
        "sampled completion each), dense and at each budget (the ratio-to-dense target then "
        "reads them)",
    )
    p.add_argument(
        "--finished-only",
        action="store_true",
        help="report what is on disk: leave out runs and decodes not finished (never start or "
        "resume one), e.g. while other pieces of the study still run",
    )
    p.add_argument(
        "--extend-from",
        type=int,
        default=None,
        metavar="N",
        help="longer runs from the finished N-step ones: each arm's run <name>_t<steps> "
        "continues <name> (N steps; run first if not done) from its final checkpoint",
    )
    p.add_argument("--quick", action="store_true", help="tiny config, 2 steps, 3 arms, 1 budget")
    p.add_argument(
        "--signature-only",
        action="store_true",
        help="the SFT start and its sparse/dense signature per budget, no RL runs",
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        help="JAX persistent compilation cache directory (default <out>/jax_cache): the arms "
        "share most programs",
    )
    p.add_argument(
        "--archive",
        default=None,
        metavar="DIR",
        help="a study archive (benchmarks/study_archive.py): copy into --out the finished runs "
        "and SFT start it holds before running, and the finished ones back into it after",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.archive and Path(args.archive).exists():
        try:
            restored = restore_archive(Path(args.archive), out)
        except ArchiveError as e:
            print(f"repro_sparse_rl: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        log(f"from the archive {args.archive}: {len(restored)} finished runs")
    cache = args.compile_cache or str(out / "jax_cache")
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.abspath(cache))
    if args.extend_from is not None and not 0 < args.extend_from < (args.steps or 0):
        p.error(f"--extend-from {args.extend_from} needs --steps greater than it")
    if args.quick:
        study = Study(
            config=args.config or "configs/tiny.yaml",
            out_dir=str(out),
            arms=tuple(args.arms or ("dense", "corrected", "replay")),
            budgets=tuple(args.budgets or (8,)),  # tiny: L = 8 + 24 = 32, L/4
            seeds=tuple(args.seeds or (0,)),
            steps=args.steps or 2,
            overrides=(*QUICK, *args.set),
            check_signature=False,
            heldout=args.heldout,
            finished_only=args.finished_only,
            extend_from=args.extend_from,
        )
    else:
        study = Study(
            config=args.config or "configs/repro_sparse_rl.yaml",
            out_dir=str(out),
            arms=() if args.signature_only else tuple(args.arms or ARMS),
            budgets=tuple(args.budgets) if args.budgets else None,
            seeds=tuple(args.seeds) if args.seeds else (0, 1, 2),
            steps=args.steps,
            overrides=tuple(args.set),
            check_signature=not args.no_signature_check,
            heldout=args.heldout,
            finished_only=args.finished_only,
            extend_from=args.extend_from,
        )
    try:
        raw = run_study(study, log=log)
    except RunStopped as e:  # one line; exit status 130, as a shell reports an interrupt
        print(f"repro_sparse_rl: {e}", file=sys.stderr)
        raise SystemExit(130) from None
    except NotFinished as e:  # --finished-only before the SFT start or the signature is done
        print(f"repro_sparse_rl: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if args.archive:
            saved = save_archive(out, Path(args.archive))
            log(f"into the archive {args.archive}: {len(saved)} finished runs")
    (out / "raw.json").write_text(json.dumps(raw, indent=1))
    summary = summarise(raw)
    (out / "table.md").write_text(markdown_table(summary))
    result = {
        "config": raw["config"],
        "rollout_length": raw["rollout_length"],
        "budgets": raw["budgets"],
        "seeds": list(study.seeds),
        "signature": raw["signature"],
        "signature_failures": raw["signature_failures"],
        **summary,
        "table": str(out / "table.md"),
        "plot": str(plot_study(raw, out / "curves.png")),
        "wall_s": round(raw["wall_s"], 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(2 if main()["signature_failures"] else 0)
