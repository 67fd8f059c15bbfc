"""The rollout engine: jitted prefill and chunked decode on the paged cache, continuous batching.

    engine = RolloutEngine(model, RolloutConfig(num_slots=8, max_new_tokens=128, n_samples=4))
    result = engine.generate(prompts, params=published_bf16_params, weight_version=v)

Device side, two jitted programs, traced once per engine (shapes are fixed by the config, the
cache and the decode state are donated, the weights are an argument, so new weights never
recompile):
- `prefill`: the prompts of the slots being filled, padded to `max_prompt_len`, go through
  `model.decode` `prefill_chunk` slots at a time (a loop over the filled slots only; other
  slots are untouched), each over the first pages of its (empty) slot, so its temporaries are
  bounded by the chunk, not by the slots or their capacity; only the logits of each prompt's
  last token are computed, and kept for the first sample. The page pools are updated in place.
- `chunk`: a `lax.while_loop` of up to `chunk_steps` decode steps, stopping early when every slot
  is idle. A step samples one token per live slot from its kept logits (per-request keys, so a
  request's tokens do not depend on its slot), records token and logprob, ends the slot on a stop
  token or at `max_new_tokens` (its pages go back to the pool in the same step), feeds the other
  tokens through `model.decode`, and compresses the rows that are due (`kvcache.compress`:
  length > budget and the step counter on the interval).

Host side, one sync per chunk (a single `device_get` of the chunk's tokens, the slot states and
the pool's free count): finished slots hand their rows to the result; waiting requests are
admitted into free slots while the pool can still give every live slot its worst case, so the
pool never overflows and memory is bounded by the pool, not by batch x max length.

On a mesh (`mesh=`, weights laid out by `parallel.sharding`): heads, MLP columns and vocabulary
split over `tensor`, pools over KV heads where their count divides by it; over `data` (and
`fsdp` with `rollout.fsdp_shards`: weights split over it, never gathered) each shard holds its
own slots, pages and free-page stack and runs the programs on them (`rollout.shards`); tokens
as one device's for the same keys.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sparserl_jax.kvcache import (
    PagedKVCache,
    compress,
    paged_cache_for,
    release_slots,
    should_compress,
)
from sparserl_jax.kvcache.config import cdiv
from sparserl_jax.kvcache.evictions import NEVER, reset_rows
from sparserl_jax.kvcache.paged import PoolExhaustedError
from sparserl_jax.kvcache.rows import merge_slot_rows, set_slot_rows, slot_rows
from sparserl_jax.rollout.config import (
    ChunkOut,
    RolloutAborted,
    RolloutConfig,
    RolloutResult,
    SlotState,
)
from sparserl_jax.rollout.host import check_prompts, request_table, so_far, take_record
from sparserl_jax.rollout.sampling import request_keys, sample, step_keys
from sparserl_jax.rollout.shards import (
    any_slot,
    data_shards,
    engine_parts,
    flat_slots,
    jit_programs,
    shard_admit,
    shard_max,
    slot_record,
    weight_specs,
)


class RolloutEngine:
    """Samples completions for token-id prompts with a fixed number of slots (module docstring).

    `model` is an NNX `Transformer`; its graph is kept, its weights are the default `params`.
    """

    def __init__(self, model: nnx.Module, config: RolloutConfig, *, mesh: Mesh | None = None):
        self.config = config
        self.mesh = mesh
        self.graphdef, state = nnx.split(model)
        self.model_cfg = model.cfg
        bad = [t for t in config.stop_token_ids if t >= model.cfg.vocab_size]
        if bad:  # the eos of another vocabulary: no completion would ever stop on it
            raise ValueError(
                f"rollout.stop_token_ids: {bad[0]} is outside the model's vocabulary "
                f"[0, {model.cfg.vocab_size})"
            )
        self.default_params = nnx.to_pure_dict(state)
        self.stop_ids = jnp.asarray(list(config.stop_token_ids) or [-1], jnp.int32)
        fsdp = config.fsdp_shards  # data shards and how they hold the weights (`rollout.shards`)
        self.data, specs = data_shards(mesh, fsdp), weight_specs(state, mesh, fsdp)
        self._parts = engine_parts(specs, model.cfg.hidden_size, mesh)
        self._page_bytes = jax.eval_shape(self._empty)[0].page_bytes
        self._init, self._prefill, self._chunk, self._refill = jit_programs(
            mesh,
            config,
            self._empty,
            {"prefill": self._prefill_impl, "chunk": self._chunk_impl, "refill": self._refill_impl},
            specs,
        )

    # ---- device programs -------------------------------------------------------------------

    def _prefill_impl(self, params, cache, slots: SlotState, tokens_sp, lens_s, fill_s, req_s4):
        decode = functools.partial(nnx.merge(self.graphdef, params).decode, parts=self._parts)
        # req_s4 = (seed, prompt index, sample index, per-prompt seed?) of each filled slot.
        keys_s2 = request_keys(
            req_s4[:, 0].astype(jnp.uint32), req_s4[:, 1], req_s4[:, 2], req_s4[:, 3] > 0
        )
        s, p = tokens_sp.shape
        g = min(max(1, self.config.prefill_chunk // self._parts.shards), s)
        # The filled slots first (in slot order, so pages are handed out as in one call), in
        # groups of g; the padding index s reads row s - 1 and writes nothing (mode="drop").
        order_r = jnp.argsort(~fill_s, stable=True).astype(jnp.int32)
        order_r = jnp.concatenate([order_r, jnp.full((cdiv(s, g) * g - s,), s, jnp.int32)])
        num_fill = jnp.sum(fill_s.astype(jnp.int32))
        num_fill = shard_max(num_fill, self.data)  # every shard runs the same groups
        # A filled slot is empty (new or released), so its prompt lands in its first pages:
        # each group attends over those, not over the slot's whole capacity.
        cols = min(cache.page_table.shape[1], cdiv(p, cache.page_size))
        last_s = jnp.maximum(lens_s - 1, 0)
        steps = cache.steps
        if cache.evict_pos is not None:  # the filled slots start sequences: nothing evicted
            cache = dataclasses.replace(cache, evict_pos=reset_rows(cache.evict_pos, fill_s))

        def group(carry):
            i, cache, logits_sv = carry
            rows_g = jax.lax.dynamic_slice(order_r, (i * g,), (g,))
            read_g = jnp.minimum(rows_g, s - 1)
            fill_g = (rows_g < s) & fill_s[read_g]
            mask_gp = (jnp.arange(p, dtype=jnp.int32)[None, :] < lens_s[read_g][:, None]) & (
                fill_g[:, None]
            )
            sub = slot_rows(cache, read_g, cols)
            # Only each prompt's last token's logits are needed (never [S, P, V]): the KV
            # policies' window scoring reads the queries the cache records, not logits.
            logits_g1v, sub = decode(tokens_sp[read_g], sub, mask_gp, last_s[read_g][:, None])
            write_g = jnp.where(fill_g, rows_g, s)  # rows not filled keep their state
            cache = set_slot_rows(cache, sub, write_g, cols)
            logits_sv = logits_sv.at[write_g].set(logits_g1v[:, 0].astype(jnp.float32), mode="drop")
            return i + 1, cache, logits_sv

        if g == s:  # one group holds every slot: no loop, no gather of rows
            mask_sp = (jnp.arange(p, dtype=jnp.int32)[None, :] < lens_s[:, None]) & fill_s[:, None]
            sub = dataclasses.replace(cache, page_table=cache.page_table[:, :cols])
            logits_s1v, sub = decode(tokens_sp, sub, mask_sp, last_s[:, None])
            cache = merge_slot_rows(cache, sub, fill_s, cols)
            logits_sv = jnp.where(
                fill_s[:, None], logits_s1v[:, 0].astype(jnp.float32), slots.logits_sv
            )
        else:
            carry = (jnp.int32(0), cache, slots.logits_sv)
            _, cache, logits_sv = jax.lax.while_loop(lambda x: x[0] * g < num_fill, group, carry)
        # A prefill is one step of the batch's counter (compression interval), however many groups.
        cache = dataclasses.replace(cache, steps=steps + 1)
        zero_s = jnp.zeros_like(slots.generated_s)
        slots = SlotState(
            logits_sv=logits_sv,
            keys_s2=jnp.where(fill_s[:, None], keys_s2, slots.keys_s2),
            active_s=slots.active_s | fill_s,
            generated_s=jnp.where(fill_s, zero_s, slots.generated_s),
            stopped_s=slots.stopped_s & ~fill_s,
            evicted_s=jnp.where(fill_s, zero_s, slots.evicted_s),
            first_evicted_s=jnp.where(fill_s, NEVER, slots.first_evicted_s),
        )
        return cache, slots

    def _refill_impl(self, params, cache, slots: SlotState, tokens_sp, lens_s, fill_s, req_s4):
        """The slots in `fill_s` rebuilt from their whole sequence so far (`tokens_sp`, prompt
        and completion) with `params`: pages released, prefilled again, the kept logits the new
        weights'; they go on counting their completion tokens where they were."""
        generated_s = slots.generated_s
        cache = release_slots(cache, fill_s)
        cache, slots = self._prefill_impl(params, cache, slots, tokens_sp, lens_s, fill_s, req_s4)
        return cache, slots._replace(generated_s=jnp.where(fill_s, generated_s, slots.generated_s))

    def _step(self, model, cache: PagedKVCache, slots: SlotState):
        cfg = self.config
        keys = step_keys(slots.keys_s2, slots.generated_s)
        tok_s, logp_s = sample(
            slots.logits_sv, keys, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p
        )
        emit_s = slots.active_s
        tok_s = jnp.where(emit_s, tok_s, 0)
        logp_s = jnp.where(emit_s, logp_s, 0.0)
        generated_s = slots.generated_s + emit_s.astype(jnp.int32)
        stop_s = emit_s & jnp.isin(tok_s, self.stop_ids)
        finish_s = emit_s & (stop_s | (generated_s >= cfg.max_new_tokens))
        live_s = emit_s & ~finish_s
        # The logits this decode computes sample token `generated_s`: after an eviction when
        # the cache it reads has lost an entry already.
        hit_s = live_s & (cache.evicted_b > 0) & (slots.first_evicted_s == NEVER)
        first_evicted_s = jnp.where(hit_s, generated_s, slots.first_evicted_s)
        logits_s1v, cache = model.decode(tok_s[:, None], cache, live_s[:, None], parts=self._parts)
        evicted_s = jnp.where(finish_s, cache.evicted_b, slots.evicted_s)
        # A finished sequence gives its pages back in the step it ends, not at the chunk's end.
        # Unconditional (a no-op when nothing finished): it touches only the small page-table
        # arrays, while a `lax.cond` over the cache would carry (and may copy) the page pools.
        cache = release_slots(cache, finish_s)
        slots = SlotState(
            logits_sv=jnp.where(live_s[:, None], logits_s1v[:, 0], slots.logits_sv),
            keys_s2=slots.keys_s2,
            active_s=live_s,
            generated_s=generated_s,
            stopped_s=slots.stopped_s | stop_s,
            evicted_s=evicted_s,
            first_evicted_s=first_evicted_s,
        )
        return cache, slots, (tok_s, logp_s, emit_s)

    def _chunk_impl(self, params, cache, slots: SlotState):
        model = nnx.merge(self.graphdef, params)
        s, c = slots.active_s.shape[0], self.config.chunk_steps
        out = ChunkOut(
            jnp.zeros((s, c), jnp.int32), jnp.zeros((s, c), jnp.float32), jnp.zeros((s, c), bool)
        )

        def steps_left(i, slots):  # over every data shard: all run the same steps
            return (i < c) & any_slot(slots.active_s, self.data)

        def body(carry):
            i, cache, slots, out = carry
            cache, slots, (tok_s, logp_s, emit_s) = self._step(model, cache, slots)
            out = ChunkOut(
                out.tokens_sc.at[:, i].set(tok_s),
                out.logp_sc.at[:, i].set(logp_s),
                out.emit_sc.at[:, i].set(emit_s),
            )
            return i + 1, cache, slots, out

        carry = (jnp.int32(0), cache, slots, out)
        if not self.config.sparse:
            carry = jax.lax.while_loop(lambda x: steps_left(x[0], x[2]), body, carry)
        else:
            kv = self.config.kv

            # Decode until a compression is due (a row above budget with the step counter on
            # the interval), then compress, outside the inner loop: the compression's
            # `lax.cond` carries the page pools, so it runs once per compression instead of
            # once per step. Same order of operations as compressing after every step.
            def segment(carry):
                carry = jax.lax.while_loop(
                    lambda x: (
                        steps_left(x[0], x[2]) & ~any_slot(should_compress(x[1], kv), self.data)
                    ),
                    body,
                    carry,
                )
                i, cache, slots, out = carry
                any_due = functools.partial(any_slot, d=self.data)
                return i, compress(cache, kv, any_due=any_due), slots, out

            carry = jax.lax.while_loop(lambda x: steps_left(x[0], x[2]), segment, carry)
        _, cache, slots, out = carry
        return cache, slots, out

    # ---- host loop -------------------------------------------------------------------------

    def _empty(self) -> tuple[PagedKVCache, SlotState]:
        """The empty cache and slot state (one data shard's: its slots and pages)."""
        cfg, mcfg = self.config, self.model_cfg
        s = cfg.num_slots // self.data
        cache = paged_cache_for(
            mcfg,
            cfg.compression,
            batch=s,
            max_len=cfg.max_len,
            prompt_len=cfg.max_prompt_len,
            page_size=cfg.page_size,
            num_pages=cfg.pool_pages // self.data,
            mesh=self.mesh,
            record_evictions=cfg.record_evictions,
            impl=cfg.kernel_impl,
        )
        zero_s = jnp.zeros((s,), jnp.int32)
        slots = SlotState(
            logits_sv=jnp.zeros((s, mcfg.vocab_size), jnp.float32),
            keys_s2=jnp.zeros((s, 2), jnp.uint32),
            active_s=jnp.zeros((s,), bool),
            generated_s=zero_s,
            stopped_s=jnp.zeros((s,), bool),
            evicted_s=zero_s,
            first_evicted_s=jnp.full((s,), NEVER, jnp.int32),
        )
        return cache, slots

    def warmup(self, params: Any = None) -> None:
        """Compile prefill and chunk ahead of time (on an idle batch: nothing is generated)."""
        params = self.default_params if params is None else params
        s, p = self.config.num_slots, self.config.max_prompt_len
        cache, slots = self._init()
        none_s = np.zeros(s, bool)
        cache, slots = self._prefill(
            params,
            cache,
            slots,
            np.zeros((s, p), np.int32),
            np.zeros(s, np.int32),
            none_s,
            np.zeros((s, 4), np.uint32),
        )
        jax.block_until_ready(self._chunk(params, cache, slots))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        params: Any = None,
        weight_version: int = 0,
        seeds: Sequence[int] | None = None,
        stop: Callable[[], bool] | None = None,
        refresh: Callable[[], tuple[Any, int] | None] | None = None,
        recompute_cache: bool = False,
        n_samples: int | None = None,
    ) -> RolloutResult:
        """Sample `n_samples` completions of every prompt (the config's unless given here; see
        `RolloutResult` for the layout: a call's group size changes no compiled program).

        `params`: an `nnx` pure dict of the model state (e.g. the published bf16 weights);
        None uses the model's own. `seeds`: one per prompt (default: derived from config.seed).
        `stop`: asked between decode chunks; True abandons the rollout (`RolloutAborted`).
        `refresh`: asked between decode chunks; `(params, version)` of newer weights continues
        every sequence in flight with them (partial rollouts). The cached keys and values stay
        those of the weights that computed them, or with `recompute_cache` (a dense cache only)
        each sequence is prefilled again with the new weights, so its later tokens follow
        their teacher-forced policy. Each token records the version of the weights whose
        logits it was sampled from (`token_version`).
        """
        cfg = self.config
        if recompute_cache and cfg.sparse:
            raise ValueError(
                "recompute_cache needs a dense cache: a compressed one cannot be rebuilt from "
                "the sequence without replaying its evictions"
            )
        n = cfg.n_samples if n_samples is None else n_samples
        check_prompts(prompts, seeds, cfg.max_prompt_len, self.model_cfg.vocab_size, n)
        params = self.default_params if params is None else params
        start = time.perf_counter()
        req_r4 = request_table(len(prompts), n, cfg.seed, seeds)
        num_req = len(req_r4)
        out_tok = np.zeros((num_req, cfg.max_new_tokens), np.int32)
        out_logp = np.zeros((num_req, cfg.max_new_tokens), np.float32)
        lens = np.zeros(num_req, np.int32)
        evicted = np.zeros(num_req, np.int32)
        first_evicted = np.full(num_req, NEVER, np.int32)
        stopped = np.zeros(num_req, bool)
        record = None  # [R, Y', K', T] when recording evictions
        version = weight_version
        out_ver = np.zeros((num_req, cfg.max_new_tokens), np.int32)

        cache, slots = self._init()
        s = cfg.num_slots
        slot_req = np.full(s, -1, np.int64)
        logits_ver = np.full(s, version, np.int64)  # the weights each slot's kept logits came from
        waiting = list(range(num_req))
        free_d, pages_s = np.full(self.data, cfg.pool_pages // self.data), np.zeros(s, np.int64)
        chunks = 0
        while waiting or (slot_req >= 0).any():
            newer = refresh() if refresh is not None and chunks else None
            if newer is not None:
                params, version = newer
                live = slot_req >= 0
                if recompute_cache and live.any():
                    width = cfg.max_prompt_len + cfg.max_new_tokens
                    tok_sp, len_s, req_s = so_far(prompts, out_tok, lens, slot_req, req_r4, width)
                    cache, slots = self._refill(params, cache, slots, tok_sp, len_s, live, req_s)
                    logits_ver[live] = version
            fill = shard_admit(slot_req, waiting, free_d, pages_s, cfg)
            if fill.any():
                tokens_sp = np.zeros((s, cfg.max_prompt_len), np.int32)
                lens_s = np.zeros(s, np.int32)
                req_s4 = np.zeros((s, 4), np.int64)
                for slot in np.flatnonzero(fill):
                    prompt = prompts[slot_req[slot] // n]
                    tokens_sp[slot, : len(prompt)] = prompt
                    lens_s[slot] = len(prompt)
                    req_s4[slot] = req_r4[slot_req[slot]]
                cache, slots = self._prefill(
                    params, cache, slots, tokens_sp, lens_s, fill, req_s4.astype(np.uint32)
                )
                logits_ver[fill] = version
            if stop is not None and stop():
                raise RolloutAborted(f"rollout abandoned after {chunks} decode chunks")
            cache, slots, out = self._chunk(params, cache, slots)
            chunks += 1
            host = jax.device_get(
                (out, slots.active_s, slots.stopped_s, slots.evicted_s, slots.first_evicted_s)
                + (cache.num_pages_b, cache.free_top, cache.overflow_b)
            )
            out_h, active, stop_s, evicted_s, first_s, pages_s, free_d, overflow = host
            pages_s, overflow = flat_slots(pages_s, self.data), flat_slots(overflow, self.data)
            if overflow.any():  # admission control makes this unreachable; never return garbage
                raise PoolExhaustedError(f"KV pool overflowed in slots {np.flatnonzero(overflow)}")
            done = (slot_req >= 0) & ~active
            if cache.evict_pos is not None and done.any():
                evict_ybkt = slot_record(cache.evict_pos, self.data)
                record = take_record(record, evict_ybkt, done, slot_req[done], num_req)
            for slot in np.flatnonzero(slot_req >= 0):
                r = slot_req[slot]
                emitted = out_h.emit_sc[slot]
                k = int(emitted.sum())
                out_tok[r, lens[r] : lens[r] + k] = out_h.tokens_sc[slot, emitted]
                out_logp[r, lens[r] : lens[r] + k] = out_h.logp_sc[slot, emitted]
                if k:  # the first from logits kept from before this chunk, the rest from its own
                    out_ver[r, lens[r]] = logits_ver[slot]
                    out_ver[r, lens[r] + 1 : lens[r] + k] = version
                    logits_ver[slot] = version
                lens[r] += k
                if not active[slot]:
                    evicted[r], stopped[r] = evicted_s[slot], stop_s[slot]
                    first_evicted[r] = first_s[slot]
                    slot_req[slot] = -1
        seconds = time.perf_counter() - start
        mask = np.arange(cfg.max_new_tokens)[None, :] < lens[:, None]
        peak_pages, peak_tokens = (int(np.sum(x)) for x in (cache.peak_pages, cache.peak_tokens))
        return RolloutResult(
            prompt_ids=[list(map(int, prompts[r // n])) for r in range(num_req)],
            completion_ids=out_tok,
            sampler_logprobs=out_logp,
            completion_mask=mask,
            prompt_lens=np.array([len(prompts[r // n]) for r in range(num_req)], np.int32),
            completion_lens=lens,
            tokens_evicted=evicted,
            weight_version=out_ver[:, 0].copy(),  # its first token's: the oldest it used
            finished_by_stop=stopped,
            evict_pos=record,
            first_evicted=first_evicted if cfg.sparse else None,
            token_version=out_ver,  # written up to each completion's length only: 0 after
            stats={
                "generated_tokens": (generated := int(lens.sum())),
                "seconds": seconds,
                "tokens_per_s": generated / seconds if seconds > 0 else float("nan"),
                "kv_peak_bytes": peak_pages * self._page_bytes,
                "kv_peak_tokens": peak_tokens,
                "chunks": chunks,
            },
        )
