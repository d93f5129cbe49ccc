"""Smoke test of benchmarks/correlated_noise.py at toy sizes (``--quick``): DP-Adam and STP with independent and
BandMF noise on the real arXiv abstracts through DPTrainer, and the JSON has both mechanisms and finite numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.test_benchmark_optimizers_smoke import _finite, _keep_threads  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.slow


def test_correlated_noise_quick(tmp_path: Path, shared_data: Path) -> None:
    bench = load_benchmark("correlated_noise")
    returned = bench.main(["--quick", "--task", "mlm", "--seeds", "0", "--out_dir", str(tmp_path)])
    assert set(returned) == {"mlm"}
    result = json.loads((tmp_path / "correlated_noise_mlm.json").read_text())
    assert result["quick"] and result["metric"] == "mlm_loss"
    runs = result["runs"]
    assert sorted((r["optimizer"], r["mechanism"]) for r in runs) == sorted(
        (row, mech) for row in ("adam", "stp") for mech in ("independent", "bandmf")
    )
    for run in runs:
        assert run["error"] is None, run
        assert run["noise_mechanism"] == run["mechanism"], run
        assert (run["num_bands"] == 1) == (run["mechanism"] == "independent"), run
        assert _finite(run["mlm_loss"]) and _finite(run["noise_multiplier"]) and run["noise_multiplier"] > 0
        assert _finite(run["epsilon"]) and run["epsilon"] <= 8.0 + 1e-6, run
    for arm in result["summary"]["arms"].values():
        assert arm["n"] == 1 and _finite(arm["mean"]) and arm["errors"] == [], arm
    for comparison in result["summary"]["comparisons"]:
        assert _finite(comparison["mean"]) and comparison["verdict"], comparison
    table = (tmp_path / "correlated_noise.md").read_text()
    assert "| adam | bandmf |" in table and "| stp | independent |" in table and "**Conclusion.**" in table
