"""Smoke test of benchmarks/step_speed.py on a tiny model: every variant runs, the JSON is complete."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.slow

VARIANTS = ("non_private", "dp_ghost", "dp_per_sample", "opacus_ghost")


def _finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_step_speed_tiny(tmp_path: Path) -> None:
    step_speed = load_benchmark("step_speed")
    out = tmp_path / "step_speed.json"
    tiny = ["--layers", "1", "--width", "32", "--heads", "2", "--vocab", "128", "--seq", "16", "--batch", "4"]
    returned = step_speed.main([*tiny, "--rounds", "1", "--out", str(out), "--memory-variants", "dp_ghost"])

    result = json.loads(out.read_text())
    assert result["config"]["layers"] == 1 and result["config"]["batch"] == 4
    assert returned["times"].keys() == result["times"].keys()
    assert {"torch", "transformers", "opacus", "date"} <= result["environment"].keys()
    assert any("tie_word_embeddings=False" in note for note in result["notes"])
    assert set(result["times"]) == set(VARIANTS)

    opacus_error = result["times"]["opacus_ghost"]["error"]
    for name in VARIANTS:
        entry = result["times"][name]
        if name == "opacus_ghost" and opacus_error is not None:
            assert isinstance(opacus_error, str) and opacus_error
            continue
        assert entry["error"] is None, f"{name}: {entry['error']}"
        assert _finite_positive(entry["median_s"]) and _finite_positive(entry["min_s"])
        assert len(entry["times_s"]) == 1 and _finite_positive(entry["times_s"][0])
        assert math.isfinite(entry["first_loss"])

    # Same model and batch everywhere: the first (untrained) loss agrees across variants.
    losses = [result["times"][n]["first_loss"] for n in VARIANTS if result["times"][n]["error"] is None]
    assert max(losses) - min(losses) < 1e-4

    for dp in ("dp_ghost", "dp_per_sample"):
        bases = ("non_private",) if opacus_error else ("non_private", "opacus_ghost")
        for base in bases:
            ratio = result["ratios"][dp][f"vs_{base}"]
            for key in ("paired_median", "min_time", "throughput_paired", "throughput_min_time"):
                assert _finite_positive(ratio[key]), (dp, base, key, ratio)
        if opacus_error:
            assert result["ratios"][dp]["vs_opacus_ghost"] is None

    memory = result["memory"]
    assert set(memory) == {"dp_ghost"}
    assert memory["dp_ghost"]["error"] is None, memory
    assert memory["dp_ghost"]["ru_maxrss_mb"] > 50


def test_tracker_overhead_measures_its_three_arms() -> None:
    """benchmarks/tracker_overhead.py: one round of each arm (tracker, watch, bare) in both settings, finite ratios,
    and the watch put back afterwards."""
    from hf_dp.clipping import rows

    watch = rows.LooseWatch
    result = load_benchmark("tracker_overhead").measure(rounds=1)
    for setting in ("book_keeping", "checkpointing"):
        found = result[setting]
        assert all(_finite_positive(found["median_ms"][arm]) for arm in ("tracker", "watch", "bare"))
        assert _finite_positive(found["ratio_tracker_bare"]) and _finite_positive(found["ratio_watch_bare"])
    assert rows.LooseWatch is watch
