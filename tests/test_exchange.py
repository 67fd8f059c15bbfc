"""The decoupled jobs' exchange and ledger without any model: claims (one winner of a race),
rollout blobs (round trip, checksum), work items, trainer incarnations, the exactly-once check."""

import json
import threading

import numpy as np
import pytest
import tensorstore as ts

from sparserl_jax.data import Example
from sparserl_jax.decoupled.exchange import (
    CorruptRolloutError,
    Exchange,
    Rollout,
    WorkItem,
    decode_rollout,
    encode_rollout,
)
from sparserl_jax.decoupled.ledger import Ledger, check_exactly_once
from sparserl_jax.rollout import RolloutResult


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
    for k in ("completion_ids", "sampler_logprobs", "completion_mask", "tokens_evicted"):
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
    with pytest.raises(CorruptRolloutError):
        decode_rollout(b"not a zip")
    ex.put_rollout(r)
    good = ex.read("rollouts/000000000003.npz")[0]
    ex.write("rollouts/000000000004.npz", good)
    ex.write("READY/rollouts/000000000004", ex.read("READY/rollouts/000000000003")[0])
    with pytest.raises(CorruptRolloutError, match="names item 3"):
        ex.rollout(4)


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


def test_unreachable_exchange_raises_not_hangs():
    with pytest.raises(ValueError):
        Exchange("file:///proc/definitely/not/here/", timeout=5).put_item(_item())


def _rows(ledger, name, rows):
    for r in rows:
        ledger.append(name, r)


def test_ledger_truncate_and_exactly_once(tmp_path):
    led = Ledger(tmp_path)
    _rows(led, "consumed", [{"item": i, "batch": i, "step": i + 1} for i in range(3)])
    _rows(led, "dropped", [{"item": 3, "batch": 3, "reason": "stale", "step": 4}])
    pos = led.position()
    assert pos == {"consumed": 3, "dropped": 1}
    _rows(led, "consumed", [{"item": 4, "batch": 3, "step": 4}])
    (tmp_path / "consumed.jsonl").open("a").write('{"item": 5, "ba')  # torn by a kill
    assert len(Ledger(tmp_path).rows("consumed")) == 4
    assert check_exactly_once(tmp_path)["consumed"] == 4
    Ledger(tmp_path).truncate(pos)
    assert Ledger(tmp_path).position() == pos
    # Batch 3 was dropped and is pending re-issue: not lost.
    (tmp_path / "pending.json").write_text(json.dumps([3]))
    assert check_exactly_once(tmp_path) == {
        "consumed": 3,
        "dropped": 1,
        "reasons": {"stale": 1},
    }
    (tmp_path / "pending.json").write_text("[]")
    with pytest.raises(ValueError, match="lost"):
        check_exactly_once(tmp_path)
    _rows(Ledger(tmp_path), "consumed", [{"item": 2, "batch": 3, "step": 4}])
    with pytest.raises(ValueError, match="more than once"):
        check_exactly_once(tmp_path)
    Ledger(tmp_path).truncate(pos)
    _rows(Ledger(tmp_path), "consumed", [{"item": 3, "batch": 3, "step": 4}])
    with pytest.raises(ValueError, match="both consumed and dropped"):
        check_exactly_once(tmp_path)
