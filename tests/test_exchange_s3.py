"""The exchange on a real object store: an S3 server (moto's server mode, a local process) behind
tensorstore's s3 driver. Create-if-absent is atomic there (the jobs' probe passes), two processes
racing for claims get one winner per item, and a short `sparserl launch` runs on `s3://`."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparserl_jax.config import load_config
from sparserl_jax.decoupled.exchange import Exchange
from sparserl_jax.decoupled.ledger import check_exactly_once
from sparserl_jax.decoupled.trainer import exchange_url
from sparserl_jax.testing import child_env

pytest.importorskip("moto")
boto3 = pytest.importorskip("boto3")

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
BUCKET = "sparserl-test"
AWS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    """An S3 server on a free local port with one bucket; yields its endpoint URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in AWS}
    os.environ.update(AWS)
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        deadline = time.time() + 60
        while True:
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except Exception:  # not listening yet
                assert time.time() < deadline and server.poll() is None, "moto server did not start"
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spec(endpoint: str, prefix: str):
    cfg = load_config(
        TINY, [f"exchange.url=s3://{BUCKET}/{prefix}/", f"exchange.endpoint={endpoint}"]
    )
    return exchange_url(cfg)


def test_conditional_writes_are_atomic_on_s3(s3):
    ex = Exchange(_spec(s3, "probe"))
    ex.check_conditional_writes()
    assert ex.claim(0, "a") is not None and ex.claim(0, "b") is None


RACE = """
import json, sys, time
from sparserl_jax.decoupled.exchange import Exchange
spec, me, start = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3])
ex = Exchange(spec)
time.sleep(max(0.0, start - time.time()))
print(json.dumps([i for i in range(20) if ex.claim(i, me) is not None]))
"""


def test_two_processes_racing_for_claims_get_one_winner_each(s3):
    spec = _spec(s3, "race")
    start = time.time() + 8  # both processes are up (imports done) by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, json.dumps(spec), me, str(start)],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=ROOT,
        )
        for me in ("p0", "p1")
    ]
    won = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted(won[0] + won[1]) == list(range(20)), won
    ex = Exchange(spec)
    owner = {i: ex.claim_state(i)[0]["sampler"] for i in range(20)}
    assert all(owner[i] == "p0" for i in won[0]) and all(owner[i] == "p1" for i in won[1])


@pytest.mark.slow
def test_launch_runs_on_s3(s3, tmp_path):
    run = tmp_path / "run"
    args = [
        "launch", TINY, "--samplers", "1", f"run_dir={run}", "train.steps=2",
        f"exchange.url=s3://{BUCKET}/launch/", f"exchange.endpoint={s3}", "exchange.poll_s=0.1",
        "train.eval_examples=0", "data.reward_fn=sparserl_jax.testing.fixtures:length_reward",
    ]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "sparserl_jax", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, (
        out.stderr[-3000:],
        (run / "logs" / "trainer.log").read_text()[-3000:],
    )
    assert check_exactly_once(run)["steps"] == 2
    ex = Exchange(_spec(s3, "launch"))
    assert ex.list("sync/e000001/")  # the weights went through the bucket
    assert json.loads(ex.read("trainer/heartbeat")[0])["done"] is True
