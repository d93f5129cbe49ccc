"""Benchmark scripts loaded by file path for their smoke tests: Opacus installs a top-level package named
``benchmarks`` into site-packages, which ``import benchmarks.x`` could pick instead of this repository's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``hf_dp_benchmark_<name>``."""
    spec = importlib.util.spec_from_file_location(f"hf_dp_benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
