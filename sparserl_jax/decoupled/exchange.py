"""The exchange: the one place the decoupled jobs share, a TensorStore kvstore.

Keys (under the kvstore's root; ids are zero-padded so listings sort numerically):

    trainer/epoch-<E>         one record per trainer start (incarnation E): its start version
    trainer/heartbeat         the trainer's pulse: epoch, step, version, done
    sync/e<E>/...             PULSESync patches and anchors of incarnation E (`KvStoreTransport`,
                              READY markers)
    items/<id>.json           a work item (written once by the trainer, never changed)
    open/<id>                 present while the item is issued and not judged: what samplers poll
    claims/<id>               a sampler's claim on an item (created by a conditional write, so
                              exactly one sampler wins; renewed while it generates; revoked
                              by the trainer when it expires)
    rollouts/<id>.npz         the rollout of an item, then READY/rollouts/<id> holding its sha256
    closed/<id>               the trainer's verdict on an item (consumed or dropped); once a
                              checkpoint covers it, its rollout and claim are deleted
    samplers/<id>             a sampler's pulse (its version, its item)

A single object is written atomically by every kvstore driver (file: temp file + rename; gs/s3:
one PUT), so a reader sees an old or a new value, never a torn one; a rollout still carries its
checksum in the READY marker written after it, so a reader never trusts a blob without it.
docs/decoupled.md has the protocol and the failures it covers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import time
from typing import Any

import tensorstore as ts

from sparserl_jax.decoupled.records import (
    Claim,
    CorruptRolloutError,
    Rollout,
    WorkItem,
    decode_rollout,
    encode_rollout,
    loads,
)
from sparserl_jax.sync import KvStoreTransport

__all__ = [
    "Claim",
    "CorruptRolloutError",
    "Exchange",
    "ExchangeError",
    "SamplerWatch",
    "SupersededError",
    "UnsafeExchangeError",
    "Rollout",
    "WorkItem",
    "decode_rollout",
    "encode_rollout",
]

# The generation TensorStore reports for a key that does not exist: a write conditioned on it
# creates the key only if nobody else has.
_ABSENT = b"\x02"


def _id(i: int) -> str:
    return f"{int(i):012d}"


class ExchangeError(RuntimeError):
    """A kvstore call that still failed after `Exchange.retries` tries (one line: what, where,
    the last error)."""


class SupersededError(RuntimeError):
    """A newer trainer incarnation registered on the exchange (`Exchange.fence`): this one
    stops before writing anything more."""


class UnsafeExchangeError(Exception):
    """The store does not make conditional writes atomic: no job may use it (not retried)."""


# What a kvstore raises when a call fails (tensorstore maps its status errors to ValueError;
# `.result(timeout=...)` raises TimeoutError).
TRANSIENT = (ValueError, OSError, TimeoutError)


class Exchange:
    """The kvstore the jobs share. `url`: `file:///dir/`, `memory://`, `gs://...` or a kvstore
    spec dict; `context`: a `tensorstore.Context` (two `memory://` exchanges share data only
    when opened with the same one). Every call is bounded by `timeout` seconds and tried
    `retries` more times on failure (backoff from `backoff_s`, doubling, at most 8 s); then it
    raises `ExchangeError`. A conditional write whose reply was lost is not lost: when a retry
    finds the condition failed, the key is read, and holding the value written means the lost
    attempt landed."""

    def __init__(
        self,
        url: str | dict,
        *,
        context: ts.Context | None = None,
        timeout=30.0,
        retries: int = 4,
        backoff_s: float = 0.5,
    ):
        self.url = url
        self.context = context if context is not None else ts.Context()
        self.timeout, self.retries, self.backoff_s = timeout, retries, backoff_s
        self.fence_epoch: int | None = None  # `fence`
        self.driver: str | None = None  # the kvstore driver, once open
        self._kv = self._tried(
            "open", lambda: ts.KvStore.open(url, context=self.context).result(timeout=timeout)
        )
        self.driver = self._kv.spec().to_json().get("driver")

    # -- primitives ---------------------------------------------------------------------------

    def _tried(self, what: str, call):
        """`call()`, tried `1 + retries` times on a kvstore failure."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except TRANSIENT as e:
                if attempt == self.retries:
                    msg = " ".join(str(e).split()) or type(e).__name__
                    if isinstance(e, TimeoutError) and self.driver == "file":
                        msg += (
                            " (the file driver locks a key while it is written: a process "
                            "paused mid-write, e.g. a stopped old trainer, holds it until it "
                            "resumes or is killed; docs/decoupled.md)"
                        )
                    raise ExchangeError(
                        f"exchange {self.url}: {what} failed {attempt + 1} times: {msg}"
                    ) from e
                time.sleep(min(self.backoff_s * 2**attempt, 8.0))
        raise AssertionError("unreachable")

    def read(self, key: str) -> tuple[bytes | None, bytes]:
        """(value or None, generation) of `key`."""
        r = self._tried(f"read {key}", lambda: self._kv.read(key).result(timeout=self.timeout))
        return (bytes(r.value) if r.state == "value" else None), bytes(r.stamp.generation)

    def write(self, key: str, value: bytes | None, *, if_equal: bytes | None = None):
        """Write (None: delete) `key`; with `if_equal`, only if its generation is still that
        (`_ABSENT`: only if it does not exist). Returns the new generation, or None when the
        condition failed."""
        tries = []

        def attempt():
            tries.append(1)
            stamp = self._kv.write(key, value, if_equal=if_equal).result(timeout=self.timeout)
            return bytes(stamp.generation) or None

        gen = self._tried(f"write {key}", attempt)
        if gen is None and if_equal is not None and len(tries) > 1 and value is not None:
            held, held_gen = self.read(key)  # did an attempt whose reply was lost land?
            if held == value:
                return held_gen
        return gen

    def list(self, prefix: str) -> list[str]:
        """Keys under `prefix`, sorted, without the prefix."""
        p = prefix.encode()
        rng = ts.KvStore.KeyRange(inclusive_min=p, exclusive_max=p[:-1] + bytes([p[-1] + 1]))
        keys = self._tried(
            f"list {prefix}", lambda: self._kv.list(rng).result(timeout=self.timeout)
        )
        return sorted(k.decode()[len(prefix) :] for k in keys)

    def check_conditional_writes(self) -> None:
        """Refuse, in one line, a store whose create-if-absent is not atomic: the protocol's
        claims and epochs rest on it (S3 makes it atomic only where the server supports
        conditional writes). Creates a probe key twice; the second must fail."""
        key = f"probe/{secrets.token_hex(8)}"
        try:
            first = self.write(key, b"1", if_equal=_ABSENT)
            second = self.write(key, b"2", if_equal=_ABSENT)
        finally:
            self.write(key, None)
        if first is None or second is not None:
            raise UnsafeExchangeError(
                f"exchange {self.url}: a create-if-absent write of {key} "
                + ("failed on a new key" if first is None else "succeeded twice")
                + ": this store does not make conditional writes atomic, which claims and epochs "
                "need (file://, memory://, gs:// do; s3:// only where the server does)"
            )

    def _ids(self, prefix: str, suffix: str = "") -> list[int]:
        return [int(k[: len(k) - len(suffix)]) for k in self.list(prefix) if k.endswith(suffix)]

    # -- the trainer's incarnations and pulse -------------------------------------------------

    def begin_epoch(self, record: dict[str, Any]) -> int:
        """Register a new trainer incarnation (epoch = the last one + 1) with `record`; a
        conditional create, so two trainers starting on one exchange cannot share an epoch."""
        epoch = max(self.epochs(), default=0) + 1
        body = json.dumps({**record, "epoch": epoch}).encode()
        if self.write(f"trainer/epoch-{epoch:06d}", body, if_equal=_ABSENT) is None:
            raise RuntimeError(
                f"another trainer registered epoch {epoch} on the exchange {self.url} at the "
                "same moment: one trainer per exchange"
            )
        return epoch

    def update_epoch(self, epoch: int, record: dict[str, Any]) -> None:
        """Complete incarnation `epoch`'s record (its start version, known after the restore):
        `record`'s keys replace or join those it was begun with."""
        self.check_fence()
        body = json.dumps({**(self.epoch_record(epoch) or {}), **record, "epoch": epoch}).encode()
        self.write(f"trainer/epoch-{epoch:06d}", body)

    def fence(self, epoch: int) -> None:
        """Fence this handle to trainer incarnation `epoch`: from now on every trainer write
        (items, verdicts, revocations, collection, the trainer's heartbeat and epoch record)
        first checks that no newer incarnation registered, else raises `SupersededError`. A new
        trainer registers its epoch before it restores, so an old one still running (or waking
        up) stops at its next write; its items are created only if absent besides."""
        self.fence_epoch = epoch

    def check_fence(self) -> None:
        """Raise `SupersededError` when a newer trainer than the fenced one has registered."""
        e = self.fence_epoch
        if e is not None and self.read(f"trainer/epoch-{e + 1:06d}")[0] is not None:
            raise SupersededError(
                f"trainer epoch {e} was superseded: a newer trainer registered epoch {e + 1} on "
                f"the exchange {self.url}; this one stops without writing more"
            )

    def epochs(self) -> list[int]:
        return self._ids("trainer/epoch-")

    def superseded_at(self, epoch: int | None, step: int) -> str | None:
        """Why a checkpoint trainer `epoch` saved at `step` is not this run's: a newer epoch had
        started from an earlier step (the old trainer was past its fence check when it came),
        so the newer one's lineage owns the steps after that; None when it is (or `epoch` is
        unknown: a checkpoint from before epochs were recorded in it)."""
        if epoch is None:
            return None
        for e in (e for e in self.epochs() if e > epoch):
            start = (self.epoch_record(e) or {}).get("step")
            if start is not None and int(start) < step:
                return (
                    f"was saved by trainer epoch {epoch} after epoch {e} had resumed from step "
                    f"{start} (a superseded trainer past its fence check)"
                )
        return None

    def epoch_record(self, epoch: int) -> dict[str, Any] | None:
        raw, _ = self.read(f"trainer/epoch-{epoch:06d}")
        return None if raw is None else loads(raw)

    def sync_transport(self, epoch: int) -> KvStoreTransport:
        """The PULSESync transport of incarnation `epoch` (its own key prefix, so a resumed
        trainer's versions never mix with the dead one's)."""
        spec = self._kv.spec().to_json()
        spec["path"] = spec.get("path", "") + f"sync/e{epoch:06d}/"
        return KvStoreTransport(spec, context=self.context, timeout=self.timeout)

    def sync_location(self, epoch: int):
        """The sub-transports under incarnation `epoch`'s PULSESync prefix (`sync.parts`'s
        `open_transport`): where a trainer of several processes publishes its parts."""
        spec = self._kv.spec().to_json()
        base = spec.get("path", "") + f"sync/e{epoch:06d}/"

        def open_sub(sub: str) -> KvStoreTransport:
            return KvStoreTransport(
                {**spec, "path": base + sub}, context=self.context, timeout=self.timeout
            )

        return open_sub

    def put_pulse(self, name: str, payload: dict[str, Any]) -> None:
        """A job's heartbeat (`trainer/heartbeat`, `samplers/<id>`)."""
        if name.startswith("trainer/"):
            self.check_fence()
        self.write(name, json.dumps(payload).encode())

    def pulse(self, name: str) -> tuple[dict[str, Any] | None, bytes]:
        raw, gen = self.read(name)
        return (None if raw is None else loads(raw)), gen

    # -- work items ---------------------------------------------------------------------------

    def put_item(self, item: WorkItem) -> None:
        """The item (created only if absent), then its `open/` marker: samplers look only at
        open items."""
        self.check_fence()
        if self.write(f"items/{_id(item.id)}.json", item.to_json(), if_equal=_ABSENT) is None:
            self.check_fence()  # another trainer took the id: superseded, if it is newer
            raise RuntimeError(f"work item {item.id} already exists on the exchange {self.url}")
        self.write(f"open/{_id(item.id)}", b"")

    def item(self, item_id: int) -> WorkItem | None:
        raw, _ = self.read(f"items/{_id(item_id)}.json")
        return None if raw is None else WorkItem.from_json(raw)

    def item_ids(self) -> list[int]:
        return self._ids("items/", ".json")

    def close_item(self, item_id: int, verdict: str) -> None:
        """The trainer's verdict (`consumed`, `dropped:<reason>`): samplers stop working on it."""
        self.check_fence()
        self.write(f"closed/{_id(item_id)}", verdict.encode())
        self.write(f"open/{_id(item_id)}", None)

    def reopen_item(self, item_id: int) -> None:
        """Void a verdict (a resumed trainer's: the dead incarnation's ledger rows are cut),
        and a revocation of its claim with it (samplers may claim the item again)."""
        self.check_fence()
        self.write(f"closed/{_id(item_id)}", None)
        claim, gen = self.claim_state(item_id)
        if claim is not None and claim.get("revoked"):
            self.write(f"claims/{_id(item_id)}", None, if_equal=gen)
        self.write(f"open/{_id(item_id)}", b"")

    def closed_ids(self) -> set[int]:
        return set(self._ids("closed/"))

    def open_ids(self) -> list[int]:
        """Items issued and not judged, oldest first: what a sampler polls (a listing of at
        most `async.max_staleness + 1` keys, however long the run)."""
        return self._ids("open/")

    def is_open(self, item_id: int) -> bool:
        return self.read(f"open/{_id(item_id)}")[0] is not None

    def is_ready(self, item_id: int) -> bool:
        return self.read(f"READY/rollouts/{_id(item_id)}")[0] is not None

    def collect(self, item_id: int) -> None:
        """Delete what a judged item left behind (its rollout, READY marker and claim); its
        record and verdict stay (small)."""
        self.check_fence()
        key = _id(item_id)
        for k in (f"READY/rollouts/{key}", f"rollouts/{key}.npz", f"claims/{key}"):
            self.write(k, None)

    # -- claims -------------------------------------------------------------------------------

    def claim(self, item_id: int, sampler: str) -> Claim | None:
        """Claim an unclaimed item: a conditional create, so of samplers racing for the same
        item exactly one gets a `Claim`; the others get None."""
        body = json.dumps({"sampler": sampler, "renewals": 0}).encode()
        gen = self.write(f"claims/{_id(item_id)}", body, if_equal=_ABSENT)
        return None if gen is None else Claim(item_id, sampler, 0, gen)

    def renew(self, claim: Claim) -> Claim | None:
        """Show the claim is alive (a new generation the trainer sees change); None when the
        claim is no longer this sampler's (it was never changed by anyone else in this
        protocol, so that means the key was removed)."""
        n = claim.renewals + 1
        body = json.dumps({"sampler": claim.sampler, "renewals": n}).encode()
        gen = self.write(f"claims/{_id(claim.item)}", body, if_equal=claim.generation)
        return None if gen is None else dataclasses.replace(claim, renewals=n, generation=gen)

    def revoke(self, item_id: int, generation: bytes) -> bool:
        """The trainer's end of an expired claim: overwrite it (if it is still at `generation`),
        so its sampler's next renewal fails and it stops working on the item."""
        self.check_fence()
        body = json.dumps({"sampler": None, "revoked": True}).encode()
        return self.write(f"claims/{_id(item_id)}", body, if_equal=generation) is not None

    def claim_state(self, item_id: int) -> tuple[dict[str, Any] | None, bytes]:
        raw, gen = self.read(f"claims/{_id(item_id)}")
        return (None if raw is None else loads(raw)), gen

    def claimed_ids(self) -> set[int]:
        return set(self._ids("claims/"))

    # -- rollouts -----------------------------------------------------------------------------

    def put_rollout(self, rollout: Rollout) -> None:
        """The blob, then its READY marker with the blob's sha256 and size."""
        blob = encode_rollout(rollout)
        key = _id(rollout.item)
        self.write(f"rollouts/{key}.npz", blob)
        ready = {"sha256": hashlib.sha256(blob).hexdigest(), "nbytes": len(blob)}
        self.write(f"READY/rollouts/{key}", json.dumps(ready).encode())

    def ready_rollouts(self) -> set[int]:
        return set(self._ids("READY/rollouts/"))

    def rollout_sha256(self, item_id: int) -> str | None:
        """The checksum the READY marker of `item_id`'s rollout holds (None when not READY)."""
        marker, _ = self.read(f"READY/rollouts/{_id(item_id)}")
        return None if marker is None else self._marker_sha256(marker)

    @staticmethod
    def _marker_sha256(marker: bytes) -> str | None:
        try:
            return str(loads(marker)["sha256"])
        except (ValueError, KeyError, TypeError):
            return None

    def rollout(self, item_id: int, *, sha256: str | None = None) -> Rollout | None:
        """The READY rollout of `item_id` (None when not READY); its bytes must match the
        marker's checksum, else `CorruptRolloutError`; and the marker's checksum `sha256` when
        given (the rollout another process judged)."""
        key = _id(item_id)
        marker, _ = self.read(f"READY/rollouts/{key}")
        if marker is None:
            return None
        if sha256 is not None and self._marker_sha256(marker) != sha256:
            raise CorruptRolloutError(f"rollout of item {item_id} is not the one judged elsewhere")
        blob, _ = self.read(f"rollouts/{key}.npz")
        try:
            expect = loads(marker)
            # Past `nbytes`: a dead writer's tail (`records.loads`), not part of the blob.
            blob = None if blob is None else blob[: expect["nbytes"]]
            ok = blob is not None and len(blob) == expect["nbytes"]
            ok = ok and hashlib.sha256(blob).hexdigest() == expect["sha256"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise CorruptRolloutError(f"rollout of item {item_id} does not match its checksum")
        out = decode_rollout(blob)
        if out.item != item_id:
            raise CorruptRolloutError(f"rollout blob of item {item_id} names item {out.item}")
        return out


class SamplerWatch:
    """Which samplers are alive, as this process sees them: a sampler is alive while its pulse
    (`samplers/<id>`) changes generation within `lease_s` of this process's clock (no clock is
    compared across machines). One sampler seen for the first time counts as alive."""

    def __init__(self, exchange: Exchange, lease_s: float):
        self.ex, self.lease_s = exchange, lease_s
        self._seen: dict[str, tuple[bytes, float]] = {}

    def alive(self) -> set[str]:
        now, out = time.monotonic(), set()
        for name in self.ex.list("samplers/"):
            _, gen = self.ex.pulse(f"samplers/{name}")
            seen = self._seen.get(name)
            if seen is None or seen[0] != gen:
                self._seen[name] = seen = (gen, now)
            if now - seen[1] < self.lease_s:
                out.add(name)
        return out
