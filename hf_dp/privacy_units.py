"""What one protected unit is: for the whole dataset (rows, blocks, users) and within a micro-batch (rows, pairs,
packed records). The guarantee is stated per unit (privacy.UNITS); clipping bounds each unit's gradient
(clipping/units.py says how a micro-batch's rows and tokens are grouped)."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hf_dp.clipping.units import PrivacyUnits
from hf_dp.data import rows_look_like_blocks, units_of_column
from hf_dp.privacy import require_map_style

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetUnits:
    """The unit the guarantee is stated in; for user-level DP each row's user (0..N_u-1) and N_u."""

    name: str
    unit_of_row: list[int] | None = None
    count: int | None = None


def dataset_units(args, dataset, row_unit: str, trainer_name: str) -> DatasetUnits:
    """``row_unit`` is what one row is for this trainer ("example"; "pair" for DPO). Users come from
    ``privacy_unit_column``; rows cut from concatenated text (run_clm's ``group_texts``) are blocks."""
    require_map_style(dataset)
    column = args.privacy_unit_column
    if column is None and args.rows_are_blocks is None and rows_look_like_blocks(dataset):
        logger.warning(
            "hf_dp: every training row has one length, labels equal to input_ids and no padding: blocks cut from "
            "concatenated text (run_clm's group_texts), so the guarantee is stated per block, not per record; "
            "set rows_are_blocks=False if each row is one record"
        )
        return DatasetUnits("block")
    if column is None:
        return DatasetUnits("block" if args.rows_are_blocks else row_unit)
    if row_unit != "example":
        raise ValueError(
            f"privacy_unit_column groups rows into users, but a row of {trainer_name} is a {row_unit}; "
            "drop privacy_unit_column"
        )
    names = getattr(dataset, "column_names", None)
    if names is not None and column not in names:
        raise ValueError(f"privacy_unit_column={column!r} is not a column of train_dataset (it has {names})")
    try:
        values = dataset[column] if names is not None else [row[column] for row in dataset]
    except (KeyError, TypeError):
        raise ValueError(
            f"privacy_unit_column={column!r}: the rows of train_dataset have no such key"
        ) from None
    values = list(values)
    require_unit_ids(column, values)
    unit_of_row, count = units_of_column(values)
    return DatasetUnits("user", unit_of_row, count)


def require_unit_ids(column: str, values: list[Any]) -> None:
    """Check that every row of ``privacy_unit_column`` names its user. A missing id (None, or NaN, which equals
    nothing, not even itself) is refused: None rows would all form one unit and NaN rows one unit each, so a
    real user's rows would span several units and the guarantee would not cover that user. A list is no id."""
    unhashable = next((i for i, value in enumerate(values) if not _is_id(value)), None)
    if unhashable is not None:
        raise ValueError(
            f"privacy_unit_column={column!r} holds a {type(values[unhashable]).__name__} in row {unhashable}, not a "
            "user id: name a column of one id (int or str) per row"
        )
    missing = [i for i, value in enumerate(values) if _is_missing(value)]
    if missing:
        raise ValueError(
            f"privacy_unit_column={column!r} has no id in {len(missing)} of {len(values)} rows of train_dataset "
            f"(None or NaN; first: row {missing[0]}), so a user's rows would span several units; give each of "
            "those rows its user's id or drop them"
        )


def _is_id(value: Any) -> bool:
    """One hashable value, or a 0-d tensor or array (a torch- or numpy-formatted column's), never several."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.ndim == 0
    return isinstance(value, Hashable)


def _is_missing(value: Any) -> bool:
    """None, or a value unequal to itself: NaN (Python, numpy, torch), NaT, or pandas' NA."""
    if value is None:
        return True
    try:
        return bool(value != value)
    except TypeError:  # pandas' NA: NA != NA is NA, whose truth value is ambiguous
        return True


def micro_batch_units(inputs: dict[str, Any], unit_of_row: torch.Tensor | None) -> PrivacyUnits | None:
    """How a micro-batch's rows and tokens form units; None: one unit per row. Multiple-choice rows (batch, choices,
    length), which the model folds into batch·choices rows of its own, are one unit per example (``choice_units``).
    Users come from the loader; records packed into one row are one unit each, found from the collator's
    ``seq_idx`` (DataCollatorWithFlattening's marker) or from position ids restarting at 0 AMONG ATTENDED TOKENS:
    padding, left or right, with any ``position_ids`` convention, is never taken for a record."""
    choices = choice_units(inputs)
    if choices is not None and unit_of_row is not None:
        raise ValueError(
            "privacy_unit_column with multiple-choice rows (batch, choices, length) is not supported: drop "
            "privacy_unit_column (the guarantee is then per example)"
        )
    if choices is not None:
        return choices
    if unit_of_row is not None:
        rows = next((v.shape[0] for v in inputs.values() if _is_2d(v)), len(unit_of_row))
        if rows != len(unit_of_row):
            raise ValueError(
                f"privacy_unit_column: the collator made {rows} row(s) of {len(unit_of_row)} examples (packed, as "
                "DataCollatorWithFlattening does), so no row has one user: use a padding collator with "
                "privacy_unit_column"
            )
        return PrivacyUnits.of_rows(unit_of_row)
    seq_idx, position_ids = inputs.get("seq_idx"), inputs.get("position_ids")
    marker = seq_idx if _is_2d(seq_idx) else position_ids if _is_2d(position_ids) else None
    if marker is None:
        return None
    mask = inputs.get("attention_mask")
    attended = (mask if _is_2d(mask) and mask.shape == marker.shape else torch.ones_like(marker)).bool()
    if marker is seq_idx:
        restarts = torch.ones_like(attended)
        restarts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    else:
        restarts = position_ids == 0
    units = PrivacyUnits.of_restarts(restarts, attended)
    # one record per non-empty row is the default unit, a row
    return units if units.count > int(attended.any(dim=1).sum()) else None


def choice_units(inputs: dict[str, Any]) -> PrivacyUnits | None:
    """Multiple-choice rows: ``input_ids`` (or ``inputs_embeds``) of shape (B, C, T) (or (B, C, T, d)), which a
    ``*ForMultipleChoice`` model reshapes row-major to B·C rows (transformers' heads all do, ``view(-1, T)``), so
    rows b·C .. b·C + C − 1 are example b's: one unit each. None for rows of tokens."""
    ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
    folded = ids if isinstance(ids, torch.Tensor) else embeds
    if not isinstance(folded, torch.Tensor) or folded.dim() != (3 if folded is ids else 4):
        return None
    batch, choices = folded.shape[:2]
    return PrivacyUnits.of_rows(torch.arange(batch, device=folded.device).repeat_interleave(choices))


def _is_2d(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2
