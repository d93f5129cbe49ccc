"""benchmarks/stp_study.py runs its four arms (DP-Adam and STP, each with independent and BandMF noise) on paired
seeds and writes what the study reports; here in its smoke mode (a few steps on CPU), and its GPU bundle fits what
a GPU machine takes."""

from __future__ import annotations

import json

import pytest

from benchmarks import stp_study


@pytest.mark.slow
def test_stp_study_smoke_runs_every_arm_paired_and_reports_an_ordering(tmp_path) -> None:
    out = tmp_path / "study.json"
    result = stp_study.main(["--smoke", "--seeds", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [(r["arm"], r["seed"]) for r in result["runs"]] == [(name, 3) for name, _, _ in stp_study.ARMS]
    for run in result["runs"]:
        assert 0.0 <= run["accuracy"] <= 1.0 and 0 < run["epsilon"] <= 8.0 + 1e-6
    assert set(result["arms"]) == {name for name, _, _ in stp_study.ARMS}
    assert result["ordering"].count(" > ") == 3 and result["git_commit"]


def test_the_gpu_bundle_fits_and_runs_from_float32(tmp_path) -> None:
    sizes = stp_study.make_bundle(tmp_path / "bundle")
    assert sum(sizes.values()) <= stp_study.BUNDLE_LIMIT_MB
    assert {"train.tsv", "dev.tsv", "model.safetensors"} <= set(sizes)
    widened = stp_study.float32_copy(tmp_path / "bundle" / "minilm-fp16", tmp_path / "minilm")
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(widened)
    assert all(p.dtype.is_floating_point and p.dtype.itemsize == 4 for p in model.parameters())
