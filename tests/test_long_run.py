"""A long run under load (benchmarks/long_run.py, short): saves under ``save_total_limit``, evaluations and log
lines leave the hooks, the live tensors and the ledger as they were after warm-up, and ε is dp_accounting's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.slow  # a benchmark's quick mode (pyproject.toml)


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_long_run_keeps_its_counters_and_its_epsilon(tmp_path: Path, one_thread: None) -> None:
    long_run = load_benchmark("long_run")
    # 200 steps: a save every 20 (10 saves, 8 of them rotated away), an evaluation every 50, a log every 10; RDP
    # keeps it short (the benchmark's run checks PRV against dp_accounting's PLD)
    config = replace(long_run.QUICK, steps=200, sample_every=20, warmup_step=60, accountant="rdp")
    result = long_run.long_run(config, str(tmp_path))

    samples = result["samples"]
    warm = next(s for s in samples if s["step"] >= config.warmup_step)
    end = samples[-1]
    assert (warm["step"], end["step"]) == (60, 200)
    for counter in ("tensors", "module_hooks", "parameter_hooks", "global_hooks", "optimizer_hooks"):
        assert end[counter] == warm[counter], (counter, warm[counter], end[counter])
    assert end["module_hooks"] > 0 and end["optimizer_hooks"] == 1  # the engine's hooks and the one release
    assert warm["ledger_phases"] == end["ledger_phases"] == 1  # equal phases merge: one (σ, q, T) entry
    assert end["ledger_steps"] == 200
    assert result["summary"]["counters_constant_after_warmup"], result["summary"]["counters"]

    after = result["after_train"]
    assert after["module_hooks"] == 0  # train() removes the clipping hooks
    assert after["checkpoints"] == after["complete_checkpoints"] == config.save_total_limit

    eps = result["epsilon"]
    assert eps["steps"] == eps["ledger_steps"] == 200
    assert eps["relative_difference"] < 0.01, eps  # tests/test_accounting.py's tolerance
