"""Sparse-RL's claim on our stack: dense vs naive sparse vs corrected rollouts (issue 18 item 2).

The study (`tools/repro_sparse_rl.py` is its command line):

1. **One SFT warm start** (`sparserl train` with `train.steps=0`): its step-0 checkpoint is
   copied into every run's directory, so every arm resumes from the same bits (`train` resumes
   from the newest checkpoint in `run_dir`; a step-0 checkpoint holds the warm-started weights,
   fresh optimizer state, no data-iterator state, so the resumed run is the run that would have
   followed its own SFT stage, `tests/test_repro_sparse_rl.py` checks it row for row).
2. **The signature**: the SFT model's held-out greedy reward decoded with the sparse cache at each
   budget over the same model decoded densely, before any training (`train.steps=0` on a copy),
   and one RL step's correction metrics on its sparse rollouts (mismatch KL, rho p5, evicted
   fraction); StreamingLLM at L/4 as the floor. At L/4 it must fall inside `SIGNATURE` (eviction
   hurts but does not kill, half the KV evicted, a mismatch to correct): otherwise the study
   says which part fails and runs no arm (`check_signature`).
3. **The arms** (`ARMS`), each run by `sparserl_jax.train.train` with dotted overrides only: the
   same prompts (`data.seed`), hyperparameters and step count everywhere; a seed is `train.seed`
   (the rollout keys). The dense arm does not depend on the budget: it runs once per seed, and
   its final weights are then decoded with each budget's sparse cache (`train.steps=N` on a copy
   of its final checkpoint: an evaluation only), the dense-trained policy's robustness to
   eviction, to set against the sparse-trained arms'.

Per run: held-out greedy reward at the end decoded densely (`val/dense_greedy_reward_mean`,
`train.eval_dense`) and with the run's own sparse cache (`val/greedy_reward_mean`), the sampled
held-out reward, the training reward curve, peak KV bytes, the evicted fraction of the rollout's
tokens, the Sparse-RL masked-token / rejected-sequence fractions, and whether it collapsed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sparserl_jax.build import build_model, build_tokenizer
from sparserl_jax.checkpoint import CheckpointManager
from sparserl_jax.config import Config, ConfigError, from_dict, load_config, to_dict
from sparserl_jax.data import PromptLimit, encode_prompts, eval_examples
from sparserl_jax.kvcache import AdaptiveBudgetConfig
from sparserl_jax.metrics import read_metrics
from sparserl_jax.rl import Learner

__all__ = [
    "ARMS",
    "NotFinished",
    "RunCheckpoint",
    "RunStopped",
    "SIGNATURE",
    "Study",
    "run_study",
    "signature_failures",
    "steps_to_target",
    "bootstrap_diff",
    "bootstrap_ratio",
    "collapse",
    "summarise",
    "plot_study",
    "restore_checkpoint",
    "run_at_step",
]

# Overrides per arm; everything else is the config's. "naive": the sparse sampler's tokens
# trained on as if they were the dense policy's (no veto, no rejection, no reweighting);
# "tis": truncated importance sampling alone (Yao et al. 2025), no rejection; "replay": the
# learner replays the sampler's evictions (the sparse policy itself, rho = 1 up to rounding).
ARMS: dict[str, tuple[str, ...]] = {
    "dense": ("rollout.kv.policy=none",),
    "naive": (
        "learner.correction.veto=false",
        "learner.correction.reject=false",
        "learner.correction.reweight=false",
    ),
    "corrected": (),
    "tis": ("learner.correction.veto=false", "learner.correction.reject=false"),
    # TIS as the issue names it: the weights min(rho, 1.5) as they are, not divided by their
    # batch mean ("tis" keeps the default batch normalisation, verl's
    # `rollout_is_batch_normalize: true`).
    "tis_raw": (
        "learner.correction.veto=false",
        "learner.correction.reject=false",
        "learner.correction.batch_normalize=false",
    ),
    # Corrected without its token rejection (veto and reweighting kept): does masking the
    # tokens where the sparse sampler went wrong, while the rest of a failed sequence keeps its
    # negative advantage, push the right steps down? (docs/reproductions.md, fourth regime)
    "no_token_reject": ("learner.correction.reject=false",),
    # Corrected without its sequence veto (token rejection and reweighting kept): at L/4 in
    # the tagged task every rejected sequence was vetoed (half the batch): is the veto what
    # keeps corrected below dense? (docs/reproductions.md, tenth session)
    "no_veto": ("learner.correction.veto=false",),
    "adaptive": ("rollout.kv.adaptive.enabled=true",),
    # The adaptive budget that also raises after a step rejecting > 20% of its sequences: at
    # L/4 in the tagged task the p5-only controller held 128 tokens with half of each batch
    # vetoed (docs/adaptive_kv.md, "The rejection limit"). 12 levels put rungs 48 tokens apart
    # (64, 80, 128, 176, 224, ... at budget 128, L = 512), so it can hold the fixed arm's 176.
    "adaptive_rej": (
        "rollout.kv.adaptive.enabled=true",
        "rollout.kv.adaptive.max_rejected=0.2",
        "rollout.kv.adaptive.levels=12",
    ),
    "replay": ("rollout.record_evictions=true", "learner.attention_mask=replay"),
    # Dense rollouts on half the prompts per step (`batch_overrides`, below): as many sequences
    # reach the gradient as corrected's at L/4, where its veto drops 40-50% of each batch. Is
    # that data loss alone what keeps corrected below dense? (docs/reproductions.md, fourteenth
    # session.) Named with a budget like the sparse arms; its cache is never compressed.
    "dense_half": ("rollout.kv.policy=none",),
    # Its mirror: corrected on twice the prompts per step (`batch_overrides`), decoded through
    # as many slots as the study's batch fills, so its peak KV is corrected's and its rollouts
    # cost twice the decode steps. After the veto about as many sequences reach the gradient as
    # dense's: does getting the vetoed samples back bring corrected to dense? (docs/
    # reproductions.md, fifteenth session.)
    "corrected_double": (),
    # Corrected with GRPO's group statistics over the sequences it keeps. The veto removes the
    # below-average samples more often than the good ones (`correction/rejected_neg_adv_fraction`
    # 0.4-0.7 against `rejected_pos_adv_fraction` 0.2-0.4 at L/4), so with Sparse-RL's
    # full-group advantages the kept ones average above zero: is that bias the cost?
    "kept_adv": ("train.advantages_over_kept=true",),
}


def batch_overrides(arm: str, cfg: Config) -> tuple[str, ...]:
    """The overrides that change the prompts per step, relative to the study's batch (whatever
    `--set` made it): half for `dense_half`; twice for `corrected_double`, in the slots one
    study batch fills (`data.batch_size x rollout.n_samples`, fewer if the config has fewer).
    None for the other arms."""
    b = cfg.data.batch_size
    if arm == "dense_half":
        if b < 2:
            raise ConfigError(f"dense_half halves data.batch_size, which is {b}")
        return (f"data.batch_size={b // 2}",)
    if arm == "corrected_double":
        slots = min(cfg.rollout.num_slots, b * cfg.rollout.n_samples)
        return (f"data.batch_size={2 * b}", f"rollout.num_slots={slots}")
    return ()


# A run collapsed (`collapse`) when, at the end, its held-out reward decoded with the full cache
# (sampled, the policy RL trains; greedy when no sampled figure) is below this fraction of the
# SFT start's, or its training reward (trailing mean of TARGET_WINDOW steps) is below this
# fraction of the best it reached, or a step skipped a non-finite update. Decoded as trained, a
# sparse arm's reward can be 0 from the start, and greedy falls under RL where sampling does not
# (the tagged task: docs/reproductions.md): neither decides a collapse, both are reported.
COLLAPSE_FRACTION = 0.5
# Time-to-target: the first RL step at which a run's training reward, averaged over the last
# TARGET_WINDOW steps, reaches TARGET_FRACTION of the dense arm's final training reward (its
# last three steps, mean over seeds).
TARGET_FRACTION, TARGET_WINDOW = 0.9, 5
# Resamples of the percentile bootstrap behind every ratio-to-dense interval.
BOOTSTRAP_SAMPLES = 2000
# The pre-flight signature at B = L/4 (the SFT start, before any arm): where the claim can be
# tested. key: (low, high (exclusive), why); None = open.
SIGNATURE: dict[str, tuple[float | None, float | None, str]] = {
    "ratio": (0.5, 0.9, "sparse greedy reward over dense: eviction must hurt, but not kill"),
    "evicted_fraction": (0.5, None, "at least half the KV entries evicted"),
    "mismatch_kl": (0.02, 0.3, "a mismatch the correction can see and still correct"),
    "rho_p5": (None, 0.86, "the ratio's tail below Sparrow's 0.86: something to reject"),
}
# What the signature keeps of its one RL step (`run_record`'s keys).
_SIGNATURE_STEP_KEYS = (
    "evicted_fraction",
    "mismatch_kl",
    "rho_p5",
    "peak_kv_bytes",
    "peak_kv_tokens",
    "masked_token_fraction",
    "rejected_seq_fraction",
)
_QUIET = ("train.progress=false", "train.plot=false")


@dataclasses.dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint of a study run, ready to score (`restore_checkpoint`)."""

    cfg: Config
    tokenizer: Any
    model: Any
    learner: Learner  # its `logprobs` are the dense policy's: the full cache
    params: Any


def run_at_step(arg: str) -> tuple[Path, int]:
    """`RUN_DIR@STEP` (as the study's diagnostic tools take a checkpoint) -> (dir, step)."""
    run, sep, step = arg.rpartition("@")
    if not sep or not step.isdigit():
        raise ValueError(f"{arg!r}: expected RUN_DIR@STEP, e.g. runs/x/dense_s0@100")
    return Path(run), int(step)


def restore_checkpoint(run: Path, step: int) -> RunCheckpoint:
    """Checkpoint `step` of the run in `run` (its `config.json` gives the model and the task),
    with a learner that teacher-forces the dense policy whatever mask the run trained with."""
    cfg = from_dict(Config, json.loads((run / "config.json").read_text()))
    model = build_model(cfg.model)
    learner = Learner(model, dataclasses.replace(cfg.learner, attention_mask="dense"))
    with CheckpointManager(run, keep=100) as ckpt:
        state = ckpt.restore(step, {"learner": learner.init(model)})[0]["learner"]
    return RunCheckpoint(
        cfg, build_tokenizer(cfg.tokenizer, cfg.model), model, learner, state.params
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Study:
    """What to run. `budgets`: KV budgets in tokens (None: L/8 and L/4 of the config's rollout
    length L = max_prompt_len + max_new_tokens); `overrides`: applied to every run first."""

    config: str
    out_dir: str
    arms: tuple[str, ...] = tuple(ARMS)
    budgets: tuple[int, ...] | None = None
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int | None = None  # None: the config's train.steps
    overrides: tuple[str, ...] = ()
    check_signature: bool = True  # stop before the arms when `SIGNATURE` fails at L/4
    heldout: int = 0  # > 0: each run's final weights decoded on this many held-out prompts
    # Only report what is on disk: runs (and their held-out decodes) not finished are left out,
    # never started or resumed (a study run in pieces, read while some of it still runs).
    finished_only: bool = False
    # Longer runs from shorter ones: each arm's run `<name>_t<steps>` continues the run `<name>`
    # of `extend_from` steps (run first if not done) from its final checkpoint and metrics. The
    # two configs differ only in `train.steps`, which no schedule reads, so the first
    # `extend_from` steps are that run's, bit for bit (tests/test_repro_sparse_rl.py).
    extend_from: int | None = None

    def __post_init__(self):
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"arms {unknown} unknown; expected some of {tuple(ARMS)}")
        if not self.seeds:
            raise ValueError("seeds must not be empty")
        if self.extend_from is not None and not 0 < self.extend_from < (self.steps or 0):
            raise ValueError(
                f"extend_from ({self.extend_from}) must lie in [1, steps) with steps given, "
                f"got steps={self.steps}"
            )

    def cfg(self, *overrides: str) -> Config:
        extra = () if self.steps is None else (f"train.steps={self.steps}",)
        return load_config(self.config, [*self.overrides, *extra, *_QUIET, *overrides])

    def run(
        self, cfg: Config, src_run: Path, step: int, log: Callable[[str], None], *, extend=False
    ) -> dict:
        """`_run` under this study's `finished_only`: every run the study reads or trains goes
        through here, so none can start while only a report was asked for."""
        return _run(cfg, src_run, step, log, finished_only=self.finished_only, extend=extend)

    def resolved_budgets(self) -> tuple[int, ...]:
        if self.budgets:
            return tuple(self.budgets)
        length = self.cfg().rollout.max_len
        return (length // 8, length // 4)


def _copy_checkpoint(src_run: Path, step: int, dst_run: Path, *, metrics: bool = False) -> None:
    """`dst_run` holds checkpoint `step` of `src_run` and nothing else (a fresh directory);
    `metrics`: and `src_run`'s metrics (a run extended from where `src_run` ended)."""
    if dst_run.exists():
        shutil.rmtree(dst_run)
    shutil.copytree(src_run / "checkpoints" / str(step), dst_run / "checkpoints" / str(step))
    if metrics:  # after the checkpoint: until `train` writes config.json, a kill redoes both
        shutil.copy2(src_run / "metrics.jsonl", dst_run / "metrics.jsonl")


def _as_saved(cfg: Config) -> dict:
    """`cfg` as its `config.json` / `done.json` hold it (JSON types), for comparisons."""
    return json.loads(json.dumps(to_dict(cfg)))


def _normalised(saved: dict) -> dict | None:
    """A saved config re-read as the code reads it now (keys added since at their defaults,
    so a study resumed with a newer checkout keeps its runs); None when it no longer loads (a
    key since removed)."""
    try:
        return _as_saved(from_dict(Config, saved))
    except ConfigError:
        return None


def _same_config(saved: dict, cfg: Config) -> bool:
    """Whether a saved config is `cfg` (`_normalised`)."""
    return _normalised(saved) == _as_saved(cfg)


def _done(cfg: Config) -> dict | None:
    """The saved summary of `cfg.run_dir` when its `done.json` holds this very config (a study
    cut off, or given more seeds, picks up where it was), else None."""
    done = Path(cfg.run_dir) / "done.json"
    if done.exists():
        saved = json.loads(done.read_text())
        # A run a signal stopped is not done (such a done.json was written before 2026-11-28).
        if _same_config(saved["config"], cfg) and not saved["summary"].get("stopped_by_signal"):
            return saved["summary"]
    return None


_SFT_SECTIONS = ("model", "tokenizer", "data", "sft")  # what the warm start depends on
# ... except how RL forms its batches from the rows (the SFT reads `sft_pairs`, unshuffled, in
# `sft.batch_size` pairs): an RL arm with fewer prompts per step keeps the study's SFT start.
_RL_BATCHING = ("batch_size", "shuffle", "num_epochs", "drop_remainder")


# ... and how the model computes teacher forcing rather than what it is: the attention kernel
# and its blocks, the MLP's chunks, rematerialisation change a start's bits by float rounding
# at most, so an arm may run a faster layout than the start was trained with (on CPU the
# chunked attention in 128-token blocks is 0.6x the learner step of 512: docs/reproductions.md).
_COMPUTE_LAYOUT = ("remat", "attention", "attention_block", "mlp_chunk")


def _sft_view(config: dict) -> dict:
    view = {k: config.get(k) for k in _SFT_SECTIONS}
    view["data"] = {k: v for k, v in (view["data"] or {}).items() if k not in _RL_BATCHING}

    def model(section):
        return {k: v for k, v in (section or {}).items() if k not in _COMPUTE_LAYOUT}

    view["model"] = model(view["model"]) | {"arch": model((view["model"] or {}).get("arch"))}
    return view


# The SFT settings of the warm start in progress under `sft/` (written before it starts), so a
# study cut off during its SFT resumes it instead of starting over.
_SFT_VIEW = "sft_view.json"


def _sft_done(cfg: Config) -> bool:
    """Whether `cfg.run_dir` holds a finished warm start made with `cfg`'s SFT settings."""
    done = Path(cfg.run_dir) / "done.json"
    if not done.exists():
        return False
    saved = _normalised(json.loads(done.read_text())["config"])
    return saved is not None and _sft_view(saved) == _sft_view(_as_saved(cfg))


class NotFinished(LookupError):
    """`Study.finished_only`: a run the study would have to start or resume."""


class RunStopped(RuntimeError):
    """A signal (Ctrl-C, SIGTERM) stopped a run of the study at a safe point, its checkpoint
    saved: the study stops there, and the same command resumes that run."""


def _train(cfg: Config, log: Callable[[str], None]) -> dict:
    from sparserl_jax.train import train

    run_dir = Path(cfg.run_dir)
    summary = train(cfg, log_fn=lambda m: log(f"  [{run_dir.name}] {m}"))
    if summary.get("stopped_by_signal"):
        raise RunStopped(
            f"{run_dir.name} stopped by {summary['signal']} during {summary['stopped_during']}; "
            "the same command resumes it"
        )
    (run_dir / "done.json").write_text(json.dumps({"config": to_dict(cfg), "summary": summary}))
    return summary


def _resumable(cfg: Config) -> int | None:
    """The newest checkpoint step of an unfinished run of this very config in `cfg.run_dir`
    (a study cut off mid-run), or None (nothing of it there, or another config's)."""
    run_dir = Path(cfg.run_dir)
    written = run_dir / "config.json"
    if not written.exists() or not _same_config(json.loads(written.read_text()), cfg):
        return None
    steps = [int(p.name) for p in (run_dir / "checkpoints").glob("[0-9]*") if p.is_dir()]
    return max(steps, default=None)


def _run(
    cfg: Config,
    src_run: Path,
    step: int,
    log: Callable[[str], None],
    *,
    finished_only=False,
    extend=False,
) -> dict:
    """`train(cfg)` from checkpoint `step` of `src_run`; returns its summary. A run done before
    with this very config is kept (`_done`); one cut off (killed, or the study stopped) resumes
    from its newest checkpoint (`train` does, from `run_dir`) instead of starting over.
    `finished_only`: raise `NotFinished` instead of training. `extend`: the run continues
    `src_run` (which ended at `step`): it starts with its metrics as well."""
    name = Path(cfg.run_dir).name
    summary = _done(cfg)
    if summary is not None:
        log(f"  [{name}] done before: kept")
        return summary
    if finished_only:
        raise NotFinished(f"no finished run of this config in {name}")
    with run_lock(Path(cfg.run_dir), log):
        summary = _done(cfg)  # another process may have finished it while this one waited
        if summary is not None:
            log(f"  [{name}] done by another process: kept")
            return summary
        return _start_or_resume(cfg, src_run, step, log, extend=extend)


@contextlib.contextmanager
def run_lock(run_dir: Path, log: Callable[[str], None]):
    """Hold `run_dir`'s lock (a sibling `.<name>.lock`, flock): two processes of a study (arms
    side by side) that both need a run not yet done (the signature, a new SFT layout) run it
    once, the second waiting for the first, never both in one directory."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.with_name(f".{run_dir.name}.lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"  [{run_dir.name}] another process runs it: waiting")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _start_or_resume(
    cfg: Config, src_run: Path, step: int, log: Callable[[str], None], *, extend: bool
) -> dict:
    name = Path(cfg.run_dir).name
    resume_at = _resumable(cfg)
    if resume_at is None:
        if not (src_run / "checkpoints" / str(step)).is_dir():
            raise NotFinished(
                f"{name} starts from checkpoint {step} of {src_run.name}, which is not on disk "
                "(a run restored from a study archive keeps no checkpoints): rerun that run "
                "to decode it"
            )
        _copy_checkpoint(src_run, step, Path(cfg.run_dir), metrics=extend)
    else:
        log(f"  [{name}] cut off before: resumes from its checkpoint {resume_at}")
    return _train(cfg, log)


def _make_sft(sft: Config, out: Path, log: Callable[[str], None]) -> None:
    sft_dir = Path(sft.run_dir)
    log(f"SFT warm start -> {sft_dir}")
    # Every run of the study descends from the SFT start: a new one voids them all. One of
    # these settings cut off mid-way is kept: the warm start resumes from its progress.
    view, settings = sft_dir / _SFT_VIEW, _sft_view(_as_saved(sft))
    keep = view.exists() and json.loads(view.read_text()) == settings
    for old in ("signature", "runs") if keep else ("sft", "signature", "runs"):
        shutil.rmtree(out / old, ignore_errors=True)
    sft_dir.mkdir(parents=True, exist_ok=True)
    view.write_text(json.dumps(settings))
    _train(sft, log)


def _mean_prompt_tokens(cfg: Config) -> float:
    """Mean prompt length in tokens (the held-out prompts), to turn evicted counts into
    fractions of whole sequences."""
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    limit = PromptLimit(tokenizer, cfg.rollout.max_prompt_len)
    examples = eval_examples(cfg.data, max(cfg.train.eval_examples, 64), limit=limit)
    prompts = encode_prompts(examples, tokenizer, max_len=cfg.rollout.max_prompt_len)
    return float(np.mean([len(p) for p in prompts]))


def run_record(rows: list[dict], cfg: Config, prompt_tokens: float) -> dict[str, Any]:
    """The figures of one run from its metrics rows (`rows[0]`: the step-0 evaluation)."""
    steps = [r for r in rows if "critic/score/mean" in r]
    seqs = cfg.data.batch_size * cfg.rollout.n_samples
    evicted = [
        r["rollout/tokens_evicted"] / (seqs * (r["response_length/mean"] + prompt_tokens))
        for r in steps
    ]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in steps if key in r]
        return float(np.mean(vals)) if vals else None

    start, final = rows[0], rows[-1]
    greedy0, greedy = start.get("val/greedy_reward_mean"), final.get("val/greedy_reward_mean")
    dense_final = final.get(
        "val/dense_greedy_reward_mean", greedy if not cfg.rollout.sparse else None
    )
    record = {
        "steps": len(steps),
        "train_reward": [r["critic/score/mean"] for r in steps],
        "train_reward_first3": float(np.mean([r["critic/score/mean"] for r in steps[:3]])),
        "train_reward_last3": float(np.mean([r["critic/score/mean"] for r in steps[-3:]])),
        "greedy_start": greedy0,
        "greedy_final": greedy,  # decoded as the run trained: its own cache
        "dense_greedy_start": start.get(
            "val/dense_greedy_reward_mean", greedy0 if not cfg.rollout.sparse else None
        ),
        "dense_greedy_final": dense_final,
        "sampled_final": final.get("val/reward_mean"),  # decoded as trained
        "dense_sampled_start": start.get(
            "val/dense_reward_mean",
            start.get("val/reward_mean") if not cfg.rollout.sparse else None,
        ),
        "dense_sampled_final": final.get(
            "val/dense_reward_mean",
            final.get("val/reward_mean") if not cfg.rollout.sparse else None,
        ),
        "peak_kv_bytes": int(max(r["rollout/kv_peak_bytes"] for r in steps)) if steps else None,
        # The paper's count: tokens kept at once (logged since 2026-11-28; None before).
        "peak_kv_tokens": max(
            (r["rollout/kv_peak_tokens"] for r in steps if "rollout/kv_peak_tokens" in r),
            default=None,
        ),
        "evicted_fraction": float(np.mean(evicted)) if evicted else None,
        "masked_token_fraction": mean("correction/masked_token_fraction"),
        "rejected_seq_fraction": mean("correction/rejected_seq_fraction"),
        "mismatch_kl": mean("correction/mismatch_kl"),
        "rho_p5": mean("correction/rho_p5"),
        "kv_budget_mean": mean("rollout/kv_budget"),
        "rungs": rungs(steps, target=cfg.rollout.kv.adaptive.target),
    }
    nonfinite = any(r.get("actor/nonfinite_skips", 0) for r in steps)
    return record | collapse(record, nonfinite=nonfinite)


def rungs(
    steps: list[dict], target: float = AdaptiveBudgetConfig().target
) -> dict[str, dict[str, float]]:
    """A run's steps grouped by the KV budget each rollout used (`rollout/kv_budget`; one group
    at a fixed budget, none for dense): per budget, the steps spent there and the means of what
    the correction saw and the training reward, with the steps whose p5 was under `target`
    (the run's adaptive target). The adaptive controller's view: which budgets it held, and
    what they cost (docs/reproductions.md, thirteenth session)."""
    by_budget: dict[int, list[dict]] = {}
    for r in steps:
        if "rollout/kv_budget" in r:
            by_budget.setdefault(int(r["rollout/kv_budget"]), []).append(r)
    out = {}
    for b, rs in sorted(by_budget.items()):
        p5 = [r["correction/rho_p5"] for r in rs]
        out[str(b)] = {
            "steps": len(rs),
            "rejected_seq_fraction": float(
                np.mean([r["correction/rejected_seq_fraction"] for r in rs])
            ),
            "rho_p5": float(np.mean(p5)),
            f"steps_rho_p5_under_{target}": sum(not v >= target for v in p5),
            "mismatch_kl": float(np.mean([r["correction/mismatch_kl"] for r in rs])),
            "train_reward": float(np.mean([r["critic/score/mean"] for r in rs])),
        }
    return out


def collapse(rec: dict[str, Any], *, nonfinite: bool = False) -> dict[str, Any]:
    """Whether a run collapsed (`COLLAPSE_FRACTION`), and by which measure: `collapse_dense`
    (the full-cache held-out reward at the end against the start's), `collapse_train` (the
    training reward's trailing mean at the end against its best); `greedy_fell`: the greedy
    reward decoded as trained fell below the same fraction (reported, not a collapse)."""

    def fell(start, end):
        return start is not None and end is not None and end < COLLAPSE_FRACTION * start

    sampled = rec["dense_sampled_start"] is not None and rec["dense_sampled_final"] is not None
    dense = (
        fell(rec["dense_sampled_start"], rec["dense_sampled_final"])
        if sampled
        else fell(rec["dense_greedy_start"], rec["dense_greedy_final"])
    )
    trailing = trailing_means(rec["train_reward"])
    train = bool(trailing) and fell(max(trailing), trailing[-1])
    return {
        "collapse_dense": dense,
        "collapse_train": train,
        "greedy_fell": fell(rec["greedy_start"], rec["greedy_final"]),
        "collapsed": bool(dense or train or nonfinite),
    }


def run_study(study: Study, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run everything `study` names; returns the raw records (`summarise` reduces them)."""
    out = Path(study.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    budgets = study.resolved_budgets()
    t0 = time.perf_counter()

    # 1. The shared SFT warm start: step 0 of this run is every arm's start.
    sft_dir = out / "sft"
    sft = study.cfg(f"run_dir={sft_dir}", "train.steps=0", "train.eval_examples=0")
    if not _sft_done(sft):
        if study.finished_only:
            raise NotFinished(
                f"no finished SFT start of this config in {sft_dir}: nothing to report"
            )
        with run_lock(sft_dir, log):
            if not _sft_done(sft):  # not made by another process meanwhile
                _make_sft(sft, out, log)
    base = study.cfg()
    prompt_tokens = _mean_prompt_tokens(base)

    # 2. The signature: the SFT start at each budget (and at L/4, where it is checked),
    #    decoded sparse vs dense and through one RL step's correction, before any arm runs.
    quarter = base.rollout.max_len // 4
    signature = {
        b: _signature(study, out, sft_dir, b, prompt_tokens, floor=b == quarter, log=log)
        for b in sorted({*budgets, quarter})
    }
    failures = signature_failures(signature[quarter]) if study.check_signature else []
    for f in failures:
        log(f"signature at L/4 = {quarter} fails: {f}")
    record = {
        "config": study.config,
        "budgets": list(budgets),
        "rollout_length": base.rollout.max_len,
        "prompt_tokens_mean": prompt_tokens,
        "signature": signature,
        "signature_failures": failures,
        "runs": [],
        "wall_s": time.perf_counter() - t0,
    }
    if failures:  # the arms could not test the claim: stop before spending hours on them
        return record

    # 3. The arms.
    runs: list[dict[str, Any]] = []
    for seed in study.seeds:
        for arm in study.arms:
            for b in budgets if arm != "dense" else (None,):
                name = f"{arm}_s{seed}" + ("" if b is None else f"_b{b}")
                run_dir = out / "runs" / name
                overrides = [
                    f"run_dir={run_dir}",
                    f"train.seed={seed}",
                    "train.eval_dense=true",
                    *ARMS[arm],
                    *batch_overrides(arm, base),
                ]
                if b is not None:
                    overrides.append(f"rollout.kv.budget={b}")
                src, src_step = sft_dir, 0
                if study.extend_from:
                    shorter = study.cfg(*overrides, f"train.steps={study.extend_from}")
                    name = f"{name}_t{study.steps}"
                    run_dir = run_dir.with_name(name)
                    overrides.append(f"run_dir={run_dir}")
                cfg = study.cfg(*overrides)
                log(f"run {name} ({time.perf_counter() - t0:.0f}s into the study)")
                try:
                    if study.extend_from and _done(cfg) is None:
                        src, src_step = _extension_start(study, shorter, sft_dir, name, log)
                    study.run(cfg, src, src_step, log, extend=src_step > 0)
                except NotFinished as e:
                    log(f"  left out: {e}")
                    continue
                rec = run_record(read_metrics(run_dir), cfg, prompt_tokens)
                # `finished_only`: the run is in; a decode of it not finished is left out.
                if study.heldout:
                    at = budgets if b is None else (b,)
                    rec |= _heldout(study, run_dir, cfg.train.steps, at, log)
                if arm == "dense":
                    rec["sparse_decoded"] = _decode_sparse(
                        study, run_dir, cfg.train.steps, budgets, log
                    )
                runs.append({"arm": arm, "budget": b, "seed": seed, "name": name, **rec})
    return record | {"runs": runs, "wall_s": time.perf_counter() - t0}


def _extension_start(
    study: Study, base: Config, sft_dir: Path, name: str, log: Callable[[str], None]
) -> tuple[Path, int]:
    """Where run `name`, the extension of `base`, starts: `base`'s final checkpoint (`base` run
    first if not done), or the SFT start when `base` was restored from an archive without it
    (the same run then, from step 0)."""
    study.run(base, sft_dir, 0, log)
    steps = base.train.steps
    if (Path(base.run_dir) / "checkpoints" / str(steps)).is_dir():
        return Path(base.run_dir), steps
    log(f"  [{name}] {Path(base.run_dir).name} keeps no checkpoint {steps}: starts from step 0")
    return sft_dir, 0


def _signature(
    study: Study, out: Path, sft_dir: Path, b: int, prompt_tokens: float, *, floor: bool, log
) -> dict[str, Any]:
    """The SFT start at budget `b`: held-out greedy and sampled reward decoded sparse and dense
    (an evaluation only), and the correction's view of one RL step's sparse rollouts (mismatch
    KL, rho p5 over the tokens drawn after the first eviction, evicted fraction). `floor`:
    also StreamingLLM at the same budget, its sinks covering the prompt (the policy to beat)."""
    sig_dir = out / "signature"
    cfg = study.cfg(
        f"run_dir={sig_dir / f'b{b}'}",
        "train.steps=0",
        f"rollout.kv.budget={b}",
        "train.eval_dense=true",
    )
    study.run(cfg, sft_dir, 0, log)
    row = read_metrics(cfg.run_dir)[0]
    sparse, dense = row["val/greedy_reward_mean"], row["val/dense_greedy_reward_mean"]
    step_cfg = study.cfg(
        f"run_dir={sig_dir / f'b{b}_step'}",
        "train.steps=1",
        "train.eval_examples=0",
        f"rollout.kv.budget={b}",
    )
    study.run(step_cfg, sft_dir, 0, log)
    rec = run_record([{}, *read_metrics(step_cfg.run_dir)], step_cfg, prompt_tokens)
    sig = {
        "sparse_greedy": sparse,
        "dense_greedy": dense,
        "ratio": sparse / dense if dense else None,
        "sparse_sampled": row["val/reward_mean"],
        "dense_sampled": row["val/dense_reward_mean"],
        "sparse_response_length": row["val/greedy_response_length_mean"],
        "dense_response_length": row["val/dense_greedy_response_length_mean"],
        **{k: rec[k] for k in _SIGNATURE_STEP_KEYS},
    }
    if floor:
        sinks = min(cfg.rollout.max_prompt_len, b - cfg.rollout.kv.window)
        stream = study.cfg(
            f"run_dir={sig_dir / f'b{b}_streaming'}",
            "train.steps=0",
            f"rollout.kv.budget={b}",
            "rollout.kv.policy=streaming",
            f"rollout.kv.sink_tokens={sinks}",
        )
        study.run(stream, sft_dir, 0, log)
        sig["streaming_greedy"] = read_metrics(stream.run_dir)[0]["val/greedy_reward_mean"]
    log(
        f"signature b={b}: greedy sparse {sparse:.3f} / dense {dense:.3f}, evicted "
        f"{sig['evicted_fraction']:.2f}, mismatch KL {sig['mismatch_kl']:.3f}, rho p5 "
        f"{sig['rho_p5']:.3f}"
        + (f", StreamingLLM greedy {sig['streaming_greedy']:.3f}" if floor else "")
    )
    return sig


def signature_failures(sig: dict[str, Any]) -> list[str]:
    """What of `SIGNATURE` the signature at L/4 misses (empty: the study can test the claim)."""
    failures = []
    for key, (lo, hi, why) in SIGNATURE.items():
        v = sig.get(key)
        if v is None or (lo is not None and v < lo) or (hi is not None and v >= hi):
            span = (
                f"[{lo}, {hi})"
                if lo is not None and hi is not None
                else (f">= {lo}" if lo is not None else f"< {hi}")
            )
            shown = "missing" if v is None else f"{v:.3f}"
            failures.append(f"{key} = {shown}, needs {span}: {why}")
    return failures


def _decode_sparse(
    study: Study, dense_run: Path, step: int, budgets: Sequence[int], log
) -> dict[int, dict[str, float]]:
    """The dense arm's final weights decoded (greedy, sampled) with each budget's sparse cache
    (`finished_only`: the budgets whose decode is finished)."""
    out = {}
    for b in budgets:
        run_dir = dense_run.parent / f"{dense_run.name}_decode_b{b}"
        cfg = study.cfg(f"run_dir={run_dir}", f"train.steps={step}", f"rollout.kv.budget={b}")
        try:
            summary = study.run(cfg, dense_run, step, log)
        except NotFinished as e:
            log(f"  left out: {e}")
            continue
        out[b] = {
            "greedy": summary["val_greedy_reward_before"],
            "sampled": summary["val_reward_before"],
        }
    return out


def _heldout(
    study: Study, run: Path, step: int, budgets: Sequence[int], log
) -> dict[str, float | int]:
    """A run's final weights (checkpoint `step`) on the study's large held-out set: one greedy
    completion and one sampled at the training temperature per prompt (`train.eval_samples=1`:
    a training group's decoding spread over 8x the prompts), decoded with the full cache
    (`heldout_dense_greedy`, `heldout_dense_sampled`, once, with the first budget) and with the
    config's sparse cache at each of `budgets` (`heldout_greedy_b<B>`, `heldout_sampled_b<B>`):
    every arm decoded the same way, whatever cache it trained with. `finished_only`: the
    decodes that are finished (none: an empty dict)."""
    out: dict[str, float | int] = {}
    for i, b in enumerate(budgets):
        cfg = study.cfg(
            f"run_dir={run.parent / f'{run.name}_heldout{study.heldout}_b{b}'}",
            f"train.steps={step}",
            f"train.eval_examples={study.heldout}",
            "train.eval_samples=1",
            f"train.eval_dense={str(i == 0).lower()}",
            f"rollout.kv.budget={b}",
        )
        try:
            study.run(cfg, run, step, log)
        except NotFinished as e:
            log(f"  left out: {e}")
            continue
        out["heldout_prompts"] = study.heldout
        row = read_metrics(cfg.run_dir)[0]
        out.setdefault("heldout_dense_greedy", row.get("val/dense_greedy_reward_mean"))
        out.setdefault("heldout_dense_sampled", row.get("val/dense_reward_mean"))
        out[f"heldout_greedy_b{b}"] = row["val/greedy_reward_mean"]
        out[f"heldout_sampled_b{b}"] = row["val/reward_mean"]
    return out


def bootstrap_ratio(
    pairs: Sequence[tuple[float, float]], *, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> dict[str, float | int | None]:
    """mean(arm) / mean(dense) over runs paired by seed, with a 95% percentile bootstrap
    interval: the seeds resampled with replacement, both arms' values of a seed kept together.
    `lo`/`hi` are None with fewer than two pairs (nothing to resample); `ratio` None when the
    dense mean is 0 or there is no pair."""
    a = np.asarray([p[0] for p in pairs], np.float64)
    d = np.asarray([p[1] for p in pairs], np.float64)
    out: dict[str, float | int | None] = {"ratio": None, "lo": None, "hi": None, "n": len(a)}
    if len(a) == 0 or d.mean() == 0:
        return out
    out["ratio"] = float(a.mean() / d.mean())
    if len(a) < 2:
        return out
    idx = np.random.default_rng(seed).integers(0, len(a), (samples, len(a)))
    den = d[idx].mean(axis=1)
    ratios = a[idx].mean(axis=1)[den > 0] / den[den > 0]
    out["lo"], out["hi"] = (float(q) for q in np.percentile(ratios, [2.5, 97.5]))
    return out


def bootstrap_diff(
    pairs: Sequence[tuple[float, float]], *, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> dict[str, float | int | None]:
    """mean(a - b) over pairs (one per seed) with a 95% percentile bootstrap interval over the
    pairs; `lo`/`hi` None with fewer than two pairs, `diff` None with none."""
    d = np.asarray([a - b for a, b in pairs], np.float64)
    out: dict[str, float | int | None] = {"diff": None, "lo": None, "hi": None, "n": len(d)}
    if len(d):
        out["diff"] = float(d.mean())
    if len(d) >= 2:
        means = d[np.random.default_rng(seed).integers(0, len(d), (samples, len(d)))].mean(axis=1)
        out["lo"], out["hi"] = (float(q) for q in np.percentile(means, [2.5, 97.5]))
    return out


def trailing_means(curve: Sequence[float], window: int = TARGET_WINDOW) -> list[float]:
    """At each step, the mean of the last `window` values of `curve` (fewer at the start)."""
    return [float(np.mean(curve[max(0, i + 1 - window) : i + 1])) for i in range(len(curve))]


def steps_to_target(curve: Sequence[float], target: float, window: int = TARGET_WINDOW):
    """The first step (1-based) at which the mean of the last `window` values of `curve` (fewer
    at the start) reaches `target`; None if it never does."""
    for i, m in enumerate(trailing_means(curve, window)):
        if m >= target:
            return i + 1
    return None


def _paired(
    group: list[dict], dense: list[dict], key: str, dense_key: str | None = None
) -> list[tuple[float, float]]:
    """(run's `key`, the dense run's `dense_key` (default `key`) of the same seed), where both
    exist."""
    dense_key = dense_key or key
    by_seed = {r["seed"]: r[dense_key] for r in dense if r.get(dense_key) is not None}
    return [
        (r[key], by_seed[r["seed"]])
        for r in group
        if r.get(key) is not None and r["seed"] in by_seed
    ]


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Per (arm, budget): means (and spread) over seeds, each against the dense arm with a
    bootstrap 95% interval over seeds, the steps to reach the target reward, and the issue's
    targets checked at every budget of at most L/4."""
    runs = raw["runs"]
    dense = [r for r in runs if r["arm"] == "dense"]
    dense_last = [r["train_reward_last3"] for r in dense if r.get("train_reward_last3") is not None]
    target = TARGET_FRACTION * float(np.mean(dense_last)) if dense_last else None
    dense_final = _stat([r["dense_greedy_final"] for r in dense])
    dense_sampled = _stat([r["dense_sampled_final"] for r in dense])
    dense_kv = {k: _stat([r.get(k) for r in dense]) for k in ("peak_kv_bytes", "peak_kv_tokens")}
    cells = []
    for b in raw["budgets"]:
        for arm in dict.fromkeys(r["arm"] for r in runs):
            group = [r for r in runs if r["arm"] == arm and r["budget"] in (b, None)]
            if not group:
                continue
            cell = {"arm": arm, "budget": b, "seeds": len(group)}
            for key in (
                "dense_greedy_final",
                "greedy_final",
                "sampled_final",
                "dense_sampled_final",
                "train_reward_first3",
                "train_reward_last3",
                "peak_kv_bytes",
                "peak_kv_tokens",
                "evicted_fraction",
                "masked_token_fraction",
                "rejected_seq_fraction",
                "mismatch_kl",
                "rho_p5",
                "kv_budget_mean",
            ):
                cell[key] = _stat([r.get(key) for r in group])
            if arm == "dense":
                decoded = [r.get("sparse_decoded", {}).get(b, {}) for r in group]
                cell["greedy_final"] = _stat([d.get("greedy") for d in decoded])
                cell["sampled_final"] = _stat([d.get("sampled") for d in decoded])
            cell["rungs"] = {str(r["seed"]): r["rungs"] for r in group if r.get("rungs")}
            for key in ("collapsed", "collapse_dense", "collapse_train", "greedy_fell"):
                cell[key] = sum(bool(r.get(key)) for r in group)  # runs, of the seeds
            if any("heldout_dense_greedy" in r for r in group):  # `Study.heldout`
                cell["heldout_prompts"] = max(r.get("heldout_prompts", 0) for r in group)
                for key, stored, ref in (
                    ("heldout_dense_greedy", "heldout_dense_greedy", "heldout_dense_greedy"),
                    ("heldout_greedy", f"heldout_greedy_b{b}", "heldout_dense_greedy"),
                    ("heldout_dense_sampled", "heldout_dense_sampled", "heldout_dense_sampled"),
                    ("heldout_sampled", f"heldout_sampled_b{b}", "heldout_dense_sampled"),
                ):
                    cell[key] = _stat([r.get(stored) for r in group])
                    pairs = _paired(group, dense, stored, ref)
                    cell[f"{key}_vs_dense_ci"] = bootstrap_ratio(pairs)
            for key, ref in (("dense_greedy", dense_final), ("dense_sampled", dense_sampled)):
                if ref["mean"] and cell[f"{key}_final"]["mean"] is not None:
                    cell[f"{key}_vs_dense"] = cell[f"{key}_final"]["mean"] / ref["mean"]
                cell[f"{key}_vs_dense_ci"] = bootstrap_ratio(_paired(group, dense, f"{key}_final"))
            if target is not None:
                reached = [steps_to_target(r["train_reward"], target) for r in group]
                cell["steps_to_target"] = _stat(reached)
                cell["reached_target"] = sum(x is not None for x in reached)
            for key, name in (("peak_kv_bytes", "peak_kv"), ("peak_kv_tokens", "peak_kv_tokens")):
                if dense_kv[key]["mean"] and cell[key]["mean"] is not None:
                    cell[f"{name}_vs_dense"] = cell[key]["mean"] / dense_kv[key]["mean"]
            cells.append(cell)
    return {"cells": cells, "targets": _targets(raw, cells), "target_reward": target}


def _stat(values) -> dict[str, float | None]:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "min": None, "max": None}
    return {"mean": float(np.mean(vals)), "min": min(vals), "max": max(vals)}


def _targets(raw: dict, cells: list[dict]) -> list[dict]:
    """The issue's targets at each budget <= L/4: corrected >= 97% of dense (held-out reward
    decoded densely, sampled mean@n and greedy, mean over seeds) with >= half the tokens
    evicted; naive below corrected (sampled) or collapsed; peak KV <= 30% of dense."""
    out = []
    limit = raw["rollout_length"] // 4
    for b in (b for b in raw["budgets"] if b <= limit):
        by_arm = {c["arm"]: c for c in cells if c["budget"] == b}
        corr, naive = by_arm.get("corrected"), by_arm.get("naive")
        if corr is None:
            continue
        # Seed-paired ratios (a seed whose dense run is missing does not count), from the
        # large held-out set where the study decoded one.
        sampled = (corr.get("heldout_dense_sampled_vs_dense_ci") or {}).get("ratio")
        if sampled is None:
            sampled = (corr.get("dense_sampled_vs_dense_ci") or {}).get("ratio")
        greedy = (corr.get("heldout_dense_greedy_vs_dense_ci") or {}).get("ratio")
        if greedy is None:
            greedy = (corr.get("dense_greedy_vs_dense_ci") or {}).get("ratio")
        row = {
            "budget": b,
            "evicted_fraction": corr["evicted_fraction"]["mean"],
            "corrected_vs_dense_sampled": sampled,
            "corrected_vs_dense_greedy": greedy,
            "greedy_heldout_prompts": corr.get("heldout_prompts"),
            "corrected_ge_97pct": (sampled or 0) >= 0.97 and (greedy or 0) >= 0.97,
            "half_evicted": (corr["evicted_fraction"]["mean"] or 0) >= 0.5,
            "peak_kv_vs_dense": corr.get("peak_kv_vs_dense"),
            "peak_kv_tokens_vs_dense": corr.get("peak_kv_tokens_vs_dense"),
            "peak_kv_le_30pct": (corr.get("peak_kv_vs_dense") or math.inf) <= 0.30,
        }
        if naive is not None:
            row["naive_minus_corrected"] = _diff(naive, corr)
            row["naive_below_or_collapsed"] = bool(
                naive["collapsed"] or (row["naive_minus_corrected"] or 0) < 0
            )
            # "Measurably below": the seed-paired difference's interval excludes 0, on the
            # dense-decoded sampled reward and on the large held-out set's greedy one.
            naive_runs, corr_runs = (
                [r for r in raw["runs"] if r["arm"] == a and r["budget"] == b]
                for a in ("naive", "corrected")
            )
            keys = ("dense_sampled_final", "heldout_dense_sampled", "heldout_dense_greedy")
            for key in keys:
                ci = bootstrap_diff(_paired(naive_runs, corr_runs, key))
                row[f"naive_minus_corrected_{key}"] = ci
            row["naive_measurably_below"] = any(
                (row[f"naive_minus_corrected_{k}"]["hi"] or 0) < 0 for k in keys
            )
        out.append(row)
    return out


def _diff(a: dict, b: dict) -> float | None:
    x, y = a["dense_sampled_final"]["mean"], b["dense_sampled_final"]["mean"]
    return None if x is None or y is None else x - y


def _ci(ci: dict | None, seeds: int) -> str:
    """A ratio with its interval; the seeds it pairs when fewer than the cell's (a decode
    not finished, or no dense run of that seed)."""
    if not ci or ci.get("ratio") is None:
        return "-"
    if ci.get("lo") is None:
        return f"{ci['ratio']:.3f} (n={ci['n']})"
    n = "" if ci["n"] == seeds else f" (n={ci['n']})"
    return f"{ci['ratio']:.3f} [{ci['lo']:.3f}, {ci['hi']:.3f}]{n}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _reached(cell: dict) -> str:
    if "reached_target" not in cell:
        return "-"
    step = cell["steps_to_target"]["mean"]
    return f"{cell['reached_target']}/{cell['seeds']}" + ("" if step is None else f" ({step:.0f})")


def markdown_table(summary: dict[str, Any]) -> str:
    """The summary's cells as one markdown table, a row per (arm, budget): the held-out reward
    (the large set where decoded, else the small one) as a seed-paired ratio to dense with its
    bootstrap 95% interval, dense-decoded (sampled, greedy) and on the arm's own sparse cache;
    peak KV as retained tokens and as allocated pages, each over dense's; the evicted and
    rejected fractions, the mean budget, runs flagged as collapsed, and runs whose training
    reward reached the target (`TARGET_FRACTION` of dense's final) with their mean step."""
    head = (
        "| arm | budget | seeds | dense-decoded sampled / dense | dense-decoded greedy / dense "
        "| own cache sampled / dense | peak KV tokens / dense | peak KV pages / dense | evicted "
        "| seqs rejected | mean budget | collapsed | reached target (step) |"
    )
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for c in summary["cells"]:
        held = "heldout_prompts" in c
        sampled = c.get(
            "heldout_dense_sampled_vs_dense_ci" if held else "dense_sampled_vs_dense_ci"
        )
        greedy = c.get("heldout_dense_greedy_vs_dense_ci" if held else "dense_greedy_vs_dense_ci")
        own = c.get("heldout_sampled_vs_dense_ci") if held else None
        rows.append(
            "| "
            + " | ".join(
                (
                    c["arm"],
                    str(c["budget"]),
                    str(c["seeds"]),
                    _ci(sampled, c["seeds"]),
                    _ci(greedy, c["seeds"]),
                    _ci(own, c["seeds"]),
                    _num(c.get("peak_kv_tokens_vs_dense"), ".2f"),
                    _num(c.get("peak_kv_vs_dense"), ".2f"),
                    _num(c["evicted_fraction"]["mean"], ".0%"),
                    _num(c["rejected_seq_fraction"]["mean"], ".0%"),
                    _num(c["kv_budget_mean"]["mean"], ".0f"),
                    f"{c['collapsed']}/{c['seeds']}",
                    _reached(c),
                )
            )
            + " |"
        )
    return "\n".join(rows) + "\n"


def plot_study(raw: dict[str, Any], path: str | Path) -> Path:
    """Training-reward curves per budget (one panel each), one line per arm: the mean over
    seeds with a band from the seeds' min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = raw["budgets"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 3.5), squeeze=False)
    arms = list(dict.fromkeys(r["arm"] for r in raw["runs"]))
    colour = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}  # an arm's in every panel
    for ax, b in zip(axes[0], budgets, strict=True):
        for arm in arms:
            group = [r for r in raw["runs"] if r["arm"] == arm and r["budget"] in (b, None)]
            if not group:
                continue
            n = min(len(r["train_reward"]) for r in group)
            if n == 0:
                continue
            curves = np.array([r["train_reward"][:n] for r in group])
            x = np.arange(1, n + 1)
            ax.plot(x, curves.mean(0), label=arm, linewidth=1.2, color=colour[arm])
            ax.fill_between(x, curves.min(0), curves.max(0), color=colour[arm], alpha=0.2)
        ax.set_title(f"KV budget {b} of {raw['rollout_length']} tokens")
        ax.set_xlabel("RL step")
        ax.set_ylabel("training reward (sampled)")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
