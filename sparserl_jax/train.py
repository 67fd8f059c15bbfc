"""`sparserl train`: the sampler-learner loop (ARCHITECTURE.md §9-10).

One RL step:

    prompts (grain) -> rollout with the sampler's published bf16 weights (dense or sparse KV)
      -> rewards -> group advantages -> pi_old (dense, same bf16 weights, teacher forced)
      -> up to K DGG-gated passes of the Sparse-RL objective -> PULSESync patch to the sampler

Topologies: `colocated` (one mesh; the sampler's weights live on the learner's devices) and
`split` (the devices are split into a trainer mesh and a sampler mesh; the patch is applied onto
the sampler mesh in-process). Both always go through PULSESync, so every step proves the sampler
holds `bf16(master)` bit for bit (the receiver checks the full-state hash).

Resume: checkpoints hold the learner state (master params, optimizer, DGG window, counters), the
data-iterator state and the step; rollout keys derive from `(train.seed, step)`, so a resumed run
continues bit for bit. SIGTERM saves a checkpoint and exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from sparserl_jax.checkpoint import CheckpointManager, PreemptionGuard
from sparserl_jax.data import Example, compute_rewards, eval_examples, make_reward_fn
from sparserl_jax.data import prompt_iterator as make_prompt_iterator
from sparserl_jax.metrics import MetricsWriter, plot_metrics
from sparserl_jax.parallel import MeshConfig, make_mesh, state_shardings
from sparserl_jax.rl import Learner, RLBatch, compute_advantages
from sparserl_jax.rollout import RolloutEngine, RolloutResult
from sparserl_jax.sft import sft_warm_start
from sparserl_jax.sync import InProcessTransport, Publisher, Receiver, leaf_names
from sparserl_jax.sync.mask import from_bits, published_dtype

log = logging.getLogger(__name__)

Topology = Literal["colocated", "split"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The RL loop.

    Attributes:
      steps: RL steps (one rollout batch each, reused for up to `learner.gating.max_passes`).
      seed: rollout seed; step s samples with keys derived from `(seed, s)`.
      advantage_estimator: `grpo`, `dr_grpo` or `dapo`; groups are `rollout.n_samples` wide.
      topology: `colocated` or `split` (trainer and sampler on disjoint devices).
      sampler_devices: with `split`, how many devices (the last ones) the sampler gets; the
        trainer mesh (`mesh:` section) is laid over the rest.
      save_every: checkpoint every this many steps (and at the end, and on SIGTERM).
      keep_checkpoints: how many checkpoints to keep.
      async_checkpoint: save in the background.
      resume: continue from the newest checkpoint in `run_dir` when there is one.
      eval_every: greedy evaluation on held-out prompts every this many steps (0: only before
        the first and after the last step); `eval_examples` prompts.
      tensorboard: also write TensorBoard event files (needs tensorboardX).
      progress: show a progress bar with ETA on the console.
      plot: write `metrics.png` in the run directory at the end.
    """

    steps: int = 100
    seed: int = 0
    advantage_estimator: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    topology: Topology = "colocated"
    sampler_devices: int = 1
    save_every: int = 50
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    resume: bool = True
    eval_every: int = 0
    eval_examples: int = 64
    tensorboard: bool = False
    progress: bool = True
    plot: bool = True

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"train.steps must be >= 0, got {self.steps}")
        if self.topology not in ("colocated", "split"):
            raise ValueError(f"train.topology {self.topology!r} unknown; expected colocated, split")
        if self.sampler_devices < 1:
            raise ValueError(f"train.sampler_devices must be >= 1, got {self.sampler_devices}")
        if self.save_every < 1 or self.keep_checkpoints < 1:
            raise ValueError(
                f"train.save_every and train.keep_checkpoints must be >= 1, got "
                f"{self.save_every}, {self.keep_checkpoints}"
            )
        if self.eval_every < 0 or self.eval_examples < 0:
            raise ValueError("train.eval_every and train.eval_examples must be >= 0")


# ---------------------------------------------------------------------------------------------
# rollout -> learner batch
# ---------------------------------------------------------------------------------------------


def rl_batch(result: RolloutResult, advantages_b: np.ndarray, seq_len: int) -> RLBatch:
    """The learner's batch: `result.sequences()` right-padded to the static width `seq_len`
    (so the learner compiles once), with the advantages of every row."""
    tokens, mask, logp = result.sequences()
    width = tokens.shape[1]
    if width > seq_len:
        raise ValueError(f"rollout rows are {width} tokens wide, more than seq_len {seq_len}")
    pad = ((0, 0), (0, seq_len - width))
    return RLBatch(
        tokens_bt=np.pad(tokens, pad),
        mask_bt=np.pad(mask, pad),
        advantages_b=np.asarray(advantages_b, np.float32),
        sampler_logp_bt=np.pad(logp, pad),
    )


def completion_texts(result: RolloutResult, tokenizer) -> list[str]:
    """The decoded completions (special tokens such as the stop token dropped)."""
    return [
        tokenizer.decode(result.completion_ids[i, : int(result.completion_lens[i])].tolist())
        for i in range(len(result.prompt_ids))
    ]


def step_seeds(seed: int, step: int, n: int) -> list[int]:
    """Per-prompt rollout seeds of one step: a pure function of `(seed, step)`."""
    return [int(s) for s in np.random.SeedSequence([seed, step]).generate_state(n)]


# ---------------------------------------------------------------------------------------------
# sampler side: its devices, its weights
# ---------------------------------------------------------------------------------------------


def published_params(bits_tree, like, publish_dtype):
    """Published bits (a PULSESync tree) as parameters with the dtypes of `like`: exact, since
    every published value is representable in the (wider) parameter dtype."""
    return jax.tree.map(
        lambda b, x: from_bits(b, published_dtype(x.dtype, publish_dtype)).astype(x.dtype),
        bits_tree,
        like,
    )


@dataclasses.dataclass
class _Sampler:
    """The sampler's weights (received through PULSESync) and its engines."""

    receiver: Receiver
    treedef: Any
    names: list[str]
    like: Any  # the parameter tree's shapes and dtypes
    publish_dtype: Any
    engine: RolloutEngine
    eval_engine: RolloutEngine

    def params(self):
        """The sampler's weights: its published bits, cast to the model's parameter dtypes."""
        bits = self.receiver.tree(self.treedef, self.names)
        return published_params(bits, self.like, self.publish_dtype)


def _meshes(cfg, devices) -> tuple[Mesh, Mesh | None]:
    if cfg.train.topology == "colocated":
        return make_mesh(cfg.mesh, devices), None
    k = cfg.train.sampler_devices
    if k >= len(devices):
        raise ValueError(
            f"train.topology=split needs more devices than train.sampler_devices={k}; "
            f"have {len(devices)} (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8)"
        )
    trainer = make_mesh(cfg.mesh, devices[: len(devices) - k])
    return trainer, make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), devices[len(devices) - k :])


def _sampler_shardings(model: nnx.Module, mesh: Mesh) -> dict[str, Any]:
    """Per leaf name, the sharding the sampler holds that weight with."""
    state = nnx.state(model)
    shardings = jax.tree.leaves(
        nnx.to_pure_dict(state_shardings(state, mesh)),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return dict(zip(leaf_names(nnx.to_pure_dict(state)), shardings, strict=True))


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------


def evaluate(sampler: _Sampler, examples: list[Example], tokenizer, reward_fn) -> dict:
    """Held-out reward of the sampler's current weights: the mean over a group of completions
    per prompt sampled like the training rollouts, with fixed seeds (`val/reward_mean`: the
    policy RL improves), and of one greedy completion per prompt (`val/greedy_reward_mean`)."""
    if not examples:
        return {}
    prompts = [tokenizer.encode(e.prompt, add_bos=True) for e in examples]
    params = sampler.params()
    seeds = list(range(len(prompts)))
    out = {}
    for prefix, engine in (("val/", sampler.engine), ("val/greedy_", sampler.eval_engine)):
        result = engine.generate(prompts, params=params, seeds=seeds)
        group = len(result.prompt_ids) // len(prompts)
        texts = completion_texts(result, tokenizer)
        rewards = compute_rewards(reward_fn, examples, texts, group_size=group)
        out[f"{prefix}reward_mean"] = float(rewards.mean())
        out[f"{prefix}response_length_mean"] = float(result.completion_lens.mean())
    return out


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------


def _pass_metrics(history: list[dict]) -> dict[str, float]:
    """verl-named learner metrics of one batch (means over the passes that ran)."""
    first = history[0]

    def mean(key):
        return float(np.mean([np.asarray(h[key], np.float64) for h in history]))

    out = {
        "actor/pg_loss": mean("pg_loss"),
        "actor/loss": mean("loss"),
        "actor/entropy": mean("entropy"),
        "actor/kl_loss": mean("kl"),
        "actor/ppo_kl": mean("approx_kl"),
        "actor/pg_clipfrac": mean("clip_fraction"),
        "actor/grad_norm": mean("grad_norm"),
        "actor/lr": float(first["lr"]),
        "dgg/g": float(history[-1]["dgg/g"]),
        "dgg/z": float(np.max([h["dgg/z"] for h in history])),
        "dgg/fires": int(sum(bool(h["dgg/fire"]) for h in history)),
        "dgg/passes_run": int(first["passes_run"]),
        "dgg/passes_applied": int(first["passes_applied"]),
        "actor/nonfinite_skips": int(sum(bool(h["nonfinite"]) for h in history)),
    }
    # The correction depends on pi_old and mu only: the same on every pass.
    out.update({k: float(v) for k, v in first.items() if k.startswith("correction/")})
    return out


def train(cfg, *, log_fn=print, on_step=None) -> dict:
    """Run `sparserl train` for `cfg` (a `sparserl_jax.config.Config`); returns the summary.

    `log_fn(message)` receives progress messages; `on_step(step, metrics)` is called after each
    RL step with the row written to `metrics.jsonl` (for custom logging or early stopping).
    """
    from sparserl_jax.build import build_model, build_tokenizer

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(_config_dict(cfg), indent=1))
    tcfg, rcfg = cfg.train, cfg.rollout
    group = rcfg.n_samples
    seq_len = rcfg.max_prompt_len + rcfg.max_new_tokens
    if rcfg.temperature > 0 and rcfg.temperature != cfg.learner.loss.temperature:
        raise ValueError(
            f"rollout.temperature={rcfg.temperature} but learner.loss.temperature="
            f"{cfg.learner.loss.temperature}: the learner must score tokens with the sampler's "
            "temperature (ARCHITECTURE.md §3); set both to the same value"
        )
    if group < 2:
        raise ValueError(f"rollout.n_samples={group}: group advantages need at least 2 samples")
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model)
    if rcfg.stop_token_ids == ():
        rcfg = dataclasses.replace(rcfg, stop_token_ids=tuple(tokenizer.eos_ids))

    devices = jax.devices()
    trainer_mesh, sampler_mesh = _meshes(cfg, devices)
    model = build_model(cfg.model, trainer_mesh)
    learner = Learner(model, cfg.learner, mesh=trainer_mesh)
    ckpt = CheckpointManager(run_dir, keep=tcfg.keep_checkpoints, async_save=tcfg.async_checkpoint)
    start_step, data_state, sync_version = 0, None, 0
    restored = None
    if tcfg.resume and ckpt.steps():
        restored = ckpt.restore_latest({"learner": learner.init(model)})
    if restored is not None:
        state, meta = restored[0]["learner"], restored[1]
        start_step, data_state = int(meta["step"]), meta.get("data_state")
        sync_version = int(meta.get("sync_version", 0))
        log_fn(f"resumed from {ckpt.directory} at step {start_step}")
    else:
        if cfg.sft.steps:
            t0 = time.perf_counter()
            losses = sft_warm_start(model, cfg.sft, cfg.data, tokenizer)
            log_fn(
                f"SFT warm start: {cfg.sft.steps} steps, loss {losses[0]:.3f} -> "
                f"{losses[-1]:.3f} in {time.perf_counter() - t0:.1f}s"
            )
        state = learner.init(model)
        # Step 0 = after the warm start: a run killed later never repeats the SFT stage.
        ckpt.save(0, {"learner": state}, {"data_state": None, "sync_version": 0})

    # -- sampler: its own copy of the published weights, fed by PULSESync --------------------
    shardings = _sampler_shardings(model, sampler_mesh or trainer_mesh)
    transport = InProcessTransport()
    # The baseline of the sync is bf16(master), re-derived exactly from the restored master; the
    # version numbering continues from the checkpoint (a new chain starts with an anchor).
    publisher = Publisher(transport, config=cfg.sync, start_version=sync_version)
    receiver = Receiver(lambda name, shape: shardings[name])
    sampler_model = learner.model(state.params)
    pdt = cfg.sync.jnp_publish_dtype
    sampler = _Sampler(
        receiver=receiver,
        treedef=jax.tree.structure(state.params),
        names=leaf_names(state.params),
        like=jax.eval_shape(lambda p: p, state.params),
        publish_dtype=pdt,
        engine=RolloutEngine(sampler_model, rcfg),
        eval_engine=RolloutEngine(
            sampler_model, dataclasses.replace(rcfg, temperature=0.0, n_samples=1)
        ),
    )
    publisher.publish(state.params)
    receiver.sync(transport)

    reward_fn = make_reward_fn(cfg.data)
    held_out = eval_examples(cfg.data, tcfg.eval_examples) if tcfg.eval_examples else []
    data_it = make_prompt_iterator(cfg.data, state=data_state)
    writer = MetricsWriter(run_dir, tensorboard=tcfg.tensorboard)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "start_step": start_step}

    val = evaluate(sampler, held_out, tokenizer, reward_fn)
    if val:
        writer.write(start_step, val)
        summary["val_reward_before"] = val["val/reward_mean"]
        summary["val_greedy_reward_before"] = val["val/greedy_reward_mean"]
        log_fn(f"step {start_step}: {_val_line(val)}")

    bar = _progress(tcfg, start_step)
    step = start_step
    rewards_seen: list[float] = []
    with PreemptionGuard() as guard:
        while step < tcfg.steps and not guard.requested:
            step += 1
            t_step = time.perf_counter()
            batch = next(data_it)
            prompts = [tokenizer.encode(e.prompt, add_bos=True) for e in batch.examples]
            sampler_params = sampler.params()
            t0 = time.perf_counter()
            result = sampler.engine.generate(
                prompts,
                params=sampler_params,
                weight_version=receiver.version,
                seeds=step_seeds(tcfg.seed, step, len(prompts)),
            )
            t_gen = time.perf_counter() - t0
            texts = completion_texts(result, tokenizer)
            rewards = compute_rewards(reward_fn, batch.examples, texts, group_size=group)
            adv = np.asarray(
                compute_advantages(
                    jnp.asarray(rewards), group_size=group, estimator=tcfg.advantage_estimator
                )
            )
            rl = rl_batch(result, adv, seq_len)

            # pi_old: the dense policy with the sampler's (published) weights, on the trainer.
            t0 = time.perf_counter()
            old_params = published_params(publisher.sent_bits, state.params, pdt)
            rl = rl._replace(old_logp_bt=learner.logprobs(old_params, rl.tokens_bt))
            t_old = time.perf_counter() - t0

            t0 = time.perf_counter()
            state, history = learner.train_on_batch(state, rl)
            t_upd = time.perf_counter() - t0

            t0 = time.perf_counter()
            pub = publisher.publish(state.params)
            events = receiver.sync(transport)
            t_sync = time.perf_counter() - t0

            lengths = result.completion_lens
            rewards_seen.append(float(rewards.mean()))
            metrics = {
                "critic/score/mean": float(rewards.mean()),
                "critic/score/std": float(rewards.std()),
                "critic/advantages/mean": float(adv.mean()),
                "response_length/mean": float(lengths.mean()),
                "response_length/max": int(lengths.max()),
                "response_length/clip_ratio": float(np.mean(lengths >= rcfg.max_new_tokens)),
                **_pass_metrics(history),
                "rollout/tokens_evicted": int(result.tokens_evicted.sum()),
                "rollout/kv_peak_bytes": int(result.stats.get("kv_peak_bytes", 0)),
                "rollout/weight_version": int(result.weight_version.max()),
                "sync/version": int(pub.version),
                "sync/changed": int(pub.total_changed),
                "sync/changed_fraction": pub.total_changed / max(pub.numel, 1),
                "sync/payload_bytes": len(pub.patch or b""),
                "sync/dense_bf16_bytes": int(pub.dense_bytes),
                "sync/verified": all(e.error is None for e in events) and bool(events),
                "perf/rollout_tokens_per_s": float(result.stats.get("tokens_per_s", 0.0)),
                "timing_s/gen": t_gen,
                "timing_s/old_log_prob": t_old,
                "timing_s/update_actor": t_upd,
                "timing_s/sync": t_sync,
                "timing_s/step": time.perf_counter() - t_step,
            }
            if tcfg.eval_every and step % tcfg.eval_every == 0 and step < tcfg.steps:
                metrics.update(evaluate(sampler, held_out, tokenizer, reward_fn))
            row = writer.write(step, metrics)
            if on_step is not None:
                on_step(step, row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}")
            if step % tcfg.save_every == 0 or step == tcfg.steps or guard.requested:
                meta = {"data_state": _jsonable(data_it.get_state()), "sync_version": pub.version}
                ckpt.save(step, {"learner": state}, meta)
    if bar is not None:
        bar.close()
    ckpt.wait()
    if guard.requested:
        log_fn(f"stopped by signal at step {step}; checkpoint saved")
        summary.update(stopped_by_signal=True, end_step=step)
        ckpt.close()
        writer.close()
        return summary

    val = evaluate(sampler, held_out, tokenizer, reward_fn)
    if val:
        writer.write(step, val)
        summary["val_reward_after"] = val["val/reward_mean"]
        summary["val_greedy_reward_after"] = val["val/greedy_reward_mean"]
        log_fn(f"step {step}: {_val_line(val)}")
    writer.close()
    ckpt.close()
    if rewards_seen:
        k = max(1, len(rewards_seen) // 5)
        summary["train_reward_first"] = float(np.mean(rewards_seen[:k]))
        summary["train_reward_last"] = float(np.mean(rewards_seen[-k:]))
    summary.update(end_step=step, metrics=str(writer.path))
    if "val_reward_before" in summary and "val_reward_after" in summary:
        log_fn(
            f"summary: held-out reward (sampled at T={rcfg.temperature}) "
            f"{summary['val_reward_before']:.3f} -> {summary['val_reward_after']:.3f}, greedy "
            f"{summary['val_greedy_reward_before']:.3f} -> "
            f"{summary['val_greedy_reward_after']:.3f}, over steps {start_step}..{step}"
        )
    if rewards_seen:
        log_fn(
            f"summary: sampled (training) reward {summary['train_reward_first']:.3f} in the "
            f"first fifth of the steps -> {summary['train_reward_last']:.3f} in the last fifth"
        )
    if tcfg.plot and step > start_step:
        summary["plot"] = str(
            plot_metrics(
                writer.path,
                run_dir / "metrics.png",
                [
                    "critic/score/mean",
                    "val/reward_mean",
                    "val/greedy_reward_mean",
                    "response_length/mean",
                    "correction/masked_token_fraction",
                    "dgg/z",
                ],
            )
        )
    return summary


def _val_line(val: dict) -> str:
    return (
        f"held-out reward {val['val/reward_mean']:.3f} (sampled), "
        f"{val['val/greedy_reward_mean']:.3f} (greedy)"
    )


def _progress(tcfg: TrainConfig, start: int):
    if not tcfg.progress or tcfg.steps <= start:
        return None
    from tqdm import tqdm

    return tqdm(total=tcfg.steps, initial=start, desc="train", unit="step", file=sys.stderr)


def _jsonable(x):
    """grain iterator states as JSON (bytes become latin-1 strings, tagged)."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def _config_dict(cfg) -> dict:
    from sparserl_jax.config import to_dict

    return to_dict(cfg)


def main(argv: list[str] | None = None) -> int:
    """`python -m sparserl_jax.train CONFIG [key=value ...]` (same as `sparserl train`)."""
    from sparserl_jax.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
