"""How the DP step meets the Trainer's ``compute_loss`` contract.

During a DP ``training_step`` the parent's ``training_step`` calls ``compute_loss``, which runs the clipping
strategy; the strategy in turn evaluates the loss per example through ``compute_loss`` again, now meaning
"one loss per example". A ``MicroBatch`` carries which of the two is asked; a subclass's own
``compute_loss`` is wrapped so that it, too, is the per-example loss inside the strategy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hf_dp.clipping.checks import ExamplesAlone
from hf_dp.clipping.units import PrivacyUnits
from hf_dp.privacy_units import choice_units


def require_per_example(
    losses, batch_size: int, source: str, units: PrivacyUnits | None = None
) -> torch.Tensor:
    """One loss per privacy unit, shape (U,), or a one-line error. Units made of whole rows (pairs, users) also
    accept one loss per row: a unit's loss is then the mean over its rows."""
    if (
        units is not None
        and units.per_row
        and isinstance(losses, torch.Tensor)
        and losses.dim() == 1
        and losses.shape[0] == units.rows != batch_size
    ):
        return units.mean_over_rows(losses)
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or losses.shape[0] != batch_size:
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        rows = "" if units is None or units.rows == batch_size else f" made of {units.rows} rows"
        raise ValueError(
            f"{source} returned {shape}; under DP it must return one loss per privacy unit, shape ({batch_size},) "
            f"for this micro-batch's {batch_size} units{rows} (no mean over the batch): return the per-example "
            "losses, or override compute_per_example_loss instead"
        )
    return losses


@dataclasses.dataclass
class MicroBatch:
    """The DP state of one ``training_step``: its privacy units, which are real, and what the strategy left."""

    mask: torch.Tensor  # (U,): 1 for a real unit, 0 for a placeholder
    units: PrivacyUnits | None = None  # None: one unit per row
    evaluating: bool = False  # inside the strategy: compute_loss means the per-example loss
    alone: ExamplesAlone | None = None  # the loader's first micro-batch: its examples alone, checked once
    losses: torch.Tensor | None = None

    @staticmethod
    def of(mask: torch.Tensor, units: PrivacyUnits | None, device: torch.device) -> MicroBatch:
        """The micro-batch of ``mask``'s drawn units, grouped by ``units``; its sizes must agree."""
        if units is not None and units.count != mask.shape[0]:
            raise ValueError(
                f"this micro-batch forms {units.count} privacy units but the loader drew {mask.shape[0]} examples "
                "(does the collator pad a packed row with extra position-0 tokens, e.g. pad_to_multiple_of? unset it)"
            )
        return MicroBatch(mask.to(device), units=None if units is None else units.to(device))

    def logged_loss(self, source: str, world_size: int, drawn: int) -> torch.Tensor:
        """This micro-batch's share of the mean per-example loss of the drawn logical batch over all processes
        (what the Trainer logs, as the mean over processes; without noise, so NOT private)."""
        if self.losses is None:
            raise RuntimeError(
                f"{source}.training_step did not reach DPTrainerMixin.compute_loss, so nothing was "
                "clipped: call super().training_step() and super().compute_loss()"
            )
        return (self.losses * self.mask.to(self.losses.dtype)).sum() * world_size / max(drawn, 1)

    def per_example_losses(
        self, compute_loss: Callable[..., Any], inputs: dict[str, Any], source: str
    ) -> Callable[[nn.Module], torch.Tensor]:
        """The strategy's loss function: ``compute_loss`` in per-example mode, one loss per unit (U,)."""

        def losses_of(module: nn.Module) -> torch.Tensor:
            self.evaluating = True
            try:
                losses = compute_loss(module, inputs)
            finally:
                self.evaluating = False
            return require_per_example(losses, self.mask.shape[0], source, self.units)

        return losses_of


def examples_alone(
    trainer: Any, alone: list | None, inputs: dict[str, Any], units: PrivacyUnits | None = None
) -> ExamplesAlone | None:
    """The loader's examples alone (data.ALONE_KEY; None or empty: nothing to check), each with the per-example loss of that example as a
    micro-batch of its own: the trainer's ``_micro_batch`` points at that one-unit batch during the call, so its
    ``compute_loss`` means the per-example loss there, and back at the outer one after. Not checked where the
    micro-batch's ``units`` are other than the loader's rows (users, pairs, packed records); a multiple-choice
    example's choices are its own rows' (privacy_units.choice_units)."""
    if not alone or (units is not None and choice_units(inputs) is None):
        return None
    source = f"{type(trainer).__name__}.compute_loss"

    def loss_of(example: dict[str, Any]) -> Callable[[nn.Module], torch.Tensor]:
        example = trainer._prepare_inputs(example)
        tensors = [v for v in example.values() if isinstance(v, torch.Tensor)]
        if not tensors:
            kinds = ", ".join(f"{k}: {type(v).__name__}" for k, v in example.items())
            raise ValueError(
                f"the data collator returned no tensors ({kinds}): return torch tensors, e.g. with "
                "DataCollatorWithPadding or a tokenizer's return_tensors='pt'"
            )
        device = tensors[0].device
        micro = MicroBatch.of(torch.ones(1), None, device)
        losses_of = micro.per_example_losses(trainer.compute_loss, example, source)

        def run(module: nn.Module) -> torch.Tensor:
            outer, trainer._micro_batch = trainer._micro_batch, micro
            try:
                return losses_of(module)
            finally:
                trainer._micro_batch = outer

        return run

    return ExamplesAlone.of(alone, inputs, loss_of)


def per_example_under_dp(compute_loss: Callable[..., Any]) -> Callable[..., Any]:
    """A subclass's own ``compute_loss`` is, during DP training, the per-example loss the DP step evaluates."""

    @functools.wraps(compute_loss)
    def wrapped(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        micro = self._micro_batch
        if micro is not None and not micro.evaluating:
            return self._clipped_step(model, inputs, micro)
        return compute_loss(
            self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    return wrapped
