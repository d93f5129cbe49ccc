"""Padding is padding: records are found only among attended tokens (or from the collator's ``seq_idx``), so left
or right padding with any ``position_ids`` convention trains with one unit per row; packed rows are still records."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_dp.privacy_units import micro_batch_units
from tests import models
from tests.trainer_utils import assert_step_clips_each_example_alone


def _padded(examples: list[dict], left: bool, pad_position: str) -> dict[str, torch.Tensor]:
    """Pad to the longest row; real tokens at positions 0..n-1, padding at position 0, 1 (HF's generation
    convention for left padding) or continuing the count, attention 0 and label -100 there. Left padding also
    labels the first real token -100: no token is predicted from padding, as none is in the example alone."""
    length = max(len(e["input_ids"]) for e in examples)
    rows = len(examples)
    ids = torch.full((rows, length), models.PAD)
    mask = torch.zeros(rows, length, dtype=torch.long)
    positions = torch.zeros(rows, length, dtype=torch.long)
    labels = torch.full((rows, length), -100)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        start = length - n if left else 0
        real = slice(start, start + n)
        ids[i, real], mask[i, real], positions[i, real] = torch.tensor(e["input_ids"]), 1, torch.arange(n)
        labels[i, real] = ids[i, real]
        if left:
            labels[i, start] = -100
        pads = ~mask[i].bool()
        if pad_position == "one":
            positions[i, pads] = 1
        elif pad_position == "continue":
            positions[i, pads] = torch.arange(n, n + int(pads.sum()))
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}


CONVENTIONS = [(False, "zero"), (False, "continue"), (True, "zero"), (True, "one")]


@pytest.mark.parametrize("left, pad_position", CONVENTIONS)
def test_a_padded_micro_batch_is_one_unit_per_row(left: bool, pad_position: str) -> None:
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6, 7, 8, 9, 10]}, {"input_ids": [4]}]
    assert micro_batch_units(_padded(examples, left, pad_position), None) is None


@pytest.mark.parametrize("left, pad_position", CONVENTIONS)
def test_the_trainer_trains_padded_rows_exactly(tmp_path, left: bool, pad_position: str) -> None:
    """The noise-free step with a padding collator that passes position ids equals lr · Σ_i clip(∇L_i) / B̄ over
    each example run alone, without padding."""
    assert_step_clips_each_example_alone(tmp_path, lambda examples: _padded(examples, left, pad_position))


def test_packed_rows_are_records_from_position_ids_or_seq_idx() -> None:
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [4, 4, 4, 4]}]
    by_positions = micro_batch_units(DataCollatorWithFlattening(return_tensors="pt")(examples), None)
    marked = DataCollatorWithFlattening(return_tensors="pt", return_seq_idx=True)(examples)
    marked["position_ids"] = torch.zeros_like(marked["position_ids"])  # the marker decides, not the positions
    by_marker = micro_batch_units(marked, None)
    expected = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert by_positions.count == by_marker.count == 3
    assert torch.equal(by_positions.unit_of_token, expected) and torch.equal(
        by_marker.unit_of_token, expected
    )


def test_padding_after_packed_records_belongs_to_no_record() -> None:
    inputs = {
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]]),
    }
    units = micro_batch_units(inputs, None)
    assert units.count == 2 and units.unit_of_token.tolist() == [[0, 0, 0, 1, 1, -1, -1, -1]]
