"""benchmarks/groupwise_utility.py: flat and group-wise clipping in pairs that share their key, on a toy slice of
SST-2; a second call reads the kept runs instead of training again."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from tests.benchmark_scripts import load_benchmark
from tests.test_recipe_glue import TOY

REPO = Path(__file__).resolve().parents[1]


def test_the_sst2_pairs_are_the_main_job_with_each_grouping(tmp_path) -> None:
    utility = load_benchmark("groupwise_utility")
    main_job = shlex.split((REPO / "scripts/main_job.sh").read_text().split("python recipes/glue.py", 1)[1])
    flags = dict(zip(utility.MAIN_JOB[::2], utility.MAIN_JOB[1::2], strict=True))
    assert all(main_job[main_job.index(flag) + 1] == value for flag, value in flags.items())
    out = tmp_path / "utility.json"
    argv = ["--task", "sst2", "--dp_seeds", "5", "--work", str(tmp_path), "--out", str(out), "--", *TOY]
    result = utility.main(argv)
    assert json.loads(out.read_text()) == result
    pair = result["runs"]["5"]
    assert set(pair) == {"all", "layer"} and all(run["steps"] == 2 for run in pair.values())
    settings = result["settings"]
    assert settings["all"]["training"]["clipping_groups"] == "all"
    assert settings["layer"]["training"]["clipping_groups"] == "layer"
    assert {s["training"]["insecure_dp_seed"] for s in settings.values()} == {5}
    assert result["layer_minus_all"] == [pair["layer"]["accuracy"] - pair["all"]["accuracy"]]
    kept = sorted(tmp_path.glob("sst2_*_dp5.json"))
    stamps = [path.stat().st_mtime_ns for path in kept]
    assert len(kept) == 2 and utility.main(argv)["runs"] == result["runs"]
    assert [path.stat().st_mtime_ns for path in kept] == stamps
