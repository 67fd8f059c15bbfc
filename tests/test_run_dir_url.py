"""A run directory on Google Cloud Storage (`run_dir=gs://...`, a GCS emulator on this machine):
the ledger's and the metrics' rows are stored once per flush and read back whole; a corrupt
checkpoint step there is moved aside and the previous one restored; the decoupled trainer
at staleness 0 on a gs:// run_dir, stopped and resumed, ends bit-identical to `sparserl train`
on a local one; a trainer killed with -9 and started again from another directory (another
host, as far as the run can tell) completes with the ledger exactly-once."""

import importlib.util
import itertools
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import tensorstore as ts

from sparserl_jax.build import build_model
from sparserl_jax.checkpoint import CheckpointManager
from sparserl_jax.config import load_config
from sparserl_jax.decoupled.exchange import Exchange
from sparserl_jax.decoupled.ledger import Ledger, check_exactly_once
from sparserl_jax.decoupled.sampler_job import run_sampler
from sparserl_jax.decoupled.trainer import exchange_url, run_trainer
from sparserl_jax.metrics import MetricsWriter, truncate_metrics
from sparserl_jax.rl import Learner
from sparserl_jax.storage import JsonlFile, run_path
from sparserl_jax.testing import assert_trees_equal, child_env
from sparserl_jax.train import train

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")
from sparserl_jax.testing.gcs import gcs_emulator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
BUCKET = "sparserl-test"
FAST = [
    "train.eval_examples=0",
    "exchange.poll_s=0.05",
    "data.reward_fn=sparserl_jax.testing.fixtures:length_reward",
]
_RUNS = itertools.count()


@pytest.fixture(scope="module")
def gcs():
    with gcs_emulator(BUCKET) as url:
        yield url


def _url(gcs, name: str) -> str:
    """A fresh run directory in the bucket (one emulator serves the module's tests)."""
    del gcs
    return f"gs://{BUCKET}/{name}-{next(_RUNS)}-{time.monotonic_ns()}"


def test_run_path_names_what_is_wrong(tmp_path, monkeypatch):
    assert run_path(tmp_path / "a") == (tmp_path / "a").absolute()
    assert run_path(f"file://{tmp_path}/b") == tmp_path / "b"
    with pytest.raises(ValueError, match=r"local path, gs://bucket/dir or s3://bucket/dir"):
        run_path("ftp://host/run")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=r"needs the gcsfs package: pip install 'sparserl-jax\[gcs\]'"
    ):
        run_path("gs://bucket/run")


def test_jsonl_rows_local_and_on_a_store(tmp_path, gcs):
    local = JsonlFile(tmp_path / "x.jsonl")
    local.append([{"a": 1}])
    assert JsonlFile(tmp_path / "x.jsonl").rows() == [{"a": 1}]  # stored at once
    with (tmp_path / "x.jsonl").open("a") as f:
        f.write('{"a": 2}\n{"a"')  # a kill mid-write
    assert local.rows() == [{"a": 1}, {"a": 2}]
    (tmp_path / "y.jsonl").write_text('{"a": 1}\nnot json\n{"a": 3}\n')
    with pytest.raises(ValueError, match=r"y.jsonl: line 2 is not JSON"):
        JsonlFile(tmp_path / "y.jsonl").rows()

    path = run_path(_url(gcs, "jsonl")) / "x.jsonl"
    store = JsonlFile(path)
    store.append([{"a": 1}, {"a": 2}])
    assert store.rows() == [{"a": 1}, {"a": 2}]  # its writer sees what it holds
    assert not path.exists() and JsonlFile(path).rows() == []  # nothing stored before a flush
    store.flush()
    assert JsonlFile(path).rows() == [{"a": 1}, {"a": 2}]
    store.append([{"a": 3}])
    assert JsonlFile(path).rows() == [{"a": 1}, {"a": 2}]
    store.flush()
    assert JsonlFile(path).rows() == [{"a": 1}, {"a": 2}, {"a": 3}]
    store.replace([{"a": 1}])
    assert JsonlFile(path).rows() == [{"a": 1}] == store.rows()
    # A writer that should have been the only one (an old trainer woken after its successor
    # replaced the file) adds its rows after the other's: it does not put back what it last saw.
    stale = JsonlFile(path)
    assert stale.rows() == [{"a": 1}]
    store.replace([{"a": 1}, {"ledger_epoch": 2}])
    stale.append([{"a": 9}])
    stale.flush()
    assert JsonlFile(path).rows() == [{"a": 1}, {"ledger_epoch": 2}, {"a": 9}]


def test_ledger_and_metrics_on_gs(gcs):
    url = _url(gcs, "ledger")
    ledger = Ledger(url)
    ledger.append("consumed", {"item": 0, "step": 1})
    ledger.append("dropped", {"item": 1, "step": 1, "batch": 0, "reason": "stale"})
    assert ledger.position() == {"consumed": 1, "dropped": 1}
    assert Ledger(url).position() == {"consumed": 0, "dropped": 0}
    ledger.flush()
    assert Ledger(url).position() == {"consumed": 1, "dropped": 1}
    ledger.truncate({"consumed": 1})
    assert Ledger(url).rows("dropped") == [] and len(Ledger(url).rows("consumed")) == 1

    with MetricsWriter(url) as w:
        for step in (1, 2, 3):
            w.write(step, {"x": float(step)})
    assert [r["x"] for r in JsonlFile(run_path(url) / "metrics.jsonl").rows()] == [1.0, 2.0, 3.0]
    assert [r["step"] for r in truncate_metrics(url, 2)] == [1, 2]
    assert [r["step"] for r in JsonlFile(run_path(url) / "metrics.jsonl").rows()] == [1, 2]
    with pytest.raises(ValueError, match="train.tensorboard needs a local run_dir"):
        MetricsWriter(url, tensorboard=True)


def _state(seed: int):
    return {"w": jax.random.normal(jax.random.key(seed), (64, 32)), "n": jnp.asarray(seed)}


def test_a_corrupt_checkpoint_on_gs_is_moved_aside(gcs, caplog):
    url = _url(gcs, "ckpt")
    with CheckpointManager(url, keep=3, async_save=False) as ckpt:
        ckpt.save(1, _state(1), {"data": 1})
        ckpt.save(2, _state(2), {"data": 2})
    data = [p for p in (run_path(url) / "checkpoints" / "2" / "state" / "d").iterdir()]
    assert data
    for path in data:  # flip one byte in the middle of every array file
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING), CheckpointManager(url, async_save=False) as ckpt:
        restored, meta = ckpt.restore_latest(_state(0))
        assert ckpt.steps() == [1] and meta == {"data": 1, "step": 1}
        assert_trees_equal(restored, _state(1))
        ckpt.save(2, _state(3), {"data": 3})  # the step saved again, no collision
        assert ckpt.steps() == [1, 2]
    lines = [r.getMessage() for r in caplog.records if "checkpoint step 2" in r.getMessage()]
    assert len(lines) == 1 and "moved to gs://" in lines[0], lines
    moved = list((run_path(url) / "checkpoints.corrupt").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith("2-")
    assert (moved[0] / "_CHECKPOINT_METADATA").exists()


def _final_params(run_dir, step):
    cfg = load_config(TINY, [f"run_dir={run_dir}"])
    model = build_model(cfg.model)
    template = {"learner": Learner(model, cfg.learner).init(model)}
    with CheckpointManager(run_dir, async_save=False) as mngr:
        state, meta = mngr.restore(step, template)
    return jax.device_get(state["learner"].params), meta


def _trainer_and_sampler(cfg, ctx):
    got = {}
    sampler = threading.Thread(
        target=lambda: got.update(
            run_sampler(cfg, "0", url="memory://", exchange=Exchange("memory://", context=ctx))
        ),
        daemon=True,  # a trainer that fails leaves no sampler waiting for it
    )
    sampler.start()
    summary = run_trainer(cfg, exchange=Exchange("memory://", context=ctx))
    sampler.join(timeout=300)
    assert got["exit_code"] == 0, got
    return summary


@pytest.mark.slow
def test_decoupled_trainer_on_gs_resumes_bit_identical_to_local_train(tmp_path, gcs):
    """Staleness 0 (the decoupled trainer equals `sparserl train`, test_decoupled.py): 2 steps,
    stopped, then the same run to 4 steps, on gs://; the final weights equal a local
    uninterrupted `sparserl train` of 4 steps bit for bit, and the ledger is exactly-once."""
    url = _url(gcs, "trainer")
    common = ["data.batch_size=4", "async.max_staleness=0", *FAST]
    assert exchange_url(load_config(TINY, [f"run_dir={url}"])) == f"{url}/exchange/"
    ref = train(load_config(TINY, [f"run_dir={tmp_path / 'ref'}", "train.steps=4", *common]))
    ctx = ts.Context()  # the exchange in memory: the emulator's conditional writes are not atomic
    first = _trainer_and_sampler(
        load_config(TINY, [f"run_dir={url}", "train.steps=2", *common]), ctx
    )
    assert first["end_step"] == 2
    again = _trainer_and_sampler(
        load_config(TINY, [f"run_dir={url}", "train.steps=4", *common]), ctx
    )
    assert again["start_step"] == 2 and again["end_step"] == ref["end_step"] == 4
    a, meta_a = _final_params(tmp_path / "ref", 4)
    b, meta_b = _final_params(url, 4)
    assert_trees_equal(a, b)
    assert meta_a["data_state"] == meta_b["data_state"]
    assert check_exactly_once(url)["steps"] == 4
    rows = [
        r for r in JsonlFile(run_path(url) / "metrics.jsonl").rows() if "critic/score/mean" in r
    ]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert json.loads((run_path(url) / "config.json").read_text())["run_dir"] == url


@pytest.mark.slow
def test_trainer_on_gs_killed_and_restarted_elsewhere_completes_exactly_once(tmp_path, gcs):
    """`sparserl trainer` and `sparserl sampler` as processes, run_dir on gs:// and the exchange
    a shared directory; the trainer is killed with -9 after its step-2 checkpoint and started
    again from another working directory: the run completes, every batch trained once, and
    the rows of the checkpointed steps are the ones the first trainer stored."""
    url = _url(gcs, "kill")
    common = [TINY, f"run_dir={url}", f"exchange.url=file://{tmp_path}/exchange/"]
    common += ["train.steps=6", "train.save_every=2", "async.max_staleness=1", "exchange.lease_s=8"]
    common += [*FAST]
    env = child_env()
    spawned = []

    def spawn(*args, cwd):
        log = (tmp_path / f"{args[0]}.log").open("ab")
        cmd = [sys.executable, "-m", "sparserl_jax", *args]
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        spawned.append(proc)
        return proc

    def wait_for(cond, proc, what, timeout=600):
        deadline = time.time() + timeout
        while not cond():
            assert time.time() < deadline, f"timed out waiting for {what}"
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            time.sleep(0.2)

    try:
        sampler = spawn("sampler", TINY, "--id", "0", *common[1:], cwd=ROOT)
        trainer = spawn("trainer", *common, cwd=ROOT)
        ckpt2 = run_path(url) / "checkpoints" / "2" / "commit_success.txt"
        wait_for(ckpt2.exists, trainer, "checkpoint 2")
        wait_for(
            lambda: any(r["step"] >= 3 for r in Ledger(url).rows("consumed")), trainer, "step 3"
        )
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        before = Ledger(url).rows("consumed")
        elsewhere = tmp_path / "other-host"
        elsewhere.mkdir()
        again = spawn("trainer", *common, cwd=elsewhere)
        assert again.wait(timeout=900) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert sampler.wait(timeout=120) == 0, (tmp_path / "sampler.log").read_text()[-3000:]
    finally:
        for proc in spawned:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "resumed from gs://" in (tmp_path / "trainer.log").read_text()
    assert check_exactly_once(url)["steps"] == 6
    rows = Ledger(url).rows("consumed")
    assert [r for r in rows if r["step"] <= 2] == [r for r in before if r["step"] <= 2]
    assert {r["epoch"] for r in rows if r["step"] > 2} == {2}


@pytest.mark.slow
def test_two_trainer_processes_on_gs_resume_bit_identical_to_local(tmp_path, gcs):
    """`sparserl launch --trainer-processes 2` on a gs:// run_dir (both processes save and
    restore their shards there; the leader alone writes the ledger and metrics): 2 steps, then
    the same run to 4 resumes from the checkpoint both saved, exactly-once, and its step-4
    arrays have the bits of an uninterrupted two-process run on a local run_dir."""
    url = _url(gcs, "two")
    fixed = ["data.batch_size=4", "async.max_staleness=0", "train.save_every=2"]
    fixed += ["exchange.lease_s=20", "sft.steps=0", *FAST]
    cmd = [sys.executable, "-m", "sparserl_jax", "launch", TINY, "--samplers", "1"]
    cmd += ["--trainer-processes", "2", *fixed]
    runs = [(url, 2), (url, 4), (str(tmp_path / "local"), 4)]
    for run_dir, steps in runs:
        where = [f"run_dir={run_dir}", f"train.steps={steps}"]
        if run_dir == url:
            where.append(f"exchange.url=file://{tmp_path}/exchange/")
        done = subprocess.run(
            [*cmd, *where],
            cwd=tmp_path,  # the launcher's logs for a URL: ./logs/<the URL's last part>/
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    logs = tmp_path / "logs" / url.rsplit("/", 1)[-1]
    summary = json.loads((logs / "trainer.json").read_text().strip().splitlines()[-1])
    assert summary["start_step"] == 2 and summary["end_step"] == 4
    assert check_exactly_once(url)["steps"] == 4

    def digests(run_dir):
        path = run_path(run_dir) / "checkpoints" / "4" / "digests" / "metadata"
        return json.loads(path.read_text())["arrays"]

    assert digests(url) == digests(tmp_path / "local")
