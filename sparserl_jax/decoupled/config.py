"""The `exchange:` and `async:` config sections of the decoupled jobs (validated here; the
top-level `sparserl_jax.config` names the section in its errors)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    """Where the decoupled jobs (`sparserl trainer` / `sampler` / `launch`) meet: a TensorStore
    kvstore holding PULSESync patches and anchors, work items, claims and rollout blobs
    (docs/decoupled.md).

    Attributes:
      url: the kvstore (`file:///dir/`, `memory://`, `gs://bucket/dir/`, `s3://...`); null is
        `file://<run_dir>/exchange/`.
      lease_s: a sampler's claim on a work item lapses when it has not renewed it (every
        `lease_s / 4`) for this long, as seen by the trainer's clock; the item is then dropped
        and its prompts re-issued.
      give_up_s: a sampler that cannot reach the exchange, or sees no sign of life from the
        trainer, for this long exits (status 3); it logs why every `log_every_s` meanwhile.
      poll_s: how often a waiting job looks at the exchange again.
      log_every_s: how often a waiting job says so.
      retries: a failed kvstore call is tried this many more times (backoff 0.5 s, doubling,
        at most 8 s) before the job gives up on it with one line naming the call.
      pulse_s: the period of the trainer's heartbeat and of each sampler's pulse: one write
        per object per `pulse_s` (GCS allows about one write per second to one object, so on
        `gs://` and `s3://` it must be >= 1 and claims, renewed every `lease_s / 4`, too).
      endpoint: an `s3://` exchange's server when it is not AWS (MinIO, a cloud's S3 API, a
        local emulator), e.g. `http://127.0.0.1:9000`; the region comes from `AWS_REGION` or
        `AWS_DEFAULT_REGION` (default us-east-1), credentials as tensorstore finds them.
    """

    url: str | None = None
    lease_s: float = 60.0
    give_up_s: float = 600.0
    poll_s: float = 0.2
    log_every_s: float = 30.0
    retries: int = 4
    pulse_s: float = 1.0
    endpoint: str | None = None

    def __post_init__(self):
        for name in ("lease_s", "give_up_s", "poll_s", "log_every_s", "pulse_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {self.retries!r}")
        if (self.url or "").startswith(("gs://", "s3://")) and (
            self.pulse_s < 1.0 or self.lease_s / 4 < 1.0
        ):
            raise ValueError(
                f"on {self.url} an object takes about one write per second: pulse_s "
                f"({self.pulse_s}) and lease_s / 4 ({self.lease_s / 4}, the claims' renewal "
                "period) must be >= 1"
            )
        if self.endpoint is not None and not (self.url or "").startswith("s3://"):
            raise ValueError(
                f"endpoint {self.endpoint!r} is for an s3:// url, got url {self.url!r}"
            )
        if self.url is not None and "://" not in self.url:
            raise ValueError(
                f"url {self.url!r} is not a kvstore URL (file:///dir/, memory://, gs://bucket/dir/)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Asynchrony of the decoupled trainer (`async:` in YAML).

    Attributes:
      max_staleness: the trainer learns from a rollout sampled at most this many weight
        versions behind its current one. It keeps at most `max_staleness + 1` batches' work
        items in flight and tells each the oldest weights it may be sampled with, so sampling
        is paced and nothing is dropped for staleness. 0 is fully synchronous (the same
        batches, seeds and weights as `sparserl train`).
      groups_per_item: prompts per work item (each with its `rollout.n_samples` completions,
        a GRPO group): the unit samplers claim and the trainer re-issues. Samplers share a
        batch at this grain, so N samplers keep busy without more staleness.
      sampler_groups: the most work items a sampler claims and rolls out together (one
        engine call); 0 is its fair share: the items in flight divided by the samplers alive.
      partial_rollouts: a sampler takes newer published weights between decode chunks and
        continues its sequences with them; each token records its version and behaviour
        logprob, and the correction's per-token rho covers the mix. No effect at
        `max_staleness` 0 (no newer weights appear while a batch is rolled out).
      partial_cache: what happens to the sequences' cache when weights change mid-rollout:
        `recompute` prefills each again with the new weights (its later tokens then follow
        their teacher-forced policy; costs one prefill of every sequence in flight), `keep`
        keeps the keys and values the old weights computed (no recompute), `auto` is
        `recompute` with a dense cache and `keep` with a compressed one (which cannot be
        rebuilt from the sequence without replaying its evictions).
    """

    max_staleness: int = 2
    groups_per_item: int = 1
    sampler_groups: int = 0
    partial_rollouts: bool = True
    partial_cache: str = "auto"

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.groups_per_item < 1:
            raise ValueError(f"groups_per_item must be >= 1, got {self.groups_per_item}")
        if self.partial_cache not in ("auto", "recompute", "keep"):
            raise ValueError(
                f"partial_cache must be auto, recompute or keep, got {self.partial_cache!r}"
            )
        if self.sampler_groups < 0:
            raise ValueError(f"sampler_groups must be >= 0, got {self.sampler_groups}")


def refuse_adaptive_kv(rollout) -> None:
    """The decoupled jobs sample at the configured KV budget only: each sampler builds its
    engines from its own config and a work item carries no budget, so the adaptive budget
    (`rollout.kv.adaptive`, a `RolloutConfig`'s) could not reach them; refuse it in one line."""
    if rollout.kv is not None and rollout.kv.adaptive.enabled:
        raise ValueError(
            "rollout.kv.adaptive.enabled=true works with `sparserl train` only: the decoupled "
            "samplers run the configured rollout.kv.budget (work items carry no budget); set "
            "rollout.kv.adaptive.enabled=false for trainer, sampler and launch"
        )


def check_partial_cache(acfg: AsyncConfig, rollout) -> None:
    """`async.partial_cache=recompute` rebuilds a sequence's cache from its tokens: a compressed
    cache cannot be (its evictions would have to be replayed); refuse it in one line."""
    if acfg.partial_cache == "recompute" and rollout.sparse:
        raise ValueError(
            f"async.partial_cache=recompute needs a dense cache, but rollout.kv.policy is "
            f"{rollout.kv.policy}: use async.partial_cache=keep (or auto)"
        )
