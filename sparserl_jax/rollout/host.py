"""The rollout engine's host-side bookkeeping between its device programs (numpy only):
admitting waiting requests into free slots within the page pool, collecting finished slots'
eviction records, and the inputs that rebuild slots for weights taken mid-rollout.

Partial rollouts (`RolloutEngine.generate(refresh=...)`): between decode chunks the engine may
take newer weights and continue every sequence in flight with them. Either the cached keys and
values stay those of the weights that computed them (the cheap way, PipelineRL's), or each
sequence is prefilled again with the new weights (`recompute_cache`, a dense cache only; verl's
and slime's way), after which its tokens follow the new weights' teacher-forced policy exactly.
Either way each token records the version whose logits it was sampled from, and its behaviour
logprob is that policy's.
"""

from __future__ import annotations

import jax
import numpy as np

from sparserl_jax.kvcache.paged import PoolExhaustedError
from sparserl_jax.models.transformer import check_token_ids

__all__ = ["admit", "check_prompts", "request_table", "so_far", "take_record"]


def check_prompts(prompts, seeds, max_prompt_len: int, vocab_size: int, n_samples: int) -> None:
    """One clear line for prompts the engine cannot take (empty, too long, out-of-vocabulary
    ids), seeds that do not match them, or no completion asked for per prompt."""
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    if not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}")
    for i, p in enumerate(prompts):
        if not 1 <= len(p) <= max_prompt_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; allowed 1..max_prompt_len={max_prompt_len}"
            )
        check_token_ids(p, vocab_size, f"prompt {i}")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts (one each)")
    if seeds is not None and any(not 0 <= int(x) < 2**32 for x in seeds):
        raise ValueError(f"seeds must be in [0, 2**32), got {list(seeds)}")


def request_table(num_prompts: int, n: int, seed: int, seeds) -> np.ndarray:
    """Per request `i * n + j` (sample j of prompt i): (seed, prompt index, sample index, seed
    is per-prompt), `[num_prompts * n, 4]`; keys are derived from these inside prefill, so
    nothing here runs (or compiles) eagerly."""
    num_req = num_prompts * n
    req_r4 = np.zeros((num_req, 4), np.int64)
    req_r4[:, 0] = seed if seeds is None else np.repeat(np.asarray(seeds, np.int64), n)
    req_r4[:, 1] = np.arange(num_req) // n
    req_r4[:, 2] = np.arange(num_req) % n
    req_r4[:, 3] = seeds is not None
    return req_r4


def admit(slot_req, waiting, free_pages, pages_s, per_slot: int, pool_pages: int) -> np.ndarray:
    """Put waiting requests into free slots (`slot_req[slot] = request`, in place) while the
    pool can still give every live slot (and the new one) its worst case of `per_slot` pages;
    returns the slots to prefill."""
    live = slot_req >= 0
    reserve = int(np.sum(np.where(live, per_slot - pages_s, 0)))
    budget = int(free_pages) - reserve
    fill = np.zeros(slot_req.shape, bool)
    for slot in np.flatnonzero(~live):
        if not waiting or budget < per_slot:
            break
        slot_req[slot] = waiting.pop(0)
        fill[slot] = True
        budget -= per_slot
    if not fill.any() and not live.any() and waiting:
        raise PoolExhaustedError(
            f"the pool ({pool_pages} pages) cannot hold one sequence ({per_slot} pages)"
        )
    return fill


def take_record(record, evict_ybkt, done_s: np.ndarray, reqs: np.ndarray, num_req: int):
    """The eviction records of the slots that finished (`done_s`), stored at their requests."""
    got = np.asarray(jax.device_get(evict_ybkt[:, np.flatnonzero(done_s)]))  # [Y', n, K', T]
    if record is None:
        record = np.zeros((num_req, got.shape[0]) + got.shape[2:], np.int32)
    record[reqs] = got.transpose(1, 0, 2, 3)
    return record


def so_far(prompts, out_tok, lens, slot_req, req_r4, width: int):
    """The prefill inputs that rebuild every slot holding a request (`slot_req >= 0`) from its
    sequence so far: prompt then the completion tokens sampled (`out_tok[r, :lens[r]]`),
    padded to `width`; with each slot's length and request record (seed, prompt, sample)."""
    s = len(slot_req)
    n = len(req_r4) // len(prompts)
    tokens_sp = np.zeros((s, width), np.int32)
    lens_s = np.zeros(s, np.int32)
    req_s4 = np.zeros((s, 4), np.int64)
    for slot in np.flatnonzero(slot_req >= 0):
        r = slot_req[slot]
        seq = [*prompts[r // n], *out_tok[r, : lens[r]].tolist()]
        tokens_sp[slot, : len(seq)] = seq
        lens_s[slot] = len(seq)
        req_s4[slot] = req_r4[r]
    return tokens_sp, lens_s, req_s4.astype(np.uint32)
