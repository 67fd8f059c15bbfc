"""Smoke test of the sync benchmark on the tiny preset: real AdamW steps, bit-identical syncs,
the entropy bound below the patches, encode speed with and without the anchors."""

import json

import pytest

from benchmarks.sync import BenchConfig, run


@pytest.mark.slow
def test_bench_tiny_is_bit_identical_and_reports_its_fields():
    out = run(BenchConfig(preset="tiny", lr=1e-4, steps=2, batch=2, seq_len=16, anchor_every=2))
    json.dumps(out)  # one JSON line
    for key in ("params", "lr", "steps", "ratio_median", "bytes_per_changed_median"):
        assert key in out
    assert out["params"] == 139584 and out["lr"] == 1e-4
    assert out["all_bit_identical"] and len(out["steps"]) == 2
    for s in out["steps"]:
        assert s["changed"] > 0 and s["bit_identical"]
        assert s["payload_bytes"] < s["dense_bf16_bytes"] == 2 * out["params"]
        assert s["bytes_per_changed"] == s["payload_bytes"] / s["changed"]
        assert s["bound_mask_bytes"] > 0
        # The bound counts mask and values only: no patch (with its header) is below it.
        assert 0 < s["bound_per_changed"] < s["bytes_per_changed"]
    assert out["encode_gb_per_s"] > 0 and out["apply_gb_per_s"] > 0
    # Step 2 publishes anchor 2 (anchor_every=2); step 1 (compiles) is not timed.
    assert out["anchors"] == 1 and out["anchor_s_mean"] > 0
    assert 0 < out["encode_with_anchors_gb_per_s"] < out["encode_gb_per_s"]
    assert out["apply_touched_gb_per_s"] > 0 and out["apply_before_gb_per_s"] > 0
    for k in ("publish", "all", "touched", "before"):
        assert len(out["compiles_per_step"][k]) == 2
        assert 0 <= out["last_compiling_step"][k] <= 2


@pytest.mark.slow
def test_profile_tiny_times_each_side_and_restores_what_it_wraps():
    from benchmarks import sync_profile

    before = [getattr(owner, attr) for owner, attr in sync_profile.WRAPPED]
    out = sync_profile.profile(BenchConfig(preset="tiny", lr=1e-4, steps=3, batch=2, seq_len=16), 1)
    json.dumps(out)
    assert out["versions"] == 2 and out["all_bit_identical"]
    assert set(out["ms_per_version"]) == {
        "encode", "mask_s", "extract_s", "codec_s", "apply_all", "apply_touched"
    }  # fmt: skip
    assert out["functions_ms_per_version"]["decode._sparse_v3_values"] > 0
    assert [getattr(owner, attr) for owner, attr in sync_profile.WRAPPED] == before
