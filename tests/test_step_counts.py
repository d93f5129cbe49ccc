"""benchmarks/step_counts.py on its tiny Llama (4 layers, T 64, B 4, fp32): a steady-state DP step dispatches no
more operators, relative to the stock Trainer's step, and reads no more tensors on the host than it did when these
ceilings were set, in each of the four cells.

The issue's bar (benchmarks/step_counts.py: ``CALLS_BAR``, ``SYNCS_BAR``) is DP / stock operator calls ≤ 1.30 and at
most 3 host syncs more than the stock step. Each cell is held to the number measured when its ceiling was last
lowered, rounded up (the comment names what is left where the bar is not met yet); group-wise clipping's step too,
against its own ceilings.
"""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

# cell: (ceiling of DP / stock operator calls, ceiling of the host syncs DP adds, of the value-sized operators)
CEILINGS = {
    # the syncs meet the bar (+3) in every cell (benchmarks/results/step_counts.md: each one's source), and the calls
    # meet it (1.30x) without checkpointing: LoRA 1.16x, full 1.28x (the norms of all layers summed in one buffer by
    # batched dot products, an input shared by q, k, v scaled by c once, the loss and the clip factors in fewer
    # operators), and LoRA with checkpointing 1.12x (the adapters' per-example gradients kept from the norm pass: one
    # backward). Full fine-tuning with checkpointing not yet: 1.53x, of which the weighted pass's second run of each
    # checkpointed layer and its per-layer backward are 0.30x, the per-layer norms most of the rest
    # (benchmarks/results/step_counts.md: the calls by stage)
    "lora-nockpt": (1.16, 3, 0),
    "lora-ckpt": (1.12, 3, 0),
    "full-nockpt": (1.29, 3, 0),
    "full-ckpt": (1.53, 3, 0),
}


# group-wise clipping (``clipping_groups="layer"``, one backward): ceiling of DP group-wise / stock operator calls; the
# rest over flat clipping's is each group's clip factors (about 8 operators a group) and the rows of the examples
# whose factor is 0 set to 0 in every part before its product (0 · inf is nan; knowing there are none would be a host
# read a group)
GROUPWISE_CEILINGS = {"lora-nockpt": 1.32, "lora-ckpt": 1.27, "full-nockpt": 1.45, "full-ckpt": 1.39}


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
    assert counted["groupwise_calls_ratio"] <= GROUPWISE_CEILINGS[cell], (
        cell,
        counted["dp_groupwise"]["calls"],
    )
    assert counted["groupwise_extra_syncs"] <= syncs, (cell, counted["dp_groupwise"]["host_syncs"])
