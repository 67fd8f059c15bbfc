"""PULSELoCo across two processes joined by `jax.distributed` on localhost (gloo CPU collectives).

The test launches this file twice as a script (one replica per process, one CPU device each),
with a free port, an initialization timeout and a hard wall-clock limit, so a hung child can never
hang the suite. Each child records, after every outer round, the SHA-256 of its global θ, the
digest of the θ copy its replica restarts from, and the gathered entry counts, once with each
payload format (int32 indices, packed gate, the coded bytes of `loco_wire`, all with bf16
values). The two processes must agree bit for bit each round, the formats must give the same θ,
and so must the same run done inside this process on two fake CPU devices (topology (a)).
"""

import json
import sys

import jax
import optax
import pytest

from benchmarks.bigram import chain, sample
from benchmarks.loco import build_model, next_token_loss
from sparserl_jax.sync import loco
from sparserl_jax.sync.loco_runtime import LoCoTrainer, replica_mesh
from sparserl_jax.testing.processes import join, run_processes

pytestmark = pytest.mark.slow

H, R, ROUNDS, BATCH, LENGTH, LR = 3, 2, 3, 4, 9, 1e-4
PAYLOADS = ("index", "bitmask", "coded")
WALL_S = 240  # both children together; they normally finish in ~45 s (three runs each)


def run_rounds(mesh, payload: str) -> list[dict]:
    """The shared experiment; each process feeds only the batches of its own replicas."""
    graphdef, params = build_model("tiny", seed=0)
    data = sample(chain(128, seed=1), (ROUNDS, H, R, BATCH), LENGTH, seed=2)
    # One padded payload shape for every round: fewer compilations in the children.
    cfg = loco.LoCoConfig(method="pulseloco", inner_steps=H, pad_multiple=4096, payload=payload)
    trainer = LoCoTrainer(next_token_loss(graphdef), params, optax.adamw(LR), cfg, mesh=mesh)
    out = []
    for k in range(ROUNDS):
        stats = trainer.round({r: data[k, :, r] for r in trainer.local})
        out.append(
            {
                "theta": trainer.global_digest(),
                "replicas": {str(r): d for r, d in trainer.replica_digests().items()},
                "counts": list(stats.counts),
                "sent_bytes": stats.sent_bytes,
                "payload_format": stats.payload_format,
                "num_params": trainer.num_params,
            }
        )
    return out


def test_two_processes_agree_bit_for_bit(tmp_path):
    outs = [tmp_path / f"process{p}.json" for p in range(R)]
    run_processes(__file__, [[o] for o in outs], devices_per_process=1, wall_s=WALL_S)
    results = [json.loads(o.read_text()) for o in outs]
    for fmt in PAYLOADS:
        for k in range(ROUNDS):
            a, b = results[0][fmt][k], results[1][fmt][k]
            # Both processes hold the same global θ after every outer step ...
            assert a["theta"] == b["theta"], f"{fmt} round {k + 1}: processes disagree"
            assert a["counts"] == b["counts"]
            # ... and each one's replica restarts from exactly that θ.
            assert a["replicas"] == {"0": a["theta"]} and b["replicas"] == {"1": b["theta"]}
            assert 0 < max(a["counts"]) < a["num_params"]  # a real sparse exchange
            assert a["payload_format"] == fmt
            assert a["sent_bytes"] == b["sent_bytes"]  # both decoded every replica's payload
            if fmt == "coded":
                assert a["sent_bytes"] < results[0]["index"][k]["sent_bytes"]
            else:
                count_bytes = loco.payload_bytes(a["counts"], a["num_params"], fmt, 2)
                assert a["sent_bytes"] == count_bytes
            # The packed gate, the coded bytes and the index rows carry the same entries.
            assert a["theta"] == results[0]["index"][k]["theta"], f"{fmt} != index"

    # Topology (a): the same rounds as two device groups inside this process.
    single = run_rounds(replica_mesh(R, jax.devices()[:R]), "coded")
    for k in range(ROUNDS):
        assert single[k]["theta"] == results[0]["index"][k]["theta"], f"round {k + 1}: (a) != (b)"
        assert single[k]["counts"] == results[0]["index"][k]["counts"]
        assert single[k]["sent_bytes"] == results[0]["coded"][k]["sent_bytes"]


def child(out_path: str) -> None:
    # Same numerics settings as tests/conftest.py, which a child does not load.
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        result = {fmt: run_rounds(replica_mesh(jax.process_count()), fmt) for fmt in PAYLOADS}
        with open(out_path, "w") as f:
            json.dump(result, f)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    child(*join(sys.argv))
