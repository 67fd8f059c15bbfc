"""DiLoCo / PULSELoCo replicas as device groups of one program, against plain references.

The references run each replica's inner AdamW steps with an ordinary `jit` on one device and do
the outer round in numpy (gate from ml_dtypes bf16 bits, error feedback, replica-ordered mean);
only the outer Nesterov step reuses `loco.outer_update` (its formula is tested in
test_loco_math.py). See `check_against_reference` for what is compared bit for bit.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from benchmarks.bigram import chain, sample
from benchmarks.loco import build_model, next_token_loss
from sparserl_jax.sync import loco, loco_codec
from sparserl_jax.sync.loco_runtime import LoCoTrainer, replica_mesh

H, R, ROUNDS, BATCH, LENGTH = 3, 2, 3, 4, 9
LR = 1e-4


@functools.lru_cache(maxsize=1)
def problem():
    graphdef, params = build_model("tiny", seed=0)
    data = sample(chain(128, seed=1), (ROUNDS, H, R, BATCH), LENGTH, seed=2)
    return next_token_loss(graphdef), params, data


def run_trainer(cfg: loco.LoCoConfig, mesh):
    loss_fn, params, data = problem()
    trainer = LoCoTrainer(loss_fn, params, optax.adamw(LR), cfg, mesh=mesh)
    thetas, stats = [], []
    for k in range(ROUNDS):
        stats.append(trainer.round({r: data[k, :, r] for r in range(R)}))
        thetas.append(np.asarray(trainer.theta.addressable_data(0)).copy())
        # Every device of every group computed the same new θ: the replicas agree bit for bit.
        assert set(trainer.replica_digests().values()) == {trainer.global_digest()}
    return thetas, stats, trainer


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def reference_split(s: np.ndarray, gate: np.ndarray, value_dtype: str):
    """Numpy error feedback: `(sent, residual, mask)`; bf16 values send `bf16(s)` (round to
    nearest even) and keep `s - sent` in the residual, except tiny entries (held back whole)."""
    if value_dtype == "float32":
        return np.where(gate, s, np.float32(0)), np.where(gate, np.float32(0), s), gate
    tiny = (np.abs(s) < 2.0**-103) & (s.view(np.uint32) & 0xFFFF != 0)
    mask = gate & ~tiny
    hi = s.astype(ml_dtypes.bfloat16).astype(np.float32)
    return np.where(mask, hi, np.float32(0)), np.where(mask, s - hi, s), mask


def assert_bits_equal(a: np.ndarray, b: np.ndarray, what: str):
    diff = np.flatnonzero(np.asarray(a).view(np.uint32) != np.asarray(b).view(np.uint32))
    assert diff.size == 0, f"{what}: {diff.size} entries differ, first at {diff[:5]}"


def rows(x: jax.Array) -> np.ndarray:
    """A `[R, ...]` replica-sharded array as one host array (single process: all addressable)."""
    return np.asarray(x)


def check_against_reference(method: str, cfg: loco.LoCoConfig):
    """Run the trainer and, round by round, a plain DiLoCo / PULSELoCo reference beside it.

    Inner steps: the reference is an ordinary per-replica `jit` from the trainer's θ. XLA fuses the
    two programs differently (FMA contraction), so their weights agree to a few fp32 ulps, not
    bits: checked to rtol 1e-6 (~8 ulps) plus atol 1e-6 of one step (lr), for weights near 0.
    Outer round: numpy on the trainer's own replica weights (gate from ml_dtypes bf16 bits, error
    feedback, replica-ordered mean times fp32(1/R)), then `loco.outer_update`; bit for bit.
    """
    loss_fn, params, data = problem()
    flat, unravel = ravel_pytree(params)
    tx = optax.adamw(LR)

    @jax.jit
    def inner(theta_p, opt, batches):
        def step(carry, batch):
            p, o = carry
            updates, o = tx.update(jax.grad(loss_fn)(p, batch), o, p)
            return (optax.apply_updates(p, updates), o), None

        (p, opt), _ = jax.lax.scan(step, (unravel(theta_p), opt), batches)
        return ravel_pytree(p)[0], opt

    outer_tx = cfg.outer_optimizer()
    outer = jax.jit(functools.partial(loco.outer_update, outer_tx))
    trainer = LoCoTrainer(loss_fn, params, tx, cfg, mesh=replica_mesh(R, jax.devices()[:R]))
    theta = np.asarray(flat, np.float32)
    outer_state = outer_tx.init(jnp.asarray(theta))
    opts = [tx.init(params) for _ in range(R)]
    residuals = np.zeros((R, theta.size), np.float32)
    for k in range(ROUNDS):
        assert_bits_equal(np.asarray(trainer.theta.addressable_data(0)), theta, f"θ {k}")
        stats = trainer.round({r: data[k, :, r] for r in range(R)})
        local = rows(trainer.last_local)
        acc, counts, blobs = np.zeros_like(theta), [], []
        for r in range(R):
            ref_local, opts[r] = inner(jnp.asarray(theta), opts[r], jnp.asarray(data[k, :, r]))
            np.testing.assert_allclose(local[r], np.asarray(ref_local), rtol=1e-6, atol=1e-6 * LR)
            delta = theta - local[r]
            assert np.mean(delta != 0) > 0.5  # the inner steps really moved most weights
            if method == "pulseloco":
                s = residuals[r] + delta
                gate = bf16_bits(theta) != bf16_bits(theta - s)
                delta, residuals[r], mask = reference_split(s, gate, cfg.value_dtype)
                counts.append(int(mask.sum()))
                index = np.flatnonzero(mask)
                bits = delta[index].view(np.uint32)
                bits = (bits >> 16).astype(np.uint16) if cfg.value_dtype == "bfloat16" else bits
                blobs.append(
                    loco_codec.encode_payload(
                        index, bits, num_params=theta.size, context=bf16_bits(theta)
                    ).blob
                )
            acc = acc + delta
        new_theta, outer_state = outer(
            jnp.asarray(theta), outer_state, jnp.asarray(acc * np.float32(1 / R))
        )
        theta = np.asarray(new_theta).copy()
        assert_bits_equal(np.asarray(trainer.theta.addressable_data(0)), theta, f"θ {k + 1}")
        # Every device of every group computed the same new θ: the replicas agree bit for bit.
        assert set(trainer.replica_digests().values()) == {trainer.global_digest()}
        if method == "pulseloco":
            assert_bits_equal(rows(trainer.residual), residuals, f"residual {k + 1}")
            assert stats.counts == tuple(counts)
            padded = cfg.padded_count(max(counts))
            fmt = cfg.payload_format(trainer.num_params, padded)
            assert stats.payload_format == fmt
            num, v = trainer.num_params, cfg.value_bytes
            if fmt == "coded":  # the reported bytes are those of the expected blobs
                assert stats.sent_bytes == loco.coded_payload_bytes([len(b) for b in blobs])
                assert stats.position_bytes + stats.value_bytes < stats.sent_bytes
                assert stats.context_entropy_bits <= stats.gate_entropy_bits
            else:
                assert stats.sent_bytes == loco.payload_bytes(counts, num, fmt, v)
                assert stats.padded_bytes == loco.padded_payload_bytes(R, padded, num, fmt, v)
                assert stats.value_bytes == sum(counts) * v
            expect = sum(loco_codec.gate_entropy_bits(n, num) for n in counts)
            assert stats.gate_entropy_bits == pytest.approx(expect)
            assert 0 < max(counts) < trainer.num_params  # the gate really sparsified
        else:
            assert stats.counts == (trainer.num_params,) * R
            assert stats.sent_bytes == loco.diloco_bytes(trainer.num_params, R)


@pytest.mark.parametrize("payload", ["auto", "coded"])
def test_gate_off_equals_diloco_bit_for_bit(payload):
    # Groups of 2 devices: the inner steps are also data parallel inside each replica. fp32
    # values: everything is sent exactly (bf16 values would keep their rounding errors back).
    mesh = replica_mesh(R, jax.devices()[: 2 * R])
    dense, dense_stats, _ = run_trainer(loco.LoCoConfig(method="diloco", inner_steps=H), mesh)
    off_cfg = loco.LoCoConfig(gate=False, inner_steps=H, payload=payload, value_dtype="float32")
    off, off_stats, t = run_trainer(off_cfg, mesh)
    for k in range(ROUNDS):
        assert_bits_equal(off[k], dense[k], f"round {k + 1}")
        assert off_stats[k].counts == dense_stats[k].counts == (t.num_params,) * R
    if payload == "coded":
        return
    assert dense_stats[0].sent_bytes == loco.diloco_bytes(t.num_params, R)
    # Everything sent: the packed gate is cheaper than P indices.
    assert off_stats[0].payload_format == "bitmask"
    assert off_stats[0].sent_bytes == loco.payload_bytes(
        [t.num_params] * R, t.num_params, "bitmask"
    )


def test_diloco_matches_plain_reference():
    check_against_reference("diloco", loco.LoCoConfig(method="diloco", inner_steps=H))


@pytest.mark.parametrize(
    ("payload", "value_dtype"),
    [("index", "float32"), ("bitmask", "float32"), ("bitmask", "bfloat16"), ("coded", "bfloat16")],
)
def test_pulseloco_matches_plain_reference(payload, value_dtype):
    cfg = loco.LoCoConfig(inner_steps=H, pad_multiple=64, payload=payload, value_dtype=value_dtype)
    check_against_reference("pulseloco", cfg)


@pytest.mark.slow
@pytest.mark.parametrize("other", ["bitmask", "coded"])
def test_payload_formats_give_identical_weights(other):
    # The packed gate, the coded payload and the index rows carry the same entries: same θ and
    # residual bits.
    mesh = replica_mesh(R, jax.devices()[:R])
    runs = {
        fmt: run_trainer(loco.LoCoConfig(inner_steps=H, payload=fmt), mesh)
        for fmt in ("index", other)
    }
    (by_index, index_stats, a), (by_other, other_stats, b) = runs["index"], runs[other]
    for k in range(ROUNDS):
        assert_bits_equal(by_other[k], by_index[k], f"round {k + 1}")
        assert index_stats[k].counts == other_stats[k].counts
        assert (index_stats[k].payload_format, other_stats[k].payload_format) == ("index", other)
        assert other_stats[k].sent_bytes < index_stats[k].sent_bytes
    assert_bits_equal(rows(a.residual), rows(b.residual), "residual")


def test_trainer_input_errors():
    loss_fn, params, data = problem()
    mesh = replica_mesh(R, jax.devices()[:R])
    cfg = loco.LoCoConfig(inner_steps=H)
    with pytest.raises(ValueError, match=r"float32 master weights; got leaf dtypes \['bfloat16'"):
        bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        LoCoTrainer(loss_fn, bf16, optax.adamw(LR), cfg, mesh=mesh)
    with pytest.raises(ValueError, match="cannot split 8 devices into 3 equal replica groups"):
        replica_mesh(3)
    trainer = LoCoTrainer(loss_fn, params, optax.adamw(LR), cfg, mesh=mesh)
    with pytest.raises(ValueError, match=r"leading axis H=3, got shape \(2, 4, 9\)"):
        trainer.round({r: data[0, :2, r] for r in range(R)})
    with pytest.raises(ValueError, match=r"batches missing for local replicas \[1\]"):
        trainer.round({0: data[0, :, 0]})


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "pulseloco"])
def test_resume_from_checkpoint_is_bit_identical(tmp_path, method):
    from sparserl_jax.checkpoint import CheckpointManager

    mesh = replica_mesh(R, jax.devices()[:R])
    cfg = loco.LoCoConfig(method=method, inner_steps=H)
    straight, _, done = run_trainer(cfg, mesh)
    loss_fn, params, data = problem()
    first = LoCoTrainer(loss_fn, params, optax.adamw(LR), cfg, mesh=mesh)
    first.round({r: data[0, :, r] for r in range(R)})
    with CheckpointManager(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, first.state(), first.meta())
    resumed = LoCoTrainer(loss_fn, params, optax.adamw(LR), cfg, mesh=mesh)
    with CheckpointManager(tmp_path) as ckpt:
        state, meta = ckpt.restore_latest(resumed.state())
    resumed.load_state(state, meta)
    assert resumed.rounds_done == 1
    assert_bits_equal(np.asarray(resumed.theta.addressable_data(0)), straight[0], "restored θ")
    for k in range(1, ROUNDS):
        stats = resumed.round({r: data[k, :, r] for r in range(R)})
        assert stats.round == k + 1
        assert_bits_equal(np.asarray(resumed.theta.addressable_data(0)), straight[k], f"θ {k + 1}")
    if method == "pulseloco":
        assert_bits_equal(rows(resumed.residual), rows(done.residual), "residual")


def test_resume_refuses_another_runs_checkpoint():
    loss_fn, params, _ = problem()
    mesh = replica_mesh(R, jax.devices()[:R])
    dense = LoCoTrainer(
        loss_fn, params, optax.adamw(LR), loco.LoCoConfig(method="diloco"), mesh=mesh
    )
    sparse = LoCoTrainer(loss_fn, params, optax.adamw(LR), loco.LoCoConfig(), mesh=mesh)
    before = sparse.global_digest()
    with pytest.raises(ValueError, match="checkpoint has method='diloco' but this trainer has"):
        sparse.load_state(dense.state(), dense.meta())
    state = sparse.state() | {"residual": sparse.residual[:, :-1]}
    with pytest.raises(ValueError, match=r"checkpoint leaf \['residual'\] is float32\(2, "):
        sparse.load_state(state, sparse.meta())
    assert sparse.global_digest() == before and sparse.rounds_done == 0
