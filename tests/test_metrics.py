"""Metrics JSONL rows, torn-line tolerance and the PNG plot."""

import json

import numpy as np
import pytest

from sparserl_jax.metrics import MetricsWriter, learner_metrics, plot_metrics, read_metrics


def test_jsonl_rows_and_plot(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for step in range(1, 4):
            w.write(step, {"critic/score/mean": np.float32(step / 4), "dgg/fired": step == 2})
        w.write(4, {"critic/score/mean": float("nan")})
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["critic/score/mean"] == 0.5 and rows[1]["dgg/fired"] is True
    assert rows[3]["critic/score/mean"] == "nan"
    # A torn last line (killed writer) is skipped.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "critic/sco')
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 4
    png = plot_metrics(tmp_path, tmp_path / "m.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match="no numeric metric named"):
        plot_metrics(tmp_path, tmp_path / "x.png", ["nope"])
    # A run without held-out metrics still gets its plot of what it has.
    png = plot_metrics(
        tmp_path, tmp_path / "y.png", ["nope", "critic/score/mean"], skip_missing=True
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_non_scalar_rejected(tmp_path):
    with MetricsWriter(tmp_path) as w, pytest.raises(ValueError, match="scalars"):
        w.write(1, {"x": np.zeros(3)})
    assert json.loads((tmp_path / "metrics.jsonl").read_text() or "null") is None


def test_learner_metrics_per_pass_gate_signals():
    def pass_metrics(k, z, dg, armed):
        return {
            **{key: 0.0 for key in ("pg_loss", "loss", "entropy", "kl", "approx_kl")},
            **{"clip_fraction": 0.0, "grad_norm": 1.0, "lr": 1e-4, "dgg/g": float(k)},
            **{"dgg/z": z, "dgg/dg": dg, "dgg/armed": armed, "dgg/fire": False},
            **{"nonfinite": False, "passes_run": 3, "passes_applied": 3, "pass_index": k},
        }

    history = [pass_metrics(1, 2.0, 5.0, False), pass_metrics(2, -0.5, -1.0, True)]
    history.append(pass_metrics(3, 0.2, -0.25, True))
    out = learner_metrics(history)
    # `dgg/z` is the largest z over every pass, the unarmed pass 1 included.
    assert out["dgg/z"] == 2.0 and out["dgg/armed_passes"] == 2
    assert [out[f"dgg/z_pass{k}"] for k in (1, 2, 3)] == [2.0, -0.5, 0.2]
    assert [out[f"dgg/dg_pass{k}"] for k in (1, 2, 3)] == [5.0, -1.0, -0.25]
    assert "dgg/z_pass4" not in out and out["actor/updates"] == 3


def test_learner_metrics_per_pass_over_mini_batches():
    def update(k, j, z, dg, g):
        return {
            **{key: 0.0 for key in ("pg_loss", "loss", "entropy", "kl", "approx_kl")},
            **{"clip_fraction": 0.0, "grad_norm": 1.0, "lr": 1e-4, "dgg/g": g},
            **{"dgg/z": z, "dgg/dg": dg, "dgg/armed": k > 1, "dgg/fire": False},
            **{"nonfinite": False, "passes_run": 2, "passes_applied": np.float32(1.5)},
            **{"pass_index": k, "mini_batch": j},
        }

    # Two mini-batches per pass; the second pass stopped after its first update.
    history = [update(1, 0, 1.0, 2.0, 4.0), update(1, 1, 3.0, -1.0, 3.0)]
    history.append(update(2, 0, 0.5, -2.0, 1.0))
    out = learner_metrics(history)
    assert out["dgg/z_pass1"] == 3.0 and out["dgg/dg_pass1"] == 0.5 and out["dgg/g_pass1"] == 3.5
    assert out["dgg/z_pass2"] == 0.5 and out["dgg/dg_pass2"] == -2.0 and out["dgg/g_pass2"] == 1.0
    assert out["dgg/passes_run"] == 2 and out["dgg/passes_applied"] == 1.5
    assert out["actor/updates"] == 3 and out["dgg/armed_passes"] == 1
    assert [out[f"dgg/g_update{i}"] for i in (1, 2, 3)] == [4.0, 3.0, 1.0]
