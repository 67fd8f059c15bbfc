"""What the decoupled jobs exchange, as records: a work item, a claim, a rollout and the
rollout's blob format (one `.npz`, no pickle). `decoupled.exchange` stores them."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import numpy as np

from sparserl_jax.data import Example
from sparserl_jax.rollout import RolloutResult

__all__ = [
    "Claim",
    "CorruptRolloutError",
    "Rollout",
    "WorkItem",
    "decode_rollout",
    "encode_rollout",
    "token_staleness",
]


class CorruptRolloutError(ValueError):
    """A rollout blob whose bytes do not match the checksum in its READY marker (or that does
    not decode)."""


def loads(raw: bytes | str) -> Any:
    """A JSON record read from the exchange: its first JSON document, whatever follows it.
    TensorStore's file driver writes a value into `<key>.__lock` and renames it into place; a
    writer killed with -9 before the rename leaves that file behind, and the next writer of the
    key rewrites it from offset 0 without cutting it, so a shorter value keeps the dead one's
    tail (seen: a restarted trainer's item 7 followed by 40 bytes of its predecessor's). Every
    record is written whole from offset 0, so its first document is the value written."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return json.JSONDecoder().raw_decode(text.lstrip())[0]


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """A few prompts' groups to roll out (`async.groups_per_item`), prompts `first ..
    first + len(prompts) - 1` of data batch `batch` (its position in the data iterator) of
    `batch_size` prompts. A re-issued item keeps its batch, place, prompts and seeds.
    `min_version`: the oldest weight version a sampler may use for it; `reissue_of`: the
    dropped item whose prompts these are."""

    id: int
    batch: int
    epoch: int
    prompts: list[list[int]]
    seeds: list[int]
    examples: list[Example]
    min_version: int
    reissue_of: int | None = None
    first: int = 0
    batch_size: int = 0

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        return json.dumps(d).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> WorkItem:
        d = loads(raw)
        d["examples"] = [Example(**{**e, "numbers": tuple(e["numbers"])}) for e in d["examples"]]
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Claim:
    """A sampler's hold on an item: `generation` is the kvstore generation it last wrote."""

    item: int
    sampler: str
    renewals: int
    generation: bytes


@dataclasses.dataclass(frozen=True)
class Rollout:
    """A rollout blob, decoded: the result and who made it with which weights.
    `weight_version` is the oldest version it used and `state_digest` that version's digest;
    `versions`: every version it used (weights taken mid-rollout) with its digest."""

    item: int
    sampler: str
    epoch: int
    weight_version: int
    state_digest: str
    result: RolloutResult
    versions: dict[int, str] | None = None

    def used(self) -> dict[int, str]:
        """Every weight version this rollout sampled with, and its weights' digest."""
        return self.versions or {self.weight_version: self.state_digest}


_ARRAYS = (
    "completion_ids",
    "sampler_logprobs",
    "completion_mask",
    "prompt_lens",
    "completion_lens",
    "tokens_evicted",
    "weight_version",
    "finished_by_stop",
)
# Present when the sampler kept them: the eviction record (`rollout.record_evictions`), the
# first token after an eviction (a compressed cache), each token's weight version.
_OPTIONAL = ("evict_pos", "first_evicted", "token_version")


def encode_rollout(r: Rollout) -> bytes:
    """A rollout as one `.npz` (no pickle): its arrays, the prompts padded, a JSON header."""
    res = r.result
    lens = np.asarray(res.prompt_lens, np.int32)
    prompts = np.zeros((len(res.prompt_ids), int(lens.max(initial=0))), np.int32)
    for i, p in enumerate(res.prompt_ids):
        prompts[i, : len(p)] = p
    meta = {
        "item": r.item,
        "sampler": r.sampler,
        "epoch": r.epoch,
        "weight_version": r.weight_version,
        "state_digest": r.state_digest,
        "versions": None if r.versions is None else {str(v): d for v, d in r.versions.items()},
        "stats": {k: v for k, v in res.stats.items() if isinstance(v, (int, float, str, bool))},
    }
    buf = io.BytesIO()
    np.savez(
        buf,
        meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
        prompt_ids=prompts,
        **{k: np.asarray(getattr(res, k)) for k in _ARRAYS},
        **{
            k: np.asarray(getattr(res, k), np.int32)
            for k in _OPTIONAL
            if getattr(res, k) is not None
        },
    )
    return buf.getvalue()


def decode_rollout(blob: bytes) -> Rollout:
    """The inverse of `encode_rollout`; a blob that does not decode is `CorruptRolloutError`."""
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes())
            arrays = {k: z[k] for k in _ARRAYS}
            for k in _OPTIONAL:
                arrays[k] = z[k] if k in z.files else None
            prompts = z["prompt_ids"]
    except (ValueError, KeyError, OSError, EOFError) as e:
        raise CorruptRolloutError(f"rollout blob does not decode: {e}") from None
    lens = arrays["prompt_lens"]
    result = RolloutResult(
        prompt_ids=[prompts[i, : int(n)].tolist() for i, n in enumerate(lens)],
        stats=meta["stats"],
        **arrays,
    )
    versions = meta.get("versions")
    return Rollout(
        meta["item"],
        meta["sampler"],
        meta["epoch"],
        meta["weight_version"],
        meta["state_digest"],
        result,
        None if versions is None else {int(v): d for v, d in versions.items()},
    )


def token_staleness(result: RolloutResult, version: int) -> dict[str, float]:
    """Per completion token, the version trained minus the version it was sampled with, and the
    fraction of sequences whose tokens came from more than one version (weights taken
    mid-rollout)."""
    if result.token_version is None:  # a blob from before per-token versions
        return {}
    mask = result.completion_mask
    tv = np.where(mask, result.token_version, 0)
    stale = (version - tv)[mask]
    lo = np.where(mask, tv, np.iinfo(np.int32).max).min(axis=1)
    return {
        "async/token_staleness_mean": float(stale.mean()) if stale.size else 0.0,
        "async/token_staleness_max": int(stale.max(initial=0)),
        "async/spanning_versions_fraction": float(np.mean(tv.max(axis=1) > lo)),
    }
