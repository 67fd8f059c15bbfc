"""Decoupled training (`sparserl trainer` / `sampler` / `launch`) end to end on the tiny config:
staleness 0 equals `sparserl train` bit for bit; a launch with 2 samplers, one killed with -9
mid-run, completes with every rollout's weights verified; a trainer killed with -9 and started
again, and then a sampler killed and started again, complete with the ledger exactly-once and
every weight version sent in PULSESync format 3; a sampler with no trainer gives up cleanly."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import pytest
import tensorstore as ts

from sparserl_jax.build import build_model
from sparserl_jax.checkpoint import CheckpointManager
from sparserl_jax.config import load_config
from sparserl_jax.decoupled.exchange import Exchange, SupersededError
from sparserl_jax.decoupled.ledger import Ledger, check_exactly_once
from sparserl_jax.decoupled.sampler_job import GAVE_UP, run_sampler
from sparserl_jax.decoupled.trainer import run_trainer
from sparserl_jax.metrics import read_metrics
from sparserl_jax.rl import Learner
from sparserl_jax.sync.header import read_header
from sparserl_jax.testing import assert_trees_equal, child_env
from sparserl_jax.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
# The length reward makes every rollout move the weights (the task's reward is 0 for a random
# model: zero advantages, and weights that would agree whatever was sampled).
FAST = [
    "train.eval_examples=0",
    "exchange.poll_s=0.05",
    "data.reward_fn=sparserl_jax.testing.fixtures:length_reward",
]


def _final_params(run_dir, step):
    cfg = load_config(TINY, [f"run_dir={run_dir}"])
    model = build_model(cfg.model)
    template = {"learner": Learner(model, cfg.learner).init(model)}
    mngr = CheckpointManager(run_dir, async_save=False)
    state, meta = mngr.restore(step, template)
    mngr.close()
    return jax.device_get(state["learner"].params), meta


@pytest.mark.parametrize(
    "url,why",
    [("memory://", "no trainer heartbeat yet"), ("nosuchdriver://x/", "cannot reach the exchange")],
)
def test_sampler_without_trainer_or_exchange_gives_up_with_a_log_line(tmp_path, url, why):
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "exchange.give_up_s=1", *FAST])
    lines = []
    out = run_sampler(cfg, "lonely", url=url, log_fn=lines.append)
    assert out["exit_code"] == GAVE_UP and out["items"] == []
    assert lines and all("waiting" in line and why in line for line in lines), lines


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh",
    [
        [],
        # The sampler's engine with its weights split over fsdp, never gathered (issue 29).
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "rollout.fsdp_shards=true"],
    ],
    ids=["data", "fsdp_shards"],
)
def test_staleness_zero_equals_sparserl_train_bit_for_bit(tmp_path, mesh):
    """One process, one exchange in memory: the decoupled trainer (main thread) and a sampler
    (a thread) with `async.max_staleness=0` train on the same batches, seeds and weights as
    `sparserl train`, so the final master weights are equal bit for bit."""
    # data.batch_size=4: 8 rows over the 8 fake devices of the test process.
    common = ["train.steps=3", "data.batch_size=4", "async.max_staleness=0", *FAST, *mesh]
    ref = train(load_config(TINY, [f"run_dir={tmp_path / 'ref'}", *common]), log_fn=print)
    cfg = load_config(TINY, [f"run_dir={tmp_path / 'dec'}", *common])
    ctx = ts.Context()
    got = {}
    sampler = threading.Thread(
        target=lambda: got.update(
            run_sampler(cfg, "0", url="memory://", exchange=Exchange("memory://", context=ctx))
        )
    )
    sampler.start()
    summary = run_trainer(cfg, exchange=Exchange("memory://", context=ctx))
    sampler.join(timeout=300)
    assert summary["end_step"] == ref["end_step"] == 3 and summary["dropped"] == {}
    # One item per prompt; the one sampler claims each whole batch and rolls it out at once.
    assert got["exit_code"] == 0 and got["items"] == list(range(12))
    a, meta_a = _final_params(tmp_path / "ref", 3)
    b, meta_b = _final_params(tmp_path / "dec", 3)
    assert_trees_equal(a, b)
    assert meta_a["data_state"] == meta_b["data_state"]
    assert meta_a["sync_version"] == meta_b["sync_version"] == 3
    rows = Ledger(tmp_path / "dec").rows("consumed")
    assert [(r["item"], r["step"], r["first"], r["staleness"]) for r in rows] == [
        (i, i // 4 + 1, i % 4, 0) for i in range(12)
    ]
    assert check_exactly_once(tmp_path / "dec")["steps"] == 3
    ra = read_metrics(tmp_path / "ref" / "metrics.jsonl")
    rb = read_metrics(tmp_path / "dec" / "metrics.jsonl")
    assert [r["critic/score/mean"] for r in ra] == [r["critic/score/mean"] for r in rb]
    assert all(r["critic/score/std"] > 0 for r in rb)  # the rollouts did steer the updates


_SPAWNED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_spawned():
    """A test that fails while its jobs run (a timeout, say) leaves none of them running."""
    yield
    while _SPAWNED:
        proc = _SPAWNED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _spawn(*args, log: Path, code: str | None = None):
    """`python -m sparserl_jax ARGS` (or `python -c CODE ARGS`) with its output in `log`."""
    cmd = [sys.executable, *(["-c", code] if code else ["-m", "sparserl_jax"]), *args]
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
    _SPAWNED.append(proc)
    return proc


def _wait_for(cond, proc, what, timeout=600):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        assert proc is None or proc.poll() is None, f"ended before {what}"
        time.sleep(0.05)


def _verified_versions(log: Path) -> set[tuple[int, int]]:
    """(epoch, version) pairs a sampler's log says it verified bit-identical."""
    epoch, out = None, set()
    for line in log.read_text().splitlines():
        if m := re.search(r"following trainer epoch (\d+)", line):
            epoch = int(m.group(1))
        if m := re.search(r"(?:anchor|patch) (\d+) verified bit-identical", line):
            out.add((epoch, int(m.group(1))))
    return out


def _check_rows_verified(run_dir: Path, logs: dict[str, Path]) -> list[dict]:
    rows = Ledger(run_dir).rows("consumed")
    for r in rows:
        assert r["verified"] and r["staleness"] <= 1, r
        assert (r["rollout_epoch"], r["weight_version"]) in _verified_versions(logs[r["sampler"]])
    return rows


@pytest.mark.slow
def test_launch_two_samplers_one_killed_completes(tmp_path):
    """`sparserl launch --samplers 2`; sampler 1 is killed with -9 while it holds a claim: its
    claim expires, the item is re-issued, sampler 0 finishes the run. Every consumed rollout
    was made with weights its sampler verified bit-identical; the ledger is exactly-once."""
    run = tmp_path / "run"
    args = [
        "launch",
        TINY,
        "--samplers",
        "2",
        f"run_dir={run}",
        # Staleness 0: one batch in flight at a time, so the run cannot finish without the
        # killed sampler's item, and its claim must expire (at staleness > 0 the others could
        # finish the run before the lease runs out, leaving it pending).
        "train.steps=8",
        "async.max_staleness=0",
        "exchange.lease_s=4",
        *FAST,
        "train.eval_examples=2",  # held-out reward before and after, as `sparserl train` prints
    ]
    launcher = _spawn(*args, log=tmp_path / "launch.log")
    ex_dir = run / "exchange"
    logs = {str(i): run / "logs" / f"sampler-{i}.log" for i in range(2)}

    def sampler1_claims():
        # Through the exchange, not the directory: a listing of claims/ also shows the file
        # driver's transient `<key>.__lock` files, gone by the time they are read.
        if not ex_dir.is_dir():
            return False
        ex = Exchange(f"file://{ex_dir}/")
        for i in ex.claimed_ids() - ex.ready_rollouts():
            claim, _ = ex.claim_state(i)
            if claim is not None and claim["sampler"] == "1":
                return True
        return False

    _wait_for(lambda: logs["1"].exists() and sampler1_claims(), launcher, "a claim of sampler 1")
    pid = int(re.search(r"sampler 1 pid (\d+)", (tmp_path / "launch.log").read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    assert launcher.wait(timeout=900) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    summary = json.loads((run / "logs" / "trainer.json").read_text())
    assert summary["end_step"] == 8 and summary["dropped"].get("expired", 0) >= 1
    assert {"val_reward_before", "val_reward_after", "train_reward_last"} <= set(summary)
    assert check_exactly_once(run)["steps"] == 8
    assert json.loads((run / "pending.json").read_text()) == []  # batch 0 re-issued, consumed
    rows = _check_rows_verified(run, logs)
    assert {r["sampler"] for r in rows} <= {"0", "1"} and "0" in {r["sampler"] for r in rows}
    dropped = Ledger(run).rows("dropped")
    assert any(d["reason"] == "expired" and d["sampler"] == "1" for d in dropped)
    assert not any(d["reason"] == "stale" for d in dropped)  # paced, never dropped as stale
    metrics = [m for m in read_metrics(run / "metrics.jsonl") if "critic/score/mean" in m]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert metrics[-1]["async/expired_claims"] >= 1 and "async/trainer_wait_s" in metrics[-1]
    for m in metrics:  # the correction's metrics split by staleness
        split = "correction_stale/" if m["async/staleness"] else "correction_fresh/"
        key = "masked_token_fraction"
        assert m[split + key] == m["correction/" + key]


@pytest.mark.slow
def test_trainer_kill9_then_same_command_completes_exactly_once(tmp_path):
    """The trainer is killed with -9 after its step-2 checkpoint; one sampler keeps running and
    follows the restarted trainer's new epoch (from its anchor). Then the sampler is killed with
    -9 and started again: it joins late, from the newest anchor and the patches after it. The run
    completes; every data batch is trained on exactly once, no ledger row is duplicated, and
    every weight version a sampler used came in format 3 and was verified bit-identical."""
    run = tmp_path / "run"
    common = [TINY, f"run_dir={run}", "train.steps=8", "train.save_every=2"]
    common += ["async.max_staleness=1", "exchange.lease_s=8", "sync.anchor_every=3", *FAST]
    slog, tlog = tmp_path / "sampler.log", tmp_path / "trainer.log"
    sampler_args = ("sampler", *common[:1], "--id", "0", *common[1:])
    sampler = _spawn(*sampler_args, log=slog)
    trainer = _spawn("trainer", *common, log=tlog)
    _wait_for(lambda: (run / "checkpoints" / "2").is_dir(), trainer, "checkpoint 2")
    _wait_for(lambda: len(Ledger(run).rows("consumed")) >= 3, trainer, "step 3")
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    before = Ledger(run).rows("consumed")
    assert sampler.poll() is None
    again = _spawn("trainer", *common, log=tlog)
    _wait_for(lambda: len(Ledger(run).rows("consumed")) >= 5, again, "step 5")
    sampler.send_signal(signal.SIGKILL)
    sampler.wait()
    restarted = len(slog.read_text().splitlines())
    sampler = _spawn(*sampler_args, log=slog)
    assert again.wait(timeout=900) == 0, tlog.read_text()[-3000:]
    assert sampler.wait(timeout=120) == 0, slog.read_text()[-3000:]
    assert "resumed from" in tlog.read_text()
    assert check_exactly_once(run)["steps"] == 8
    rows = Ledger(run).rows("consumed")
    assert sorted({r["step"] for r in rows}) == list(range(1, 9))
    kept = [r for r in rows if r["step"] <= 2]
    assert kept == [r for r in before if r["step"] <= 2]  # the checkpointed steps' rows stay
    assert {r["epoch"] for r in rows if r["step"] > 2} == {2}
    assert not any(d["reason"] == "stale" for d in Ledger(run).rows("dropped"))
    _check_rows_verified(run, {"0": slog})
    assert "following trainer epoch 2" in slog.read_text()
    # The restarted sampler took an anchor, then patches, all verified.
    late = slog.read_text().splitlines()[restarted:]
    first = next(i for i, line in enumerate(late) if "verified bit-identical" in line)
    assert re.search(r"anchor \d+ verified bit-identical", late[first]), late[first]
    assert any(re.search(r"patch \d+ verified bit-identical", line) for line in late[first:])
    assert not any("refused" in line for line in late)
    ex = Exchange(f"file://{run}/exchange/")
    for epoch in (1, 2):
        tr = ex.sync_transport(epoch)
        kinds = [(v, k) for k in ("anchor", "patch") for v in tr.versions(k)]
        assert kinds and all(read_header(tr.get(v, k))["format"] == 3 for v, k in kinds)


# The trainer, stopping itself (SIGSTOP) at a chosen point: right after its step-2 checkpoint,
# or past the fence check of its first verdict of step 3 (`close_item`) and before that item's
# ledger row (where CI once caught a woken trainer). An outside SIGSTOP at a random moment can
# catch it mid-write on the file exchange, holding that key's lock (docs/decoupled.md).
_STOP_AT = """
import os, signal, sys
from sparserl_jax import checkpoint
from sparserl_jax.decoupled import ledger
def stop_once():
    if not os.environ.get("STOPPED"):
        os.environ["STOPPED"] = "1"
        os.kill(os.getpid(), signal.SIGSTOP)
append, wait = ledger.Ledger.append, checkpoint.CheckpointManager.wait
def append_stop(self, name, row):
    if WHERE == "past_its_fence_check" and name == "consumed" and row["step"] == 3:
        stop_once()
    append(self, name, row)
def wait_stop(self):
    wait(self)
    if WHERE == "after_its_checkpoint" and self.steps() and self.steps()[-1] == 2:
        stop_once()
ledger.Ledger.append, checkpoint.CheckpointManager.wait = append_stop, wait_stop
from sparserl_jax.cli import main
sys.exit(main())
"""


def _stopped(proc) -> bool:
    return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["after_its_checkpoint", "past_its_fence_check"])
def test_an_old_trainer_resumed_with_sigcont_exits_without_writing(tmp_path, where):
    """Trainer A freezes (SIGSTOP) after its step-2 checkpoint, or past the fence check of a
    verdict and before its ledger row; trainer B, the same command, registers epoch 2,
    resumes and trains; A, resumed with SIGCONT, exits 5 at its next write
    (the fence) and nothing it writes counts: the ledger's rows read the same (a row written
    past the check is in the file, after B's marker, and is counted as `superseded`), every row
    after the checkpoint B resumed from is epoch 2's, no checkpoint appears while A runs again,
    and the run completes exactly once."""
    run = tmp_path / "run"
    common = [TINY, f"run_dir={run}", "train.steps=6", "train.save_every=2"]
    common += ["async.max_staleness=1", "exchange.lease_s=8", *FAST]
    alog, blog, slog = (tmp_path / f"{x}.log" for x in ("a", "b", "sampler"))
    sampler = _spawn("sampler", *common[:1], "--id", "0", *common[1:], log=slog)
    past = where == "past_its_fence_check"
    a = _spawn("trainer", *common, log=alog, code=f"WHERE = {where!r}\n{_STOP_AT}")
    _wait_for(lambda: _stopped(a), a, f"the trainer stopped {where}")
    try:
        b = _spawn("trainer", *common, log=blog)
        _wait_for(
            lambda: any(r["epoch"] == 2 for r in Ledger(run).rows("consumed")), b, "epoch 2's step"
        )
        b.send_signal(signal.SIGSTOP)  # B holds still while A runs again: what changes is A's
        before = (Ledger(run).rows("consumed"), Ledger(run).rows("dropped"))
        checkpoints = sorted(os.listdir(run / "checkpoints"))
        a.send_signal(signal.SIGCONT)
        assert a.wait(timeout=120) == 5, alog.read_text()[-3000:]
        assert "trainer epoch 1 was superseded" in alog.read_text()
        assert (Ledger(run).rows("consumed"), Ledger(run).rows("dropped")) == before
        assert sorted(os.listdir(run / "checkpoints")) == checkpoints
        if past:  # the race was run: A's row is in the file, not counted
            assert Ledger(run).superseded() == {"consumed": 1, "dropped": 0}
    finally:
        a.send_signal(signal.SIGCONT)
        b.send_signal(signal.SIGCONT)
    assert b.wait(timeout=900) == 0, blog.read_text()[-3000:]
    assert sampler.wait(timeout=120) == 0, slog.read_text()[-3000:]
    done = check_exactly_once(run)
    assert done["steps"] == 6 and (done["superseded"] == 1 or not past)
    start = json.loads(blog.read_text().strip().splitlines()[-1])["start_step"]
    rows = Ledger(run).rows("consumed")
    assert start >= 2 and {r["epoch"] for r in rows if r["step"] > start} == {2}


def _threads(cfg_trainer, cfg_sampler, ctx, *, sampler_first_s: float = 0.0):
    """Run a sampler (a thread, started `sampler_first_s` before the trainer, and still running
    then) and the trainer on one in-memory exchange; returns (trainer summary, sampler summary)."""
    got = {}
    sampler = threading.Thread(
        target=lambda: got.update(
            run_sampler(
                cfg_sampler, "0", url="memory://", exchange=Exchange("memory://", context=ctx)
            )
        )
    )
    sampler.start()
    time.sleep(sampler_first_s)
    # A sampler gone before the trainer starts would leave the trainer waiting for rollouts.
    assert sampler.is_alive(), f"the sampler exited before the trainer started: {got}"
    summary = run_trainer(cfg_trainer, exchange=Exchange("memory://", context=ctx))
    sampler.join(timeout=300)
    return summary, got


@pytest.mark.slow
def test_a_finished_run_relaunched_with_more_steps_completes(tmp_path):
    """A finished run's last beat says `done` at its step; a sampler started for a relaunch with
    more `train.steps` waits for the new trainer instead of exiting on that beat."""
    ctx = ts.Context()
    common = [f"run_dir={tmp_path}", "data.batch_size=4", "async.max_staleness=0", *FAST]
    short = load_config(TINY, [*common, "train.steps=2"])
    summary, got = _threads(short, short, ctx)
    assert summary["end_step"] == 2 and got["exit_code"] == 0
    longer = load_config(TINY, [*common, "train.steps=4"])
    summary, got = _threads(longer, longer, ctx, sampler_first_s=3.0)
    assert summary["start_step"] == 2 and summary["end_step"] == 4
    assert got["exit_code"] == 0 and got["items"] == list(range(8, 16))  # 4 per batch


@pytest.mark.slow
def test_a_relaunched_trainer_takes_the_evaluation_on_record(tmp_path, monkeypatch):
    """A trainer relaunched at a step whose held-out evaluation is on record (a finished run
    given more steps) does not decode the held-out set again for its "before"; relaunched at its
    end with nothing to do, it decodes nothing and writes no second row for the same weights."""
    from sparserl_jax.decoupled.evaluate import Evaluator

    ctx = ts.Context()
    common = [f"run_dir={tmp_path}", "data.batch_size=4", "async.max_staleness=0", *FAST]
    common.append("train.eval_examples=2")  # after FAST's 0: the later one holds
    short = load_config(TINY, [*common, "train.steps=2"])
    summary, _ = _threads(short, short, ctx)
    at_2 = next(r for r in read_metrics(tmp_path) if r["step"] == 2 and "val/reward_mean" in r)
    calls, logs = [], []
    real = Evaluator.__call__
    monkeypatch.setattr(Evaluator, "__call__", lambda *a: calls.append(1) or real(*a))
    longer = load_config(TINY, [*common, "train.steps=4"])
    summary, got = _threads(longer, longer, ctx, sampler_first_s=3.0)
    assert summary["start_step"] == 2 and summary["end_step"] == 4 and got["exit_code"] == 0
    assert len(calls) == 1  # the "after" one only
    assert summary["val_reward_before"] == at_2["val/reward_mean"]
    calls[:] = []
    summary = run_trainer(longer, exchange=Exchange("memory://", context=ctx), log_fn=logs.append)
    assert summary["start_step"] == summary["end_step"] == 4 and calls == []
    assert any(m.startswith("step 4: held-out reward") for m in logs), logs
    assert [r["step"] for r in read_metrics(tmp_path) if "val/reward_mean" in r] == [0, 2, 4]


@pytest.mark.slow
def test_checkpoints_a_superseded_trainer_saved_are_moved_aside(tmp_path, monkeypatch):
    """Checkpoints of epoch 1 saved after epoch 2 resumed from step 2 (an old trainer past its
    fence check, woken late): one that lands while epoch 2 runs (step 4, before epoch 2 saves
    step 4 itself) is moved aside before that save; one found at a restore (step 6) is moved
    aside and the checkpoint before it restored. The run stays exactly once."""
    from sparserl_jax.decoupled import trainer as trainer_module

    ctx = ts.Context()
    common = [f"run_dir={tmp_path}", "data.batch_size=4", "async.max_staleness=0", *FAST]
    cfg = {n: load_config(TINY, [*common, f"train.steps={n}"]) for n in (2, 4, 6)}
    assert _threads(cfg[2], cfg[2], ctx)[0]["end_step"] == 2
    restore, old = trainer_module._restore, {}

    def plant(*args, **kwargs):  # the old trainer's step 4, once epoch 2 has restored step 2
        state, meta = restore(*args, **kwargs)
        copy = jax.tree.map(lambda x: x.copy(), state)  # the trainer donates its own
        old.update(state=copy, meta={**meta, "epoch": 1})
        with CheckpointManager(tmp_path, async_save=False) as ckpt:
            ckpt.save(4, {"learner": state}, old["meta"])
        return state, meta

    monkeypatch.setattr(trainer_module, "_restore", plant)
    summary, got = _threads(cfg[4], cfg[4], ctx, sampler_first_s=3.0)
    assert (summary["epoch"], summary["start_step"], summary["end_step"]) == (2, 2, 4)
    assert len(list((tmp_path / "checkpoints.corrupt").glob("4-*"))) == 1
    monkeypatch.setattr(trainer_module, "_restore", restore)
    with CheckpointManager(tmp_path, async_save=False) as ckpt:
        assert ckpt.restore(4, {"learner": old["state"]})[1]["epoch"] == 2
        ckpt.save(6, {"learner": old["state"]}, old["meta"])  # the old trainer's step 6
    summary, got = _threads(cfg[6], cfg[6], ctx, sampler_first_s=3.0)
    assert (summary["epoch"], summary["start_step"], summary["end_step"]) == (3, 4, 6)
    assert len(list((tmp_path / "checkpoints.corrupt").glob("6-*"))) == 1
    assert check_exactly_once(tmp_path)["steps"] == 6


@pytest.mark.slow
def test_samplers_wait_through_a_long_trainer_start(tmp_path, monkeypatch):
    """The trainer beats from its first moment: a sampler whose give-up time is shorter than
    the trainer's start-up (restore, warm start) waits instead of giving up."""
    from sparserl_jax.decoupled import trainer as trainer_module

    restore = trainer_module._restore

    def slow_restore(*args, **kwargs):
        time.sleep(6.0)  # a long restore or SFT warm start
        return restore(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "_restore", slow_restore)
    common = [f"run_dir={tmp_path}", "data.batch_size=4", "async.max_staleness=0", *FAST]
    cfg = load_config(TINY, [*common, "train.steps=1", "exchange.give_up_s=3"])
    ctx, out = ts.Context(), {}
    trainer = threading.Thread(
        target=lambda: out.update(run_trainer(cfg, exchange=Exchange("memory://", context=ctx))),
        daemon=True,  # left waiting for rollouts if the sampler gave up (the test then fails)
    )
    trainer.start()
    got = run_sampler(cfg, "0", url="memory://", exchange=Exchange("memory://", context=ctx))
    assert got["exit_code"] == 0 and got["items"] == [0, 1, 2, 3], got  # one batch, 4 items
    trainer.join(timeout=300)
    assert out["end_step"] == 1


@pytest.mark.slow
def test_a_slow_upload_keeps_its_claim(tmp_path, monkeypatch):
    """The sampler renews its claim through the rollout's upload: an upload longer than the
    lease does not let the trainer expire the item (nothing is dropped or re-issued)."""
    put = Exchange.put_rollout
    slow = [True]

    def slow_put(self, rollout):
        if slow.pop() if slow else False:
            time.sleep(5.0)  # more than exchange.lease_s
        return put(self, rollout)

    monkeypatch.setattr(Exchange, "put_rollout", slow_put)
    common = [f"run_dir={tmp_path}", "data.batch_size=4", "async.max_staleness=0", *FAST]
    cfg = load_config(TINY, [*common, "train.steps=2", "exchange.lease_s=2"])
    summary, got = _threads(cfg, cfg, ts.Context())
    assert not slow, "the upload was never slowed"
    assert summary["end_step"] == 2 and summary["dropped"] == {}, summary["dropped"]
    assert got["exit_code"] == 0 and got["items"] == list(range(8))  # 2 batches of 4 items


def test_a_superseded_trainer_stops_before_writing_more(tmp_path):
    """A newer trainer registering on the exchange (its epoch record) stops a running one at its
    next write: no item, verdict, ledger row, checkpoint or heartbeat after it."""
    cfg = load_config(
        TINY,
        [
            f"run_dir={tmp_path}",
            "data.batch_size=4",
            "async.max_staleness=1",
            "train.steps=3",
            "exchange.pulse_s=0.2",
            *FAST,
        ],
    )
    ctx, out = ts.Context(), {}

    def run():
        try:
            out["summary"] = run_trainer(cfg, exchange=Exchange("memory://", context=ctx))
        except SupersededError as e:
            out["error"] = e

    trainer = threading.Thread(target=run, daemon=True)
    trainer.start()
    ex = Exchange("memory://", context=ctx)
    deadline = time.monotonic() + 300
    while len(ex.item_ids()) < 8 and time.monotonic() < deadline:  # waiting for rollouts
        time.sleep(0.1)
    items, checkpoints = ex.item_ids(), sorted(os.listdir(tmp_path / "checkpoints"))
    assert items == list(range(8))  # 2 batches in flight, 4 items each
    assert ex.begin_epoch({"pid": 0}) == 2  # a newer trainer
    trainer.join(timeout=60)
    assert "summary" not in out and "trainer epoch 1 was superseded" in str(out["error"])
    beat = ex.pulse("trainer/heartbeat")
    time.sleep(0.6)  # three beat periods
    # (its last beat may still say `starting`: the fence can stop it before it beats again)
    assert ex.pulse("trainer/heartbeat") == beat and beat[0]["epoch"] in (None, 1)
    assert ex.item_ids() == items and ex.closed_ids() == set()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == checkpoints
    assert Ledger(tmp_path).rows("consumed") == [] and Ledger(tmp_path).rows("dropped") == []


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["keep", "recompute"])
def test_a_sampler_takes_new_weights_mid_rollout(tmp_path, monkeypatch, cache):
    """Partial rollouts: one sampler at staleness 1 rolls out batch 1 with version 0 while the
    trainer learns from batch 0; its second rollout waits at its first chunk boundary until
    the trainer's heartbeat names version 1, takes it, and finishes with it (keeping the R-KV
    cache, or rebuilding a dense one). The trainer accepts the rollout (every version used
    verified), reports its tokens' staleness and the sequences that span two versions, and
    drops nothing."""
    from sparserl_jax.decoupled import sampler_job

    made = []
    call = sampler_job._Refresh.__call__

    def waiting_call(self):
        if len(made) == 2 and self is made[1] and len(self.used) == 1:  # 2nd rollout, not yet
            deadline = time.monotonic() + 120
            while (self.ex.pulse("trainer/heartbeat")[0] or {}).get("version", 0) < 1:
                assert time.monotonic() < deadline, "version 1 was never published"
                time.sleep(0.05)
            self._last = 0.0
        return call(self)

    init = sampler_job._Refresh.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(sampler_job._Refresh, "__call__", waiting_call)
    monkeypatch.setattr(sampler_job._Refresh, "__init__", recording_init)
    common = [f"run_dir={tmp_path}", "data.batch_size=4", "async.max_staleness=1", *FAST]
    common += ["train.steps=2", "rollout.chunk_steps=2", f"async.partial_cache={cache}"]
    cfg = load_config(TINY, common + (["rollout.kv.policy=none"] if cache == "recompute" else []))
    summary, got = _threads(cfg, cfg, ts.Context())
    assert summary["end_step"] == 2 and summary["dropped"] == {}, summary
    assert made[1].used.keys() == {0, 1}
    rows = Ledger(tmp_path).rows("consumed")
    # Staleness is the oldest token's: 4 slots hold items 0 and 1 (2 samples each) from the
    # start, with version 0; items 2 and 3 are prefilled after the swap, all with version 1.
    assert [r["staleness"] for r in rows if r["step"] == 2] == [1, 1, 0, 0]
    metrics = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "critic/score/mean" in m]
    assert metrics[0]["async/spanning_versions_fraction"] == 0.0
    assert metrics[1]["async/spanning_versions_fraction"] > 0
    assert metrics[1]["async/token_staleness_max"] == 1
    assert 0 < metrics[1]["async/token_staleness_mean"] < 1
