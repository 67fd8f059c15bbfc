"""Teacher-forced log-probability of the task's ideal completions under runs' checkpoints.

What a run's training did to the dense policy on the right answers, apart from sampling: for
the first N problems of the eval split, the ideal completion (scratchpad and answer, as the SFT
data writes it, never corrupted) is scored by each checkpoint with the full cache, and the mean
token logprob is printed per part of the completion (its first, middle and last thirds of
scratchpad lines, and the answer line), with the share of sequences whose every gold token has
probability > 0.5 (each is then the argmax: greedy decoding with the full cache writes that
completion exactly). Char tokenizer only (the study's task): parts are read per character.

    python tools/gold_logprob.py runs/srl4/study/sft@0 runs/srl4/study/runs/dense_s0@100 \\
        runs/srl4/study/runs/corrected_s0_b120@100 --num 256

Each argument is a run directory and a checkpoint step; its `config.json` gives the model and
the task. Prints one JSON line per argument.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.fspath(Path(__file__).resolve().parents[1]))

from benchmarks.repro_sparse_rl import restore_checkpoint, run_at_step  # noqa: E402
from sparserl_jax.data import sft_batch, sft_pairs  # noqa: E402


def parts(completion: str) -> list[str]:
    """Each character's part of a completion: scratchpad thirds `a`, `b`, `c` by line, then
    `answer` for the last line (and the eos after it)."""
    lines = completion.split("\n")
    body = len(lines) - 1
    out = []
    for i, line in enumerate(lines):
        name = "answer" if i == body else "abc"[min(3 * i // max(body, 1), 2)]
        out += [name] * (len(line) + (i < body))  # the newline belongs to its line
    return out + ["answer"]  # the eos


def score(run: Path, step: int, num: int) -> dict:
    ck = restore_checkpoint(run, step)
    cfg = ck.cfg
    if cfg.tokenizer.kind != "char":
        raise SystemExit(f"{run}: tokenizer {cfg.tokenizer.kind!r}; parts are read per character")
    pairs = sft_pairs(cfg.data, num, split="eval")
    batch = sft_batch(pairs, ck.tokenizer, max_len=cfg.sft.max_len)
    logp = np.asarray(ck.learner.logprobs(ck.params, batch.tokens_bt))
    by_part: dict[str, list[float]] = {}
    greedy_like = []
    for b, (_, completion) in enumerate(pairs):
        idx = np.flatnonzero(batch.loss_mask_bt[b])
        lp = logp[b, idx]
        for name, x in zip(parts(completion), lp, strict=True):
            by_part.setdefault(name, []).append(float(x))
        greedy_like.append(bool((lp > np.log(0.5)).all()))
    return {
        "run": run.name,
        "step": step,
        "sequences": len(pairs),
        **{f"logp_{k}": float(np.mean(v)) for k, v in sorted(by_part.items())},
        "all_tokens_above_half": float(np.mean(greedy_like)),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR@STEP")
    ap.add_argument("--num", type=int, default=256, help="eval-split problems (default 256)")
    args = ap.parse_args(argv)
    try:
        runs = [run_at_step(arg) for arg in args.runs]
    except ValueError as e:
        ap.error(str(e))
    for run, step in runs:
        print(json.dumps(score(run, step, args.num)), flush=True)


if __name__ == "__main__":
    main()
