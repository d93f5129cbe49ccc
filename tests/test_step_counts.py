"""benchmarks/step_counts.py on its tiny Llama (4 layers, T 64, B 4, fp32): a steady-state DP step dispatches no
more operators, relative to the stock Trainer's step, and reads no more tensors on the host than it did when these
ceilings were set, in each of the four cells.

The issue's bar (benchmarks/step_counts.py: ``CALLS_BAR``, ``SYNCS_BAR``) is DP / stock operator calls ≤ 1.30 and at
most 3 host syncs more than the stock step. A cell that meets it is held to it; one that does not yet is held to the
number measured when its ceiling was last lowered (the comment names what is left).
"""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

# cell: (ceiling of DP / stock operator calls, ceiling of the host syncs DP adds, of the value-sized operators)
CEILINGS = {
    # the syncs meet the bar (+3) in every cell (benchmarks/results/step_counts.md: each one's source), and LoRA
    # without checkpointing meets the calls' (1.30x); the others not yet: per layer the norm's Gram, its pow/sum
    # and the sum's GEMM, and with checkpointing the norm pass's tapped backward, the tail's sums and the second
    # forward
    "lora-nockpt": (1.30, 3, 0),
    "lora-ckpt": (1.53, 3, 0),
    "full-nockpt": (1.43, 3, 0),
    "full-ckpt": (1.66, 3, 0),
}


@pytest.fixture(scope="module")
def step_counts():
    return load_benchmark("step_counts")


@pytest.mark.parametrize("cell", list(CEILINGS))
def test_a_dp_step_dispatches_and_syncs_no_more_than_its_ceiling(step_counts, cell: str) -> None:
    tuning, checkpointing = next(c for c in step_counts.CELLS if step_counts.cell_name(*c) == cell)
    counted = step_counts.count_cell(tuning, checkpointing)
    calls, syncs, value_sized = CEILINGS[cell]
    stock, dp = counted["stock"], counted["dp"]
    assert counted["calls_ratio"] <= calls, (cell, stock["calls"], dp["calls"])
    assert counted["extra_syncs"] <= syncs, (cell, stock["host_syncs"], dp["host_syncs"])
    assert dp["value_sized_ops"] - stock["value_sized_ops"] <= value_sized, cell
