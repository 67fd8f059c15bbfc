"""The decoupled jobs' exchange and ledger without any model: claims (one winner of a race),
rollout blobs (round trip, checksum), work items, trainer incarnations, the exactly-once check,
retries of failed kvstore calls (and conditional writes whose reply was lost)."""

import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparserl_jax.config import load_config
from sparserl_jax.data import Example, prompt_iterator
from sparserl_jax.decoupled.exchange import (
    CorruptRolloutError,
    Exchange,
    ExchangeError,
    Rollout,
    SupersededError,
    UnsafeExchangeError,
    WorkItem,
    decode_rollout,
    encode_rollout,
)
from sparserl_jax.decoupled.ledger import FILES, Ledger, check_exactly_once
from sparserl_jax.decoupled.queue import WorkQueue
from sparserl_jax.decoupled.trainer import _Usable
from sparserl_jax.models.tokenizer import CharTokenizer
from sparserl_jax.rollout import RolloutResult
from sparserl_jax.sampler import step_seeds

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def _urls(tmp_path):
    return ["memory://", f"file://{tmp_path}/exchange/"]


def _result(rows=4, width=6, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, width + 1, rows).astype(np.int32)
    mask = np.arange(width)[None] < lens[:, None]
    return RolloutResult(
        prompt_ids=[[1, 5, 6], [1, 7], [1, 5, 6], [1, 7]][:rows],
        completion_ids=np.where(mask, rng.integers(3, 90, (rows, width)), 0).astype(np.int32),
        sampler_logprobs=np.where(mask, -rng.random((rows, width)), 0).astype(np.float32),
        completion_mask=mask,
        prompt_lens=np.array([3, 2, 3, 2][:rows], np.int32),
        completion_lens=lens,
        tokens_evicted=rng.integers(0, 5, rows).astype(np.int32),
        weight_version=np.full(rows, 7, np.int32),
        finished_by_stop=mask[:, -1] == 0,
        stats={"tokens_per_s": 12.5, "chunks": 3, "skipped": [1, 2]},
        first_evicted=rng.integers(0, width, rows).astype(np.int32),
    )


def _item(i=0, batch=0):
    ex = Example(prompt="1+2=", answer="3", task="arithmetic", source="a#1", index=1)
    return WorkItem(
        id=i, batch=batch, epoch=1, prompts=[[1, 5]], seeds=[9], examples=[ex], min_version=0
    )


@pytest.mark.parametrize("which", [0, 1])
def test_racing_claims_have_exactly_one_winner(tmp_path, which):
    """Eight samplers (threads, each with its own handle on the store) race for each of five
    items: every item has exactly one winner, and a renewal by a loser's stale view fails."""
    url = _urls(tmp_path)[which]
    ctx = ts.Context()
    handles = [Exchange(url, context=ctx) for _ in range(8)]
    wins: dict[int, list[str]] = {i: [] for i in range(5)}
    barrier = threading.Barrier(8)

    def race(k):
        barrier.wait()
        for i in range(5):
            c = handles[k].claim(i, f"s{k}")
            if c is not None:
                wins[i].append(c.sampler)

    threads = [threading.Thread(target=race, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(w) == 1 for w in wins.values()), wins
    ex = handles[0]
    state, _ = ex.claim_state(0)
    assert state["sampler"] == wins[0][0] and ex.claimed_ids() == set(range(5))
    # A claimed item cannot be claimed again, not even by its winner; renewing changes the
    # generation (what the trainer watches), and a stale generation cannot renew.
    winner = handles[int(wins[0][0][1:])]
    _, gen = ex.claim_state(0)
    assert winner.claim(0, "again") is None and ex.claim_state(0)[1] == gen
    claim = winner.claim(6, "w")
    renewed = winner.renew(claim)
    assert renewed is not None and renewed.generation != claim.generation
    assert ex.claim_state(6)[0] == {"sampler": "w", "renewals": 1}
    assert winner.renew(claim) is None


@pytest.mark.parametrize("which", [0, 1])
def test_rollout_blob_round_trip_and_checksum(tmp_path, which):
    ex = Exchange(_urls(tmp_path)[which])
    res = _result()
    r = Rollout(item=3, sampler="s1", epoch=2, weight_version=7, state_digest="abc", result=res)
    assert ex.rollout(3) is None  # not READY
    ex.put_rollout(r)
    assert ex.ready_rollouts() == {3}
    back = ex.rollout(3)
    assert (back.item, back.sampler, back.epoch, back.weight_version) == (3, "s1", 2, 7)
    assert back.state_digest == "abc" and back.result.prompt_ids == res.prompt_ids
    fields = ("completion_ids", "sampler_logprobs", "completion_mask", "tokens_evicted")
    for k in (*fields, "first_evicted"):
        np.testing.assert_array_equal(getattr(back.result, k), getattr(res, k))
        assert getattr(back.result, k).dtype == getattr(res, k).dtype
    assert back.result.stats == {"tokens_per_s": 12.5, "chunks": 3}
    # A flipped byte, a truncated blob, a blob filed under another item: refused.
    blob = bytearray(encode_rollout(r))
    blob[len(blob) // 2] ^= 1
    ex.write("rollouts/000000000003.npz", bytes(blob))
    with pytest.raises(CorruptRolloutError, match="checksum"):
        ex.rollout(3)
    ex.write("rollouts/000000000003.npz", encode_rollout(r)[:-10])
    with pytest.raises(CorruptRolloutError):
        ex.rollout(3)
    # Bytes past the marker's size (a dead writer's tail, `records.loads`) are not the blob's.
    ex.write("rollouts/000000000003.npz", encode_rollout(r) + b"\0" * 40)
    assert ex.rollout(3).state_digest == "abc"
    with pytest.raises(CorruptRolloutError):
        decode_rollout(b"not a zip")
    ex.put_rollout(r)
    good = ex.read("rollouts/000000000003.npz")[0]
    ex.write("rollouts/000000000004.npz", good)
    ex.write("READY/rollouts/000000000004", ex.read("READY/rollouts/000000000003")[0])
    with pytest.raises(CorruptRolloutError, match="names item 3"):
        ex.rollout(4)


def test_a_rollout_split_into_items_and_assembled_again_is_the_same():
    res = _result()
    parts = [res.rows(0, 1), res.rows(1, 3), res.rows(3, 4)]
    assert [p.stats["generated_tokens"] for p in parts] == [
        int(res.completion_lens[a:b].sum()) for a, b in ((0, 1), (1, 3), (3, 4))
    ]
    back = RolloutResult.concat(parts)
    assert back.prompt_ids == res.prompt_ids and back.evict_pos is None
    for k in ("completion_ids", "sampler_logprobs", "completion_mask", "first_evicted"):
        np.testing.assert_array_equal(getattr(back, k), getattr(res, k))
    assert back.stats["generated_tokens"] == int(res.completion_lens.sum())


def test_items_epochs_and_verdicts(tmp_path):
    ex = Exchange(f"file://{tmp_path}/x/")
    item = _item(4, batch=2)
    ex.put_item(item)
    assert ex.item_ids() == [4] and ex.item(4) == item and ex.item(5) is None
    ex.close_item(4, "consumed")
    assert ex.closed_ids() == {4}
    ex.reopen_item(4)
    assert ex.closed_ids() == set()
    assert ex.begin_epoch({"start_version": 0}) == 1
    assert ex.begin_epoch({"start_version": 5}) == 2
    assert ex.epochs() == [1, 2] and ex.epoch_record(2)["start_version"] == 5
    # Each epoch's PULSESync blobs live under their own prefix.
    t1, t2 = ex.sync_transport(1), ex.sync_transport(2)
    t1.put(0, "anchor", b"one")
    assert t1.versions("anchor") == [0] and t2.versions("anchor") == []
    assert (tmp_path / "x" / "sync" / "e000001" / "anchor-000000000000.psyn").exists()


def test_a_checkpoint_saved_after_a_newer_epoch_started_earlier_is_superseded(tmp_path):
    """Epoch 1 checkpoints steps 2 and 4 (4 once past its fence check, frozen, woken after epoch
    2 had resumed from 2); epoch 3 died while starting (no start step); epoch 4 resumed from 6."""
    ex = Exchange(f"file://{tmp_path}/x/")
    for start in (None, 2, None, 6):
        e = ex.begin_epoch({"starting": True})
        if start is not None:
            ex.update_epoch(e, {"step": start, "starting": False})
    assert ex.superseded_at(1, 2) is None  # epoch 2 resumed from it
    assert "after epoch 2 had resumed from step 2" in ex.superseded_at(1, 4)
    assert ex.superseded_at(2, 6) is None and ex.superseded_at(2, 4) is None
    assert "after epoch 4 had resumed from step 6" in ex.superseded_at(2, 8)
    assert ex.superseded_at(4, 100) is None and ex.superseded_at(None, 100) is None


def test_a_writer_killed_before_its_rename_leaves_no_unreadable_record(tmp_path):
    """TensorStore's file driver writes `<key>.__lock`, then renames it over the key; a writer
    killed with -9 in between leaves the lock file, and the next writer of the key writes into
    it from offset 0 without cutting it. A shorter record then carries the dead writer's tail
    (a clean-clone CI run saw it: a restarted trainer's item 7 unreadable, its samplers waiting
    until they gave up). The record read is the one written."""
    ex = Exchange(f"file://{tmp_path}/x/")
    dead = _item(7, batch=3)
    lock = tmp_path / "x" / "items" / "000000000007.json.__lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(dead.to_json())  # longer than what the next writer writes
    item = dataclasses.replace(_item(7, batch=1), examples=dead.examples[:0])
    ex.put_item(item)
    raw = (tmp_path / "x" / "items" / "000000000007.json").read_bytes()
    assert raw.startswith(item.to_json())
    assert ex.item(7) == item


def test_unreachable_exchange_raises_not_hangs():
    ex = Exchange("file:///proc/definitely/not/here/", timeout=5, retries=1, backoff_s=0.01)
    with pytest.raises(
        ExchangeError, match=r"^exchange file:///proc/\S+: write items/\S+ failed 2 times: "
    ):
        ex.put_item(_item())


def _rows(ledger, name, rows):
    for r in rows:
        ledger.append(name, r)


def _consumed(step, batch, *, items, size=2):
    """The ledger rows of one step: data batch `batch` as `items` (their ids), one prompt each."""
    return [
        {"item": i, "batch": batch, "first": k, "prompts": size // len(items), "batch_size": size}
        | {"step": step}
        for k, i in enumerate(items)
    ]


def test_ledger_truncate_and_exactly_once(tmp_path):
    led = Ledger(tmp_path)
    for b in range(3):
        _rows(led, "consumed", _consumed(b + 1, b, items=[2 * b, 2 * b + 1]))
    _rows(led, "dropped", [{"item": 6, "batch": 3, "reason": "expired", "step": 4}])
    pos = led.position()
    assert pos == {"consumed": 6, "dropped": 1}
    _rows(led, "consumed", _consumed(4, 3, items=[8, 7]))  # 6 re-issued as 8, in its place
    (tmp_path / "consumed.jsonl").open("a").write('{"item": 9, "ba')  # torn by a kill
    assert len(Ledger(tmp_path).rows("consumed")) == 8
    assert check_exactly_once(tmp_path)["steps"] == 4
    Ledger(tmp_path).truncate(pos)
    assert Ledger(tmp_path).position() == pos
    # Batch 3 is in flight (its item 6 dropped and re-issued): not lost.
    (tmp_path / "pending.json").write_text(json.dumps([3]))
    assert check_exactly_once(tmp_path) == {
        "consumed": 6,
        "steps": 3,
        "dropped": 1,
        "reasons": {"expired": 1},
        "superseded": 0,
    }
    (tmp_path / "pending.json").write_text("[]")
    with pytest.raises(ValueError, match="lost"):
        check_exactly_once(tmp_path)
    _rows(Ledger(tmp_path), "consumed", _consumed(4, 3, items=[2, 7]))
    with pytest.raises(ValueError, match="more than once"):
        check_exactly_once(tmp_path)
    Ledger(tmp_path).truncate(pos)
    _rows(Ledger(tmp_path), "consumed", _consumed(4, 3, items=[6, 7]))
    with pytest.raises(ValueError, match="both consumed and dropped"):
        check_exactly_once(tmp_path)
    # A batch trained out of data order, half a batch, a batch's prompts out of order.
    for rows, why in [
        (_consumed(4, 4, items=[8, 7]), "not trained in data order"),
        (_consumed(4, 3, items=[8, 7])[:1], "1 of data batch 3's 2 prompts"),
        (_consumed(4, 3, items=[8, 7])[::-1], "not trained whole and in order"),
    ]:
        Ledger(tmp_path).truncate(pos)
        _rows(Ledger(tmp_path), "consumed", rows)
        with pytest.raises(ValueError, match=why):
            check_exactly_once(tmp_path)


def test_rows_an_old_trainer_appends_after_its_successor_started_do_not_count(tmp_path):
    """Trainer epoch 1 passed its fence check and was frozen before its ledger append; epoch 2
    resumed from epoch 1's checkpoint and trained the same items; epoch 1, woken, appends its
    rows (a consumed one and a dropped one) before its next fence check stops it. Those rows
    are in the files but do not count; epoch 3, resuming, cuts them out."""
    a = Ledger(tmp_path, epoch=1)
    a.truncate({})
    _rows(a, "consumed", _consumed(1, 0, items=[0, 1]))
    pos = a.position()
    b = Ledger(tmp_path, epoch=2)
    b.truncate(pos)
    _rows(b, "consumed", _consumed(2, 1, items=[2, 3])[:1])
    a.append("consumed", _consumed(2, 1, items=[2, 3])[0])  # the old trainer, woken
    a.append("dropped", {"item": 3, "step": 2, "batch": 1, "reason": "expired"})
    _rows(b, "consumed", _consumed(2, 1, items=[2, 3])[1:])
    lines = (tmp_path / "consumed.jsonl").read_text().splitlines()
    assert [json.loads(x).get("item") for x in lines] == [0, 1, None, 2, 2, 3]  # None: marker
    assert [r["epoch"] for r in Ledger(tmp_path).rows("consumed")] == [1, 1, 2, 2]
    assert Ledger(tmp_path).rows("dropped") == []
    assert Ledger(tmp_path).superseded() == {"consumed": 1, "dropped": 1}
    assert check_exactly_once(tmp_path) | {"reasons": None} == {
        "consumed": 4,
        "steps": 2,
        "dropped": 0,
        "reasons": None,
        "superseded": 2,
    }
    assert b.position() == {"consumed": 4, "dropped": 0}
    Ledger(tmp_path, epoch=3).truncate(b.position())
    assert Ledger(tmp_path).superseded() == {"consumed": 0, "dropped": 0}
    assert check_exactly_once(tmp_path)["consumed"] == 4
    # An older epoch's start-up, slower than epoch 3's, does not cut epoch 3's rows.
    with pytest.raises(SupersededError, match="already holds epoch 3's rows"):
        Ledger(tmp_path, epoch=2).truncate(pos)
    assert check_exactly_once(tmp_path)["consumed"] == 4


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.sampled_from(["start", "append", "append", "append"]), st.integers(0, 9)),
        max_size=30,
    )
)
def test_ledger_counts_each_row_of_the_newest_incarnation_only(tmp_path, ops):
    """Any interleaving of incarnations starting (each resuming from a position no later than
    what counts) and appending, old ones included: what counts is what the newest wrote since
    the position it started from, and the newest's position is its length."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        ledgers, model, ids = [], {name: [] for name in FILES}, iter(range(10**6))
        for op, k in ops:
            if op == "start" or not ledgers:
                new = Ledger(d, epoch=len(ledgers) + 1)
                pos = {name: k % (len(model[name]) + 1) for name in FILES}
                new.truncate(pos)
                model = {name: model[name][: pos[name]] for name in FILES}
                ledgers.append(new)
                continue
            who, name = ledgers[k % len(ledgers)], FILES[k % 2]
            row = {"item": next(ids)}
            who.append(name, row)
            if who is ledgers[-1]:
                model[name].append(row["item"])
        for name in FILES:
            assert [r["item"] for r in Ledger(d).rows(name)] == model[name]
        if ledgers:
            assert ledgers[-1].position() == {name: len(model[name]) for name in FILES}


# -- the trainer's work queue and its verdicts, with fake rollouts -----------------------------


def _queue(ex, run_dir, *, state=None, staleness=1, lease_s=60.0):
    data = load_config(TINY).data
    return WorkQueue(
        ex,
        Ledger(run_dir),
        prompt_iterator(data, state=None if state is None else state["data"]),
        CharTokenizer(),
        epoch=max(ex.epochs(), default=1),
        seed=0,
        max_prompt_len=8,
        max_staleness=staleness,
        lease_s=lease_s,
        state=None if state is None else state["queue"],
        log_fn=lambda m: None,
    )


def _fake(ex, item, version, digest="d0", epoch=1):
    r = Rollout(item, "s", epoch, version, digest, _result())
    ex.put_rollout(r)


def _batch(q, place=0):
    return q.batches[place]["items"]


def test_queue_issues_paced_batches_of_groups_and_reissues_in_place(tmp_path):
    """S+1 batches in flight, each as one item per prompt, with min_version paced by the batch's
    place and the seeds of `sparserl train`'s step; a rollout from forged weights, one stale
    despite pacing and a corrupt one are dropped and re-issued at once, in their place, with the
    same prompts and seeds; the head batch is handed over only whole, in prompt order."""
    ex = Exchange("memory://")
    ex.begin_epoch({"start_version": 0})
    q = _queue(ex, tmp_path, staleness=1)
    usable = _Usable(ex, 1, 1)
    usable.version, usable.digests = 3, {1: "d1", 2: "d2", 3: "d3"}
    q.fill(3)
    assert q.batches == [{"batch": 0, "items": [0, 1]}, {"batch": 1, "items": [2, 3]}]
    items = [ex.item(i) for i in range(4)]
    assert [(it.batch, it.first, it.batch_size, it.min_version) for it in items] == [
        (0, 0, 2, 2),
        (0, 1, 2, 2),
        (1, 0, 2, 3),
        (1, 1, 2, 3),
    ]
    assert [it.seeds[0] for it in items] == step_seeds(0, 1, 2) + step_seeds(0, 2, 2)
    assert q.ready_batch(4, 3, usable) is None  # nothing READY
    _fake(ex, 0, 1, "d1")  # 2 versions behind at max_staleness 1 (pacing defeated)
    _fake(ex, 1, 3, "forged")
    _fake(ex, 3, 3, "d3")  # batch 1's second item: judged now, handed over with its batch
    assert q.ready_batch(4, 3, usable) is None
    rows = Ledger(tmp_path).rows("dropped")
    assert [(r["item"], r["reason"], r["staleness"]) for r in rows] == [
        (0, "stale", 2),
        (1, "unverified", 0),
    ]
    assert ex.closed_ids() == {0, 1} and _batch(q) == [4, 5] and 3 in q.got
    again = [ex.item(i) for i in (4, 5)]
    assert [(it.batch, it.first, it.reissue_of, it.min_version) for it in again] == [
        (0, 0, 0, 2),
        (0, 1, 1, 2),
    ]
    assert [(it.prompts, it.seeds) for it in again] == [(it.prompts, it.seeds) for it in items[:2]]
    ex.write("rollouts/000000000004.npz", b"junk")
    ex.write("READY/rollouts/000000000004", b'{"sha256": "0", "nbytes": 4}')
    _fake(ex, 5, 2, "d2")
    assert q.ready_batch(4, 3, usable) is None  # item 4 corrupt: re-issued as 6
    assert Ledger(tmp_path).rows("dropped")[-1]["reason"] == "corrupt" and _batch(q) == [6, 5]
    _fake(ex, 6, 3, "d3")
    got_items, rollouts = q.ready_batch(4, 3, usable)
    assert [it.id for it in got_items] == [6, 5] and [it.first for it in got_items] == [0, 1]
    assert [r.weight_version for r in rollouts] == [3, 2]
    q.consumed([{"step": 4}, {"step": 4}])
    assert [(r["item"], r["batch"], r["first"]) for r in Ledger(tmp_path).rows("consumed")] == [
        (6, 0, 0),
        (5, 0, 1),
    ]
    assert q.pending_batches() == [1] and q.batches[0]["items"] == [2, 3]
    assert dict(q.counts) == {"stale": 1, "unverified": 1, "corrupt": 1}
    q.fill(4)
    assert q.batches[1] == {"batch": 2, "items": [7, 8]} and ex.item(7).min_version == 4


def test_queue_expires_a_claim_that_stops_changing(tmp_path):
    ex = Exchange("memory://")
    ex.begin_epoch({"start_version": 0})
    q = _queue(ex, tmp_path, staleness=0, lease_s=0.3)
    q.fill(0)
    claim = ex.claim(0, "s9")
    assert q.ready_batch(1, 0, lambda r: (True, "", 0)) is None
    time.sleep(0.2)
    claim = ex.renew(claim)  # alive: the trainer sees a new generation
    assert q.ready_batch(1, 0, lambda r: (True, "", 0)) is None
    time.sleep(0.2)
    assert q.ready_batch(1, 0, lambda r: (True, "", 0)) is None and _batch(q) == [0, 1]
    time.sleep(0.35)  # no renewal for longer than the lease
    assert q.ready_batch(1, 0, lambda r: (True, "", 0)) is None
    assert Ledger(tmp_path).rows("dropped") == [
        {"item": 0, "step": 1, "batch": 0, "reason": "expired", "sampler": "s9"}
    ]
    # Revoked: the sampler, alive after all, cannot renew it and stops working on it.
    assert ex.renew(claim) is None
    assert ex.claim_state(0)[0] == {"sampler": None, "revoked": True}
    assert _batch(q) == [2, 1] and ex.item(2).reissue_of == 0 and q.counts["expired"] == 1


def test_queue_opens_again_an_item_a_superseded_trainer_closed_late(tmp_path):
    """An old trainer, frozen between its fence check and a verdict, closes an item its
    successor has in flight and nobody has claimed: samplers would never claim it. The queue
    reads an unclaimed item once per lease and opens it again; a claimed one is left alone."""
    ex = Exchange("memory://")
    ex.begin_epoch({"start_version": 0})
    q = _queue(ex, tmp_path, staleness=0, lease_s=0.3)
    q.fill(0)
    claim = ex.claim(1, "s0")
    ex.write("closed/000000000000", b"consumed")  # the old trainer's late verdict
    ex.write("open/000000000000", None)
    ok = lambda r: (True, "", 0)  # noqa: E731
    assert q.ready_batch(1, 0, ok) is None and not ex.is_open(0)  # within the lease: no read
    time.sleep(0.35)
    ex.renew(claim)  # item 1's sampler is alive
    assert q.ready_batch(1, 0, ok) is None and ex.is_open(0) and 0 not in ex.closed_ids()
    assert ex.open_ids() == [0, 1] and _batch(q) == [0, 1] and q.counts == {}


def test_queue_resume_abandons_later_items_and_reopens_in_flight(tmp_path):
    """A checkpoint taken with batches 0 and 1 in flight (items 0-3); the dead trainer then
    trained on batch 0 (closing 0 and 1) and issued batch 2 as items 4, 5. The resumed queue
    reopens 0-3, keeps both batches, abandons 4 and 5 (batch 2 comes again from the data
    state) and never reuses their ids."""
    ex = Exchange("memory://")
    ex.begin_epoch({"start_version": 0})
    q = _queue(ex, tmp_path, staleness=1)
    q.fill(0)
    state = {"queue": q.state(), "data": q.data_it.get_state()}
    for i in (0, 1):
        q.got[i] = None
    q.consumed([{"step": 1}, {"step": 1}])
    q.fill(1)
    assert ex.item_ids() == [0, 1, 2, 3, 4, 5] and ex.closed_ids() == {0, 1}
    ex.begin_epoch({"start_version": 0})
    Ledger(tmp_path).truncate(state["queue"]["ledger"])
    r = _queue(ex, tmp_path, state=state, staleness=1)
    assert r.batches == state["queue"]["batches"] and ex.closed_ids() == {4, 5}
    assert [(d["item"], d["reason"]) for d in Ledger(tmp_path).rows("dropped")] == [
        (4, "abandoned"),
        (5, "abandoned"),
    ]
    r.batches.pop(0)
    r.fill(1)
    assert r.batches[-1]["items"] == [6, 7] and ex.item(6).batch == ex.item(4).batch == 2
    with pytest.raises(ValueError, match="older release"):
        _queue(ex, tmp_path, state={**state, "queue": {"next_item": 1, "outstanding": [0]}})


class _Flaky:
    """A kvstore that fails chosen calls: `fail[op]` calls of `op` raise before touching the
    store; `lost[op]` calls of `op` reach the store, then lose the reply (TimeoutError)."""

    def __init__(self, kv, *, fail=None, lost=None):
        self.kv, self.fail, self.lost = kv, dict(fail or {}), dict(lost or {})

    def _call(self, op, *args, **kwargs):
        if self.fail.get(op, 0):
            self.fail[op] -= 1
            raise ValueError(f"UNAVAILABLE: {op} refused for the test")
        out = getattr(self.kv, op)(*args, **kwargs)
        if self.lost.get(op, 0):
            self.lost[op] -= 1
            out.result()
            raise TimeoutError(f"{op}: the reply was lost")
        return out

    def read(self, *a, **k):
        return self._call("read", *a, **k)

    def write(self, *a, **k):
        return self._call("write", *a, **k)

    def list(self, *a, **k):
        return self._call("list", *a, **k)


def _flaky(ex: Exchange, **kw) -> _Flaky:
    ex._kv = _Flaky(ex._kv, **kw)
    ex.backoff_s = 0.01
    return ex._kv


def test_transient_failures_are_retried_then_named_in_one_line():
    ex = Exchange("memory://", retries=3)
    _flaky(ex, fail={"write": 2, "read": 3, "list": 1})
    ex.put_item(_item())  # two failures, then the write
    assert ex.item(0) is not None  # three failures, then the read
    assert ex.item_ids() == [0]
    _flaky(ex, fail={"read": 4})
    with pytest.raises(ExchangeError, match=r"^exchange memory://: read items/0+\.json failed 4 "):
        ex.item(0)


def test_a_timeout_on_the_file_driver_names_a_paused_writer(tmp_path):
    """A process stopped mid-write (SIGSTOP: an old trainer frozen) holds that key's lock in the
    file driver; a successor's writes to the key time out. The line says what may hold it."""
    ex = Exchange(f"file://{tmp_path}/x/", retries=1)
    _flaky(ex, lost={"write": 2})  # each attempt times out
    with pytest.raises(ExchangeError, match=r"write open/0+ failed 2 times: .*paused mid-write"):
        ex.write("open/000000000000", b"")


def test_a_lost_reply_of_a_conditional_write_is_not_a_lost_claim():
    ex = Exchange("memory://", retries=2)
    kv = _flaky(ex, lost={"write": 1})
    claim = ex.claim(7, "s0")  # created, reply lost, retried: the key holds our claim
    assert claim is not None and kv.lost["write"] == 0
    kv.lost["write"] = 1
    renewed = ex.renew(claim)  # renewed, reply lost: adopted from what the key holds
    assert renewed is not None and renewed.renewals == 1
    assert ex.renew(renewed) is not None  # and the next renewal holds the claim
    other = ex.claim(7, "s1")
    assert other is None  # a real loss of the race is still a loss
    kv.lost["write"] = 1
    assert ex.begin_epoch({"start_version": 0}) == 1  # a lost reply of the epoch's create


def _tally(ex: Exchange) -> dict[str, int]:
    """Count the keys `ex` lists and the keys it reads (until `del ex.list, ex.read`)."""
    seen = {"listed": 0, "read": 0}

    def listing(prefix):
        keys = Exchange.list(ex, prefix)
        seen["listed"] += len(keys)
        return keys

    def reading(key):
        seen["read"] += 1
        return Exchange.read(ex, key)

    ex.list, ex.read = listing, reading
    return seen


def test_a_sampler_poll_costs_the_open_items_not_the_run(tmp_path):
    """Judged items leave the `open/` index and, once a checkpoint holds their verdicts, their
    rollouts and claims are deleted: a sampler's poll reads only the items in flight."""
    from sparserl_jax.decoupled.sampler_job import _Claimer

    ex = Exchange("memory://")
    ex.begin_epoch({"start_version": 0})
    q = _queue(ex, tmp_path, staleness=0)
    usable = _Usable(ex, 1, 0)
    calls = []
    for step in range(1, 31):
        q.fill(step - 1)
        ids = _batch(q)
        claimer = _Claimer(ex, "s0", 0, 60.0)
        if step in (2, 30):  # count one poll early in the run and one late: keys listed, reads
            seen = _tally(ex)
            got = claimer(step - 1)
            del ex.list, ex.read
            calls.append(seen)
            assert [item.id for _, item in got] == ids and got[0][0].sampler == "s0"
        else:
            for i in ids:
                ex.claim(i, "s0")
        usable.version, usable.digests = step - 1, {step - 1: "d"}
        for i in ids:
            _fake(ex, i, step - 1, "d")
        q.ready_batch(step, step - 1, usable)
        q.consumed([{"step": step}] * len(ids))
        if step % 5 == 0:
            q.collect()  # what the trainer does after each checkpoint
    assert calls[0] == calls[1], calls  # the same cost at step 2 and at step 30
    assert ex.open_ids() == [] and ex.ready_rollouts() == set() and ex.claimed_ids() == set()
    assert ex.rollout(3) is None and ex.item(3) is not None  # the record and verdict stay
    assert ex.closed_ids() == set(range(60))


def test_samplers_share_a_batch_and_never_claim_from_one_half_issued(tmp_path):
    """Two samplers alive: each claims its fair share of a batch's items (the first half, then
    the rest); a batch whose items are not all open yet is not claimed from; an explicit
    `async.sampler_groups` caps a claim; items newer than the sampler's weights wait."""
    from sparserl_jax.decoupled.sampler_job import _Claimer

    ex = Exchange("memory://")
    ex.begin_epoch({"start_version": 0})
    q = _queue(ex, tmp_path, staleness=1)
    q.fill(0)  # batch 0 (items 0, 1; min_version 0), batch 1 (2, 3; min_version 0)
    for name in ("a", "b"):
        ex.put_pulse(f"samplers/{name}", {"version": 0})
    a, b = _Claimer(ex, "a", 0, 60.0), _Claimer(ex, "b", 0, 60.0)
    assert [item.id for _, item in a(0)] == [0, 1]  # 4 in flight, 2 samplers alive
    assert [item.id for _, item in b(0)] == [2, 3]
    assert a(0) == [] and b(0) == []
    ex.put_item(dataclasses.replace(ex.item(0), id=9, batch=7, min_version=1))  # half of batch 7
    assert a(0) == []
    ex.put_item(dataclasses.replace(ex.item(1), id=10, batch=7, min_version=1))
    assert a(0) == []  # whole now, but for weights newer than a's
    got = _Claimer(ex, "c", 1, 60.0)(1)
    assert [item.id for _, item in got] == [9]  # capped at one item


class _NoConditions:
    """A kvstore that ignores write conditions (an S3 server without conditional writes)."""

    def __init__(self, kv):
        self.kv = kv

    def write(self, key, value, if_equal=None):
        return self.kv.write(key, value)

    def __getattr__(self, op):
        return getattr(self.kv, op)


def test_a_store_without_atomic_create_is_refused_in_one_line(tmp_path):
    for url in _urls(tmp_path):
        Exchange(url).check_conditional_writes()  # memory:// and file:// are atomic
    ex = Exchange("memory://")
    ex._kv = _NoConditions(ex._kv)
    with pytest.raises(UnsafeExchangeError, match=r"create-if-absent write of probe/\w+ succeeded"):
        ex.check_conditional_writes()
    assert ex.list("probe/") == []  # the probe is removed


def test_jobs_refuse_an_unsafe_store_before_any_work(tmp_path):
    from sparserl_jax.decoupled.sampler_job import run_sampler
    from sparserl_jax.decoupled.trainer import run_trainer

    cfg = load_config(TINY, [f"run_dir={tmp_path}", "data.batch_size=4"])
    for run in (
        lambda ex: run_sampler(cfg, "0", url="memory://", exchange=ex),
        lambda ex: run_trainer(cfg, exchange=ex),
    ):
        ex = Exchange("memory://")
        ex._kv = _NoConditions(ex._kv)
        t0 = time.monotonic()
        with pytest.raises(UnsafeExchangeError, match="conditional writes atomic"):
            run(ex)
        assert time.monotonic() - t0 < 60  # at once, not after give_up_s
        assert ex.list("items/") == [] and ex.list("trainer/") == []


def test_a_fenced_handle_refuses_every_trainer_write_once_superseded(tmp_path):
    """`Exchange.fence`: an old trainer's issue, verdict, revocation, collection, heartbeat and
    epoch record all fail in one line once a newer trainer registered; items are created only
    if absent; sampler-side writes are not fenced."""
    url = f"file://{tmp_path}/x/"
    old, new = Exchange(url), Exchange(url)
    epoch = old.begin_epoch({"pid": 1})
    old.fence(epoch)
    old.put_item(_item(0))
    old.put_pulse("trainer/heartbeat", {"epoch": epoch})
    with pytest.raises(RuntimeError, match="work item 0 already exists"):
        old.put_item(_item(0))
    assert new.begin_epoch({"pid": 2}) == epoch + 1
    writes = [
        lambda: old.put_item(_item(1)),
        lambda: old.close_item(0, "consumed"),
        lambda: old.reopen_item(0),
        lambda: old.revoke(0, b"x"),
        lambda: old.collect(0),
        lambda: old.put_pulse("trainer/heartbeat", {"epoch": epoch}),
        lambda: old.update_epoch(epoch, {"start_version": 3}),
    ]
    for write in writes:
        with pytest.raises(SupersededError, match=f"epoch {epoch} was superseded.*epoch 2"):
            write()
    assert new.item_ids() == [0] and new.closed_ids() == set()
    assert new.pulse("trainer/heartbeat")[0] == {"epoch": epoch}
    assert "start_version" not in new.epoch_record(epoch)
    # The new trainer's own handle, and a sampler's, write as before.
    new.fence(epoch + 1)
    new.put_item(_item(1))
    old.put_pulse("samplers/a", {"version": 0})
    assert new.claim(1, "a") is not None


def test_a_reissued_head_item_is_claimed_first_and_a_failed_claim_keeps_those_won(tmp_path):
    """The head batch's re-issued item (a new, higher id) is claimed before later batches'
    items; a claim that fails with an exchange error after others were won hands over those
    won (rolled out now, not left to lapse)."""
    from sparserl_jax.decoupled.sampler_job import _Claimer

    ex = Exchange("memory://")
    ex.begin_epoch({"start_version": 0})
    q = _queue(ex, tmp_path, staleness=1)
    q.fill(0)  # batch 0: items 0, 1; batch 1: items 2, 3
    q._drop(1, "corrupt", step=1, batch=0, version=0)  # re-issued as 4, in batch 0's place
    assert _batch(q) == [0, 4]
    got = _Claimer(ex, "a", 0, 60.0)(0)
    assert [item.id for _, item in got] == [0, 4]
    claim = ex.claim
    calls = []

    def flaky(i, sampler):
        calls.append(i)
        if len(calls) == 2:
            raise ExchangeError("exchange memory://: write claims/... failed 5 times")
        return claim(i, sampler)

    ex.claim = flaky
    got = _Claimer(ex, "b", 2, 60.0)(0)
    assert [item.id for _, item in got] == [2] and calls == [2, 3]
    calls[:] = ["a call before"]  # the next claim is the failing second call
    with pytest.raises(ExchangeError):  # nothing won: the error is the caller's
        _Claimer(ex, "c", 2, 60.0)(0)


def test_a_resumed_trainer_clears_a_revoked_claim_of_a_reopened_item(tmp_path):
    """A dead trainer expired (revoked) an in-flight item's claim after its checkpoint: the
    resumed trainer reopens the item and clears the revocation, so samplers claim it at once
    instead of after another lease."""
    from sparserl_jax.decoupled.sampler_job import _Claimer

    ex = Exchange("memory://")
    ex.begin_epoch({"start_version": 0})
    q = _queue(ex, tmp_path, staleness=0)
    q.fill(0)
    state = {"queue": q.state(), "data": q.data_it.get_state()}
    claim = ex.claim(0, "s0")
    ex.revoke(0, claim.generation)
    ex.close_item(0, "dropped:expired")
    ex.begin_epoch({"start_version": 0})
    Ledger(tmp_path).truncate(state["queue"]["ledger"])
    _queue(ex, tmp_path, state=state, staleness=0)
    assert ex.claim_state(0)[0] is None and ex.is_open(0)
    assert [item.id for _, item in _Claimer(ex, "s1", 0, 60.0)(0)] == [0, 1]


def test_a_follower_process_stops_with_its_leader_or_when_superseded(tmp_path):
    """A trainer process following process 0's events (`processes.Events.next`): the events in
    order; once the leader's heartbeat stops changing for lease_s, one error; once a newer
    trainer registers an epoch, `SupersededError` (its handle is fenced to its epoch)."""
    from sparserl_jax.decoupled import processes

    url = f"file://{tmp_path}/ex/"
    leader = Exchange(url)
    epoch = leader.begin_epoch({})
    leader.write(f"trainer/events/e{epoch:06d}/{0:09d}", json.dumps({"kind": "stop"}).encode())
    follower = Exchange(url)
    follower.fence(epoch)
    events = processes.Events(follower, epoch, poll_s=0.01, lease_s=0.3)
    assert events.next() == {"kind": "stop"}
    leader.put_pulse("trainer/heartbeat", {"time": 1})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the leader .* stopped: no heartbeat for 0.3 s"):
        events.next()
    assert time.monotonic() - t0 < 5
    Exchange(url).begin_epoch({})  # a newer trainer
    with pytest.raises(SupersededError):
        events.next()
