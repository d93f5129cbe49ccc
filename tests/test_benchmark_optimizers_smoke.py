"""Smoke test of benchmarks/optimizers.py and benchmarks/optimizer_cost.py at toy sizes (``--quick``):
every optimizer runs through DPTrainer on the real data, and the outputs have one finite row each."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_dp.optim.registry import dp_optimizer_names
from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.slow


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    """The scripts set torch's thread count for the whole process; give the other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_optimizers_quick(tmp_path: Path, shared_data: Path) -> None:
    """Every benchmark row (every registered update rule, and adam_bc_scaled, a setting of adam_bc)."""
    optimizers = load_benchmark("optimizers")
    names = tuple(optimizers.ROWS)
    assert set(dp_optimizer_names()) <= {row.dp_optimizer for row in optimizers.ROWS.values()}
    returned = optimizers.main(
        ["--quick", "--task", "both", "--seeds", "0", "--optimizers", *names, "--out_dir", str(tmp_path)]
    )
    assert set(returned) == {"sst2", "mlm"}
    for task, metric in (("sst2", "accuracy"), ("mlm", "mlm_loss")):
        result = json.loads((tmp_path / f"optimizers_{task}.json").read_text())
        assert result["metric"] == metric and result["settings"]["steps"] == 2
        summary = result["summary"]["per_optimizer"]
        assert list(summary) == list(names)
        for name, entry in summary.items():
            assert entry["errors"] == [] and entry["n"] == 1, (task, name, entry)
            assert _finite(entry["mean"]), (task, name, entry)
        runs = result["runs"]
        assert sorted(r["optimizer"] for r in runs) == sorted(names)
        for run in runs:
            assert run["error"] is None and run["steps"] == 2, run
            assert _finite(run[metric]) and _finite(run["epsilon"]) and run["epsilon"] <= 8.0 + 1e-6, run
        assert all(_finite(r[metric]) for r in result["tuning"])
        assert _finite(result["non_private"][metric]) and result["non_private"]["epsilon"] == math.inf
        comparisons = {(c["variant"], c["base"]): c for c in result["summary"]["comparisons"]}
        assert set(comparisons) == {
            ("stp", "adam"),
            ("adam_bc", "adam"),
            ("adam_bc_scaled", "adam"),
            ("disk", "adam"),
            ("doppler", "sgd"),
            ("dp2", "sgd"),
        }
        assert all(_finite(c["difference_mean"]) and c["outcome"] for c in comparisons.values())
        table = (tmp_path / f"optimizers_{task}.md").read_text()
        assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][
            1 : 1 + len(names)
        ] == list(names)


def test_optimizer_cost_quick(tmp_path: Path) -> None:
    out = tmp_path / "optimizer_cost.json"
    cost = load_benchmark("optimizer_cost")
    returned = cost.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert returned["times"].keys() == result["times"].keys() == cost.VARIANTS.keys()
    for name, entry in result["times"].items():
        assert entry["error"] is None, (name, entry["error"])
        assert _finite(entry["median_s"]) and entry["median_s"] > 0
        assert len(entry["times_s"]) == result["config"]["rounds"]
    times = result["times"]
    assert times["disk_single"]["evaluations_per_step"] == 1 and times["disk"]["evaluations_per_step"] == 2
    assert times["stp"]["scaled_clipping"] and times["dp2_adaptive"]["scaled_clipping"]
    assert not times["adamw"]["scaled_clipping"] and times["adamw"]["evaluations_per_step"] == 1
    assert [(p["variant"], p["base"]) for p in result["pairs"]] == [(v, b) for v, b, _ in cost.PAIRS]
    for pair in result["pairs"]:
        assert _finite(pair["ratio"]["paired_median"]) and _finite(pair["ratio"]["min_time"]), pair


def test_optimizer_cost_isolated_times_each_variant_in_its_own_process(tmp_path: Path) -> None:
    out = tmp_path / "optimizer_cost_isolated.json"
    cost = load_benchmark("optimizer_cost")
    cost.main(["--quick", "--isolated", "--variants", "adamw", "disk", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["config"]["isolated_processes"] and result["round_orders"] == [["adamw", "disk"]]
    times = result["times"]
    assert times["disk"]["evaluations_per_step"] == 2 and times["adamw"]["evaluations_per_step"] == 1
    assert all(entry["error"] is None and _finite(entry["median_s"]) for entry in times.values())
    (pair,) = result["pairs"]
    assert pair["variant"] == "disk" and _finite(pair["ratio"]["paired_median"])
