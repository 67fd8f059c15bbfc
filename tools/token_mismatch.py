"""Where the sparse sampler's tokens differ from the dense policy's: rho per kind of token.

For a checkpoint and a KV budget, sample `--samples` completions of each of the first `--num`
held-out prompts with the run's compressed cache (its `rollout.kv` policy at `--budget`, the
run's temperature), teacher-force them through the same weights with the full cache, and
report rho = pi_dense / mu per token over the tokens drawn after each sequence's first eviction
(as the correction's `rho_p5` reads them): the 5th percentile, the mismatch KL (the k3
estimate over the same tokens, unclipped; `correction/mismatch_kl` averages over every
response token with log rho clipped, so it is not the same number), and per kind of token
(char tokenizer: the study's task) its share of those tokens, the share of it below 0.86
(Sparrow's tail threshold), its share of all tokens below 0.86, its mean KL, and the dense
policy's mean negative logprob of what was drawn (a cross-entropy, E_mu[-log pi]). Kinds: `tag`
(the letters of the tagged repeat scratchpad, `data/arithmetic.py`), `digit`, `newline`,
`answer` (the answer line), `sep` (any other character: `:` and space in the task), `eos`, and
`special` (any other special id).

    python tools/token_mismatch.py runs/srl6_tags/sft@0 --budget 128 --num 64 --samples 8

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.fspath(Path(__file__).resolve().parents[1]))

from benchmarks.repro_sparse_rl import restore_checkpoint, run_at_step  # noqa: E402
from sparserl_jax.data import PromptLimit, encode_prompts, eval_examples  # noqa: E402
from sparserl_jax.data.arithmetic import TAG_LETTERS  # noqa: E402
from sparserl_jax.rollout import RolloutEngine  # noqa: E402

TAIL = 0.86


def kinds(chars: list[str]) -> list[str]:
    """The kind of each token of a completion, given each token's own text (`token_texts`):
    `eos` and `special` for the stop and other special ids (empty text), then by character,
    the answer line from its `answer` on."""
    text = "".join(chars)
    out, in_answer, at = [], False, 0
    for ch in chars:
        if ch in ("eos", ""):
            out.append("eos" if ch else "special")
            continue
        in_answer = in_answer or text.startswith("answer", at)
        at += len(ch)
        if in_answer:
            out.append("answer")
        elif ch in TAG_LETTERS:
            out.append("tag")
        elif ch.isdigit():
            out.append("digit")
        elif ch == "\n":
            out.append("newline")
        else:
            out.append("sep")
    return out


def token_texts(ids, tokenizer) -> list[str]:
    """Each token's own text: `eos` for a stop id, "" for any other special id (never
    decoding the joined ids, which drops special ids and would shift every later label)."""
    eos = set(tokenizer.eos_ids)
    return ["eos" if int(i) in eos else tokenizer.decode([int(i)]) for i in ids]


def measure(run: Path, step: int, budget: int, num: int, samples: int, seed: int) -> dict:
    ck = restore_checkpoint(run, step)
    cfg, tokenizer, params = ck.cfg, ck.tokenizer, ck.params
    if cfg.tokenizer.kind != "char" or not cfg.rollout.sparse:
        raise SystemExit(f"{run}: needs the char tokenizer and a compressed KV cache")
    rcfg = dataclasses.replace(
        cfg.rollout.with_budget(budget),
        n_samples=samples,
        stop_token_ids=tuple(tokenizer.eos_ids),
    )
    limit = PromptLimit(tokenizer, rcfg.max_prompt_len)
    prompts = encode_prompts(
        eval_examples(cfg.data, num, limit=limit), tokenizer, max_len=rcfg.max_prompt_len
    )
    res = RolloutEngine(ck.model, rcfg).generate(
        prompts, params=params, seeds=[seed * 100_003 + i for i in range(len(prompts))]
    )
    tokens_bt, mask_bt, sampler_bt = res.sequences()
    dense_bt = np.asarray(ck.learner.logprobs(params, tokens_bt))
    log_rho_bt = dense_bt - sampler_bt
    after_bt = res.after_eviction(tokens_bt.shape[1]) & mask_bt
    kind_bt = np.full(tokens_bt.shape, "", dtype=object)
    for b in range(tokens_bt.shape[0]):
        idx = np.flatnonzero(mask_bt[b])
        kind_bt[b, idx] = kinds(token_texts(tokens_bt[b, idx], tokenizer))
    rho, lr, kind = np.exp(log_rho_bt[after_bt]), log_rho_bt[after_bt], kind_bt[after_bt]
    nll = -dense_bt[after_bt]
    k3 = rho - 1.0 - lr
    below = rho < TAIL
    per_kind = {}
    for k in ("tag", "digit", "sep", "newline", "answer", "eos", "special"):
        sel = kind == k
        if sel.any():
            per_kind[k] = {
                "share": float(sel.mean()),
                "below_tail": float(below[sel].mean()),
                "share_of_tail": float(below[sel].sum() / max(below.sum(), 1)),
                "mismatch_kl": float(k3[sel].mean()),
                "dense_nll": float(nll[sel].mean()),
            }
    return {
        "run": str(run),
        "step": step,
        "budget": budget,
        "policy": rcfg.kv.policy,
        "sequences": int(tokens_bt.shape[0]),
        "tokens_after_eviction": int(after_bt.sum()),
        "tokens": int(mask_bt.sum()),
        "rho_p5": float(np.percentile(rho, 5)) if rho.size else 1.0,
        "below_tail": float(below.mean()) if rho.size else 0.0,
        "mismatch_kl": float(k3.mean()) if rho.size else 0.0,
        "dense_nll": float(nll.mean()) if rho.size else 0.0,
        "kinds": per_kind,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", metavar="RUN_DIR@STEP")
    ap.add_argument("--budget", type=int, required=True, help="KV budget in tokens")
    ap.add_argument("--num", type=int, default=64, help="held-out prompts (default 64)")
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        run, step = run_at_step(args.run)
    except ValueError as e:
        ap.error(str(e))
    rec = measure(run, step, args.budget, args.num, args.samples, args.seed)
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
