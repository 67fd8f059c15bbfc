"""What a rollout is asked for (`RolloutConfig`) and what it returns (`RolloutResult`)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np

from pallas_kernels._dispatch import IMPLS
from sparserl_jax.kvcache import CompressionConfig, budget_ladder
from sparserl_jax.kvcache.config import cdiv
from sparserl_jax.kvcache.evictions import NEVER


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Settings of a `RolloutEngine` (all static: changing one means a new engine).

    Attributes:
      num_slots: sequences decoded at once; a finished one frees its slot and pages at once and a
        waiting request is prefilled into it between chunks (continuous batching).
      max_prompt_len: the longest prompt accepted (prompts are padded to it for prefill).
      max_new_tokens: completion tokens per request at most (the stop token counts).
      temperature: softmax temperature T; 0 is greedy (logprobs then use T = 1).
      top_k: keep the k most likely tokens when sampling (0: off).
      top_p: nucleus sampling mass (1: off). Truncation changes what is sampled, never the
        recorded logprob (`log softmax(logits / T)`, the logprob contract of
        `rollout.sampling`).
      stop_token_ids: a completion ends after the first of these (it is included).
      n_samples: completions per prompt (a GRPO group), rows `i * n_samples + j`.
      chunk_steps: decode steps per jitted chunk; the host syncs once per chunk.
      prefill_chunk: slots prefilled together in one step of the prefill program (its loop
        runs over the slots being filled, this many at a time), so prefill's temporaries
        (activations, the prompt's attention scores) are bounded by this many prompts, not by
        `num_slots`. Over an `fsdp` mesh axis each shard fills prefill_chunk / fsdp at a time
        (its matmuls take every fsdp shard's rows). Results do not depend on it.
      seed: the run seed; request keys derive from `(seed, i, j)` unless per-prompt seeds given.
      kv: KV compression; None or policy "none" keeps every token (dense). `kv.adaptive`
        moves its budget between RL steps over `kv_ladder` (one engine per rung).
      record_evictions: return, per request, when each cached position was evicted
        (`RolloutResult.evict_pos`, `kvcache.evictions`), for a learner that replays the
        sampler's attention (`learner.attention_mask=replay`).
      page_size: tokens per KV page.
      num_pages: pages in the pool; None sizes it for `num_slots` slots at their worst case.
      fsdp_shards: on a mesh, split the slots and pages over its `fsdp` axis too (as over
        `data`) and run the weights from their fsdp parts, never gathered (`rollout.shards`);
        for weights that do not fit a chip. Off, fsdp-split weights are left to XLA.
      kernel_impl: what the KV cache's ops run (`pallas_kernels`): "auto" (the Mosaic kernels
        on TPU, the Triton kernels on GPU, XLA on CPU; `SPARSERL_KERNEL_IMPL` overrides it),
        "xla", "pallas_tpu" or "pallas_gpu". Unlike the environment variable it leaves the
        learner's attention choice alone.
    """

    num_slots: int = 8
    max_prompt_len: int = 64
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    n_samples: int = 1
    chunk_steps: int = 16
    prefill_chunk: int = 4
    seed: int = 0
    kv: CompressionConfig | None = None
    record_evictions: bool = False
    page_size: int = 16
    num_pages: int | None = None
    fsdp_shards: bool = False
    kernel_impl: str = "auto"

    def __post_init__(self):
        for name in (
            "num_slots",
            "max_prompt_len",
            "max_new_tokens",
            "n_samples",
            "chunk_steps",
            "prefill_chunk",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if isinstance(self.stop_token_ids, list):  # from YAML / the CLI
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.stop_token_ids, tuple) or any(
            not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a tuple of token ids >= 0, got {self.stop_token_ids!r}"
            )
        if self.kv is not None and not isinstance(self.kv, CompressionConfig):
            raise ValueError(f"kv must be a CompressionConfig or None, got {type(self.kv)}")
        if self.kernel_impl not in IMPLS:
            raise ValueError(f"kernel_impl must be one of {IMPLS}, got {self.kernel_impl!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < self.pages_per_slot:
            raise ValueError(
                f"num_pages={self.num_pages} cannot hold one sequence: a slot can need "
                f"{self.pages_per_slot} pages (max_prompt_len + max_new_tokens, or the "
                "compression budget + interval); use None to size the pool automatically"
            )

        if self.sparse and self.kv.adaptive.enabled:
            # Validates the ladder now, with the rollout length, and a fixed num_pages against
            # the top rung's worst case.
            self.with_budget(self.kv_ladder[-1])

    @property
    def kv_ladder(self) -> tuple[int, ...]:
        """The budgets `kv.adaptive` may pick (`kvcache.budget_ladder`)."""
        return budget_ladder(self.kv, page_size=self.page_size, max_len=self.max_len)

    def with_budget(self, budget: int) -> RolloutConfig:
        """This config at KV budget `budget`, with the controller off (what one engine runs)."""
        kv = dataclasses.replace(self.kv, budget=budget, adaptive=type(self.kv.adaptive)())
        return dataclasses.replace(self, kv=kv)

    @property
    def sparse(self) -> bool:
        return self.kv is not None and self.kv.policy != "none"

    @property
    def compression(self) -> CompressionConfig:
        """The cache's compression config (policy "none" when dense)."""
        return self.kv if self.kv is not None else CompressionConfig(policy="none")

    @property
    def max_len(self) -> int:
        return self.max_prompt_len + self.max_new_tokens

    @property
    def pages_per_slot(self) -> int:
        """The most pages one sequence can hold at once."""
        full = cdiv(self.max_len, self.page_size)
        if not self.sparse:
            return full
        return min(full, self.kv.pages_per_slot(self.page_size, self.max_prompt_len))

    @property
    def pool_pages(self) -> int:
        return (
            self.num_pages if self.num_pages is not None else self.num_slots * self.pages_per_slot
        )


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """Per request (row `i * n_samples + j` = sample j of prompt i), numpy arrays.

    `completion_ids[r, :completion_lens[r]]` is the completion (stop token included when it
    ended on one), 0 after; `completion_mask` marks exactly those tokens and `sampler_logprobs`
    holds their `log softmax(logits / T)` (0 elsewhere). `tokens_evicted` counts the KV entries
    the compression dropped while it was generated; `weight_version` the weights it sampled with.
    `stats`: generated_tokens, seconds, tokens_per_s, kv_peak_bytes (peak pages in use x bytes
    per page), kv_peak_tokens (peak tokens kept, all slots: the paper's count), chunks.
    `evict_pos` (with `RolloutConfig.record_evictions`, else None): int32 `[R, Y', K', T]`, the
    first position that no longer saw each position's key (`kvcache.evictions`), T =
    max_prompt_len + max_new. `first_evicted` (a compressed cache,
    else None): int32 `[R]`, the index of the first completion token sampled from logits that
    an eviction had already affected (`NEVER` = int32 max when nothing was evicted in time).
    `token_version` (int32 `[R, max_new]`, 0 after the completion; None from older blobs): the
    weight version whose logits each token was sampled from; with weights taken mid-rollout
    (partial rollouts) a row spans several, and `weight_version` is its first token's, the
    oldest.
    """

    prompt_ids: list[list[int]]
    completion_ids: np.ndarray  # int32 [R, max_new]
    sampler_logprobs: np.ndarray  # float32 [R, max_new]
    completion_mask: np.ndarray  # bool [R, max_new]
    prompt_lens: np.ndarray  # int32 [R]
    completion_lens: np.ndarray  # int32 [R]
    tokens_evicted: np.ndarray  # int32 [R]
    weight_version: np.ndarray  # int32 [R]
    finished_by_stop: np.ndarray  # bool [R]
    stats: dict[str, Any]
    evict_pos: np.ndarray | None = None  # int32 [R, Y', K', T]
    first_evicted: np.ndarray | None = None  # int32 [R]
    token_version: np.ndarray | None = None  # int32 [R, max_new]

    def rows(self, lo: int, hi: int) -> RolloutResult:
        """Requests `lo:hi` (whole groups when both are multiples of `n_samples`); `stats` are
        the whole rollout's but for `generated_tokens`, the slice's own."""
        cut = {
            f.name: None if (v := getattr(self, f.name)) is None else v[lo:hi]
            for f in dataclasses.fields(self)
            if f.name != "stats"
        }
        stats = {**self.stats, "generated_tokens": int(cut["completion_lens"].sum())}
        return RolloutResult(**cut, stats=stats)

    @classmethod
    def concat(cls, parts: list[RolloutResult]) -> RolloutResult:
        """The parts' requests in order, as one rollout (the inverse of `rows`): a batch
        assembled from work items rolled out apart. `stats` add up (`seconds` is the longest
        part's, `kv_peak_bytes` and `kv_peak_tokens` the largest, `tokens_per_s` from those)."""
        out = {}
        for f in dataclasses.fields(cls):
            vals = [getattr(p, f.name) for p in parts]
            if f.name == "prompt_ids":
                out[f.name] = [row for v in vals for row in v]
            elif f.name != "stats":
                out[f.name] = None if any(v is None for v in vals) else np.concatenate(vals)
        generated = sum(int(p.stats.get("generated_tokens", 0)) for p in parts)
        seconds = max((float(p.stats.get("seconds", 0.0)) for p in parts), default=0.0)
        stats = {
            "generated_tokens": generated,
            "seconds": seconds,
            "tokens_per_s": generated / seconds if seconds > 0 else float("nan"),
            "kv_peak_bytes": max(int(p.stats.get("kv_peak_bytes", 0)) for p in parts),
            "kv_peak_tokens": max(int(p.stats.get("kv_peak_tokens", 0)) for p in parts),
            "chunks": max(int(p.stats.get("chunks", 0)) for p in parts),
        }
        return cls(**out, stats=stats)

    def sequences(self, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The learner's layout: `tokens_bt` = prompt ++ completion ++ padding (left-aligned,
        width `max(prompt_lens) + max_new`), `mask_bt` on the completion tokens and
        `sampler_logp_bt`, both aligned with `tokens_bt` (entry t is about token t)."""
        r, g = self.completion_ids.shape
        width = int(self.prompt_lens.max()) + g
        tokens = np.full((r, width), pad_id, np.int32)
        mask = np.zeros((r, width), bool)
        logp = np.zeros((r, width), np.float32)
        for row in range(r):
            p, n = int(self.prompt_lens[row]), int(self.completion_lens[row])
            tokens[row, :p] = self.prompt_ids[row]
            tokens[row, p : p + n] = self.completion_ids[row, :n]
            mask[row, p : p + n] = True
            logp[row, p : p + n] = self.sampler_logprobs[row, :n]
        return tokens, mask, logp

    def after_eviction(self, width: int) -> np.ndarray | None:
        """bool `[R, width]` aligned with `sequences()`: the completion tokens sampled after the
        row's first eviction (`first_evicted`); None for a dense rollout. The correction's
        `rho` percentiles run over these tokens (`RLBatch.after_eviction_bt`)."""
        if self.first_evicted is None:
            return None
        g = self.completion_ids.shape[1]
        p = self.prompt_lens.astype(np.int64)[:, None]
        first = np.minimum(self.first_evicted.astype(np.int64), g)[:, None]
        col = np.arange(width)[None, :]
        return (col >= p + first) & (col < p + self.completion_lens[:, None])

    def evictions(self, width: int) -> np.ndarray:
        """`evict_pos` aligned with `sequences()` padded to `width` columns (`NEVER` on the
        padding): the learner's eviction replay input `[R, Y', K', width]`."""
        if self.evict_pos is None:
            raise ValueError(
                "this rollout recorded no evictions: set rollout.record_evictions=true"
            )
        t = self.evict_pos.shape[-1]
        if width <= t:
            return self.evict_pos[..., :width]
        pad = ((0, 0), (0, 0), (0, 0), (0, width - t))
        return np.pad(self.evict_pos, pad, constant_values=NEVER)


class RolloutAborted(RuntimeError):
    """`RolloutEngine.generate` was told to stop (its `stop` hook) before it finished."""


class SlotState(NamedTuple):
    """Per-slot decode state carried between chunks (device arrays, `S` = slots)."""

    logits_sv: jax.Array  # fp32 [S, V]: the logits the slot's next token is sampled from
    keys_s2: jax.Array  # uint32 [S, 2]: the slot's request key
    active_s: jax.Array  # bool [S]: generating
    generated_s: jax.Array  # int32 [S]: completion tokens so far
    stopped_s: jax.Array  # bool [S]: ended on a stop token
    evicted_s: jax.Array  # int32 [S]: tokens evicted, frozen when the slot finishes
    # int32 [S]: index of the first completion token sampled after an eviction (NEVER: none)
    first_evicted_s: jax.Array


class ChunkOut(NamedTuple):
    """What one chunk emitted: `emit_sc[s, c]` marks a token of slot s at chunk step c."""

    tokens_sc: jax.Array
    logp_sc: jax.Array
    emit_sc: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """A plain generation job (`sparserl generate`) on the rollout engine.

    Attributes:
      prompts: the texts to complete (the tokenizer adds its BOS token).
      max_new_tokens: completion tokens per prompt at most (the stop token counts).
      temperature: 0 is greedy. top_k: 0 is off. top_p: 1 is off.
      seed: the sampling seed.
      kv: KV compression while generating (as `rollout.kv`); null keeps every token.
    """

    prompts: tuple[str, ...] = ("1+2=",)
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    kv: CompressionConfig | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"generate.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"generate.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generate.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"generate.top_k must be >= 0, got {self.top_k}")
        if not self.prompts:
            raise ValueError("generate.prompts is empty")
        if self.kv is not None and self.kv.adaptive.enabled:
            raise ValueError(
                "generate.kv.adaptive.enabled: the adaptive budget moves between RL steps "
                "(rollout.kv.adaptive with `sparserl train`); set generate.kv.budget instead"
            )
