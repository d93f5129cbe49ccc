"""Privacy units: which rows and tokens of a micro-batch together form one protected unit.

DP-SGD bounds the contribution of one unit, ‖g_u‖ ≤ C with g_u = ∇L_u. A unit is one row by default; a DPO
pair is two rows (its chosen and rejected completions), a user is all of that user's rows in the logical batch,
and a record packed with others into one row (padding-free packing) is a span of that row's tokens.

Every layer rule sums per-token terms, G_u = Σ_{tokens τ of u} left_τ ⊗ right_τ (rules.py), so gathering each
unit's tokens, zero-padded, into one long "example" turns the per-example rules and norms into per-unit ones,
exactly: ‖G_u‖² = Σ_{τ,τ' ∈ u} ⟨left_τ, left_τ'⟩⟨right_τ, right_τ'⟩ includes every cross term between the
unit's rows or records. That holds only if no unit's loss depends on another unit's tokens (attention must not
cross records in a packed row); the trainer checks it on the first step (``DPTrainerMixin``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_dp.clipping.errors import UnsupportedModuleError
from hf_dp.clipping.row_maps import ExampleRows


class UnitLayoutError(ValueError):
    """A layer's input cannot be split into the micro-batch's privacy units."""


@dataclass(frozen=True)
class PrivacyUnits:
    """The U units of a micro-batch of R rows.

    ``slots`` (U, L) lists each unit's rows (``per_row``) or flat token positions r·W + t (token units, W tokens a
    row), padded with -1. ``unit_of_token`` (R, W) is each token's unit (token units only; -1: no unit).
    """

    rows: int
    count: int
    slots: torch.Tensor
    per_row: bool
    unit_of_token: torch.Tensor | None = None

    @staticmethod
    def of_rows(unit_of_row: torch.Tensor) -> PrivacyUnits:
        """Units made of whole rows: row r belongs to unit ``unit_of_row[r]`` ∈ 0..U-1 (every unit non-empty)."""
        unit_of_row = unit_of_row.long().flatten()
        count = int(unit_of_row.max()) + 1 if unit_of_row.numel() else 0
        if unit_of_row.numel() and (unit_of_row.min() < 0 or unit_of_row.unique().numel() != count):
            raise ValueError(f"unit ids must be 0..U-1 with every unit present, got {unit_of_row.tolist()}")
        return PrivacyUnits(unit_of_row.numel(), count, _slots(unit_of_row, count), per_row=True)

    @staticmethod
    def of_records(position_ids: torch.Tensor, attended: torch.Tensor | None = None) -> PrivacyUnits:
        """Records packed into rows without padding between them: one starts wherever the position ids restart at
        0 (padding-free collation, e.g. transformers' DataCollatorWithFlattening); see ``of_restarts``."""
        return PrivacyUnits.of_restarts(position_ids.reshape(position_ids.shape[0], -1) == 0, attended)

    @staticmethod
    def of_restarts(restarts: torch.Tensor, attended: torch.Tensor | None = None) -> PrivacyUnits:
        """Token units: a record starts at each row's first attended token and at every attended restart (R, W).
        Only attended tokens (the attention mask; all when None) belong to a record: padding belongs to none (-1)."""
        attended = torch.ones_like(restarts) if attended is None else attended.reshape(restarts.shape).bool()
        starts = attended & (restarts | (attended.cumsum(1) == 1))
        unit_of_token = torch.where(attended, starts.flatten().cumsum(0).view(starts.shape) - 1, -1)
        count = int(unit_of_token.max()) + 1 if unit_of_token.numel() else 0
        return PrivacyUnits(
            starts.shape[0], count, _slots(unit_of_token.flatten(), count), False, unit_of_token
        )

    @property
    def is_trivial(self) -> bool:
        """One unit per row, in row order: nothing to regroup."""
        return self.per_row and self.count == self.rows and self.slots.shape[1] == 1

    def regroup(self, x: torch.Tensor) -> torch.Tensor:
        """A layer's (R, ...) input or output gradient as (U, L, ...): each unit's tokens as one "example", zeros in
        the padding. Row units give (U, k, ...), k rows a unit; token units need (R, W, ...) and give (U, L, ...)."""
        if self.per_row:
            if x.shape[0] != self.rows:
                raise UnitLayoutError(f"expected {self.rows} rows, got a tensor of shape {tuple(x.shape)}")
            return _gather(x, self.slots)  # (U, k, *rest): the rules fold every middle dimension into tokens
        width = self.unit_of_token.shape[1]
        if x.dim() < 2 or tuple(x.shape[:2]) != (self.rows, width):
            raise UnitLayoutError(
                f"a tensor of shape {tuple(x.shape)} is not laid out as the packed micro-batch's ({self.rows}, "
                f"{width}) tokens"
            )
        return _gather(x.flatten(0, 1), self.slots)

    def sum_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        """Σ over each unit's rows of a per-row tensor (R, ...) → (U, ...) (row units only)."""
        total = per_row.new_zeros(self.count, *per_row.shape[1:])
        return total.index_add_(0, self.unit_of_row(), per_row)

    def mean_over_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        """The mean over each unit's rows, (R,) → (U,): a user's loss is the mean of its examples' losses."""
        counts = torch.bincount(self.unit_of_row(), minlength=self.count).to(per_row.dtype)
        return self.sum_rows(per_row) / counts

    def mean_over_tokens(self, token_losses: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
        """Token units: each record's mean over its labelled tokens, (R, W) → (U,); 0 for a record without any."""
        units = self.unit_of_token.flatten()
        keep = labelled.flatten() & (units >= 0)
        sums = token_losses.new_zeros(self.count).index_add_(0, units[keep], token_losses.flatten()[keep])
        counts = torch.bincount(units[keep], minlength=self.count).clamp(min=1).to(sums.dtype)
        return sums / counts

    def to(self, device: torch.device) -> PrivacyUnits:
        tokens = None if self.unit_of_token is None else self.unit_of_token.to(device)
        return PrivacyUnits(self.rows, self.count, self.slots.to(device), self.per_row, tokens)

    def rows_by_unit(self, rows: ExampleRows | None) -> ExampleRows | None:
        """Each row of a module's input as its unit's (``rows``: a flattened input's rows, rows.py; None: the
        micro-batch's own rows): a unit of whole rows by its rows' examples; a packed record by its token, for the
        rows of a row-major reshape of the (R, W) tokens (a padding token, which no loss reads and so gets no
        gradient, is put in unit 0). None where a row's unit is not known: a module that sees whole packed rows."""
        if rows is not None and rows.time_major:
            return None
        if self.per_row:
            example = torch.arange(self.rows, device=self.slots.device) if rows is None else rows.example
            return ExampleRows(self.unit_of_row()[example], self.count, None)
        if rows is None or rows.per_example != self.unit_of_token.shape[1]:
            return None
        return ExampleRows(self.unit_of_token.flatten().clamp(min=0), self.count, None)

    def rows_of_call(self, rows: ExampleRows | None, where: str) -> ExampleRows:
        """``rows_by_unit`` for a module without a layer rule (its call rule or the torch.func fallback), refused in
        one line where a row's unit is not known."""
        by_unit = self.rows_by_unit(rows)
        if by_unit is None:
            raise UnsupportedModuleError(
                f"{where} has no layer rule and sees whole packed rows, which its call rule or the torch.func "
                "fallback cannot split into their records: register a layer rule for it with "
                "hf_dp.clipping.rules.register_rule, or freeze it"
            )
        return by_unit

    def unit_of_row(self) -> torch.Tensor:
        if not self.per_row:
            raise UnitLayoutError("records packed in a row are not whole rows")
        unit_of_row = torch.empty(self.rows, dtype=torch.long, device=self.slots.device)
        valid = self.slots >= 0
        unit_of_row[self.slots[valid]] = torch.arange(self.count, device=self.slots.device)[
            :, None
        ].expand_as(self.slots)[valid]
        return unit_of_row


def _slots(unit_of_item: torch.Tensor, count: int) -> torch.Tensor:
    """(U, L): the items (rows or flat tokens) of each unit in order, padded with -1."""
    order = torch.argsort(unit_of_item, stable=True)
    ordered = unit_of_item[order]
    valid = ordered >= 0
    order, ordered = order[valid], ordered[valid]
    sizes = torch.bincount(ordered, minlength=count)
    width = int(sizes.max()) if count else 0
    first = torch.cumsum(sizes, 0) - sizes
    position = torch.arange(ordered.numel(), device=ordered.device) - first[ordered]
    slots = torch.full((count, width), -1, dtype=torch.long, device=unit_of_item.device)
    slots[ordered, position] = order
    return slots


def _gather(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x[slots] along dim 0 with zeros (or id 0, whose gradient is zero there) where a slot is -1."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded[slots.where(slots >= 0, x.shape[0])]


def regroup_for_rule(
    units: PrivacyUnits | None,
    x: torch.Tensor,
    grad_out: torch.Tensor,
    where: str,
    rows: ExampleRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input and output gradient with flattened rows laid out by example (``rows``, rows.py) and each
    unit's tokens gathered into one example (None: unchanged); rows picked by routing: laid out by their unit."""
    if rows is not None and rows.time_major:  # (T, B, …) as (B, T, …), whose dimension 1 is no token position
        if units is not None and not units.per_row:
            raise UnitLayoutError(
                f"{where} takes a time-major input, whose rows are not the packed records' token positions, so its "
                "per-unit gradients cannot be formed; freeze it"
            )
        x, grad_out = rows.as_examples(x, grad_out)
    elif rows is not None:
        if units is not None and rows.per_example is None:
            by_unit = units.rows_by_unit(rows)  # whole-row units: each routed row's example's
            if by_unit is None:
                raise UnitLayoutError(
                    f"{where} takes rows picked from the examples (routed tokens), whose positions in a packed "
                    "record are unknown, so its per-unit gradients cannot be formed; freeze it"
                )
            x, grad_out = by_unit.as_examples(x, grad_out)
            return x, grad_out
        x, grad_out = rows.as_examples(x, grad_out)
    if units is None:
        return x, grad_out
    try:
        return units.regroup(x), units.regroup(grad_out)
    except UnitLayoutError as error:
        raise UnitLayoutError(
            f"{where}: {error}, so its per-unit gradients cannot be formed; freeze it"
        ) from None
