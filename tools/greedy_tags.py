"""What greedy decoding writes in the tagged repeat task: reward, tags and where lines break.

For each checkpoint, one greedy completion of each of the first `--num` held-out prompts (the
full cache, or the run's compressed cache at `--budget`), read line by line (`45wz315`: count,
tag letters, running product; `data/arithmetic.py`): the held-out greedy reward, the distinct
tag pairs per completion, the share of lines carrying their completion's commonest pair (1.0:
one pair copied down every line), the share of lines from the eleventh on whose tag repeats the
line ten above (the task's copy, drawn with probability `tag_copy` in the data), the share of
well-formed lines, and where the first broken line falls (a line whose count or product is
wrong, or no line where one should be). `--show N` adds the first N completions' tags.

    python tools/greedy_tags.py runs/srl6_tags75x2/sft@0 runs/srl6_tags75x2/runs/dense_s0@100

Prints one JSON line per checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, os.fspath(Path(__file__).resolve().parents[1]))

from benchmarks.repro_sparse_rl import restore_checkpoint, run_at_step  # noqa: E402
from sparserl_jax.data import PromptLimit, encode_prompts, eval_examples  # noqa: E402
from sparserl_jax.data.arithmetic import TAG_LAG, TAG_LETTERS, arithmetic_reward  # noqa: E402
from sparserl_jax.rollout import RolloutEngine  # noqa: E402
from sparserl_jax.sampler import completion_texts  # noqa: E402

_LINE = re.compile(rf"^(\d+)([{TAG_LETTERS}]+)(\d+)$")
_PROMPT = re.compile(r"^(\d+)\*(\d+)=$")


def read_lines(prompt: str, completion: str) -> dict:
    """One completion of `a*b=` read line by line: its tags (None for a line that is not
    `<count><letters><product>`), and the first line (1-based) that breaks the scratchpad: a
    wrong count or product, a malformed line, or the answer before line `b` (None: none
    breaks)."""
    m = _PROMPT.match(prompt.strip())
    if m is None:
        raise ValueError(f"not a repeat-task prompt: {prompt!r}")
    a, b = int(m.group(1)), int(m.group(2))
    tags: list[str | None] = []
    broken = None
    body = completion[1:] if completion.startswith("\n") else completion  # `7*45=` + `\n1..`
    for k, line in enumerate(body.split("\n"), start=1):
        if line.startswith("answer") or k > b:
            if broken is None and (k <= b or not line.startswith("answer")):
                broken = k  # the answer too early, or a line past the last
            break
        parsed = _LINE.match(line)
        tags.append(parsed.group(2) if parsed else None)
        ok = parsed is not None and int(parsed.group(1)) == k and int(parsed.group(3)) == a * k
        if broken is None and not ok:
            broken = k
    if broken is None and len(tags) < b:
        broken = len(tags) + 1  # stopped before its last line
    return {"tags": tags, "broken_at": broken, "lines": b}


def tag_stats(lines: list[dict]) -> dict:
    """Tag and breakage figures over completions read by `read_lines`."""
    distinct, modal, copied, formed, broken = [], [], [], [], []
    for r in lines:
        tags = r["tags"]
        good = [t for t in tags if t is not None]
        formed.append(len(good) / max(len(tags), 1))
        if good:
            counts = Counter(good)
            distinct.append(len(counts))
            modal.append(counts.most_common(1)[0][1] / len(good))
        pairs = [
            (tags[k], tags[k - TAG_LAG])
            for k in range(TAG_LAG, len(tags))
            if tags[k] is not None and tags[k - TAG_LAG] is not None
        ]
        if pairs:
            copied.append(float(np.mean([t == above for t, above in pairs])))
        if r["broken_at"] is not None:
            broken.append(r["broken_at"] / r["lines"])

    def mean(xs):
        return float(np.mean(xs)) if xs else None

    return {
        "distinct_tags_mean": mean(distinct),
        "modal_tag_share": mean(modal),
        "copy_share": mean(copied),
        "well_formed_share": mean(formed),
        "broken_fraction": len(broken) / max(len(lines), 1),
        "broken_at_mean": mean(broken),  # as a fraction of the lines the prompt asks for
    }


def measure(run: Path, step: int, num: int, budget: int | None, show: int) -> dict:
    ck = restore_checkpoint(run, step)
    cfg, tokenizer = ck.cfg, ck.tokenizer
    if not cfg.data.arithmetic.tags or cfg.data.arithmetic.scratchpad != "repeat":
        raise SystemExit(f"{run}: not the tagged repeat task (data.arithmetic.tags = 0)")
    kv = None if budget is None else cfg.rollout.with_budget(budget).kv
    rcfg = dataclasses.replace(
        cfg.rollout,
        kv=kv,
        temperature=0.0,
        n_samples=1,
        stop_token_ids=tuple(tokenizer.eos_ids),
    )
    limit = PromptLimit(tokenizer, rcfg.max_prompt_len)
    examples = eval_examples(cfg.data, num, limit=limit)
    prompts = encode_prompts(examples, tokenizer, max_len=rcfg.max_prompt_len)
    res = RolloutEngine(ck.model, rcfg).generate(
        prompts, params=ck.params, seeds=list(range(len(prompts)))
    )
    texts = completion_texts(res, tokenizer)
    rewards = [arithmetic_reward(t, e.answer) for t, e in zip(texts, examples, strict=True)]
    lines = [read_lines(e.prompt, t) for e, t in zip(examples, texts, strict=True)]
    return {
        "run": str(run),
        "step": step,
        "cache": "dense" if kv is None else f"{kv.policy}@{budget}",
        "prompts": len(examples),
        "greedy_reward": float(np.mean(rewards)),
        **tag_stats(lines),
        "examples": [
            {
                "prompt": e.prompt,
                "reward": r,
                "tags": " ".join(t or "?" for t in x["tags"]),
                "broken_at": x["broken_at"],
            }
            for e, r, x in list(zip(examples, rewards, lines, strict=True))[:show]
        ],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", metavar="RUN_DIR@STEP", nargs="+")
    ap.add_argument("--num", type=int, default=64, help="held-out prompts (default 64)")
    ap.add_argument(
        "--budget", type=int, default=None, help="decode with the run's KV policy at this budget"
    )
    ap.add_argument("--show", type=int, default=0, help="completions to print the tags of")
    args = ap.parse_args(argv)
    try:
        points = [run_at_step(r) for r in args.runs]
    except ValueError as e:
        ap.error(str(e))
    for run, step in points:
        print(json.dumps(measure(run, step, args.num, args.budget, args.show)), flush=True)


if __name__ == "__main__":
    main()
