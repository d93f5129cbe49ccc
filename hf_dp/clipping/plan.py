"""What a DP update rule asks of the next logical batch, fixed across its micro-batches, and who holds it.

A ``StepPlan`` says at which clip norm to clip (DP² switches C1/C2 by phase), in which geometry (STP and DP²
clip ‖s ⊙ g_i‖), and at which points to evaluate each example before the per-example COMBINATION
u_i = Σ_e w_e ∇f_i(θ + shift_e) is clipped once (DiSK). The ``StepPlanner`` asks the optimizer for it at
the first micro-batch of a logical batch and holds it until the batch is released; the clipping strategy
and the mechanism both read ``planner.current``, so they cannot disagree. See docs/dp-step.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from hf_dp.clipping.geometry import ClipScales


@dataclass(frozen=True, eq=False)
class Shift:
    """Evaluate at θ + scale·direction_p for every parameter p in ``directions`` (no copy of the model)."""

    scale: float
    directions: dict[nn.Parameter, torch.Tensor]

    def offset(self, param: nn.Parameter) -> torch.Tensor:
        """scale·direction_p in the parameter's dtype."""
        return (self.scale * self.directions[param]).to(param.dtype)


@dataclass(frozen=True)
class Evaluation:
    """One gradient evaluation: per-example losses at θ + shift, weighted in the per-example combination."""

    weight: float = 1.0
    shift: Shift | None = None


@dataclass(frozen=True)
class StepPlan:
    """Clip Σ_e w_e ∇f_i(θ + shift_e) once per example at ``clip_norm`` in the geometry ``clip_scale``.

    The mechanism then adds N(0, σ²C²) in the scaled space: std σC/s per coordinate of the un-scaled sum.
    """

    clip_norm: float
    clip_scale: ClipScales | None = None
    evaluations: tuple[Evaluation, ...] = field(default=(Evaluation(),))

    @property
    def single_evaluation(self) -> bool:
        """One evaluation, at θ: every plan but DiSK's. Only book-keeping's norms combine several (a weighted
        backward back-propagates Σ_i c_i L_i at θ: pipeline.py)."""
        return len(self.evaluations) == 1 and self.evaluations[0].shift is None


@runtime_checkable
class HasStepPlan(Protocol):
    """A DP update rule whose clipping or evaluation points depend on its state."""

    def plan_step(self, clip_norm: float) -> StepPlan: ...


class StepPlanner:
    """The one owner of the current logical batch's plan: made by the update rule when first asked, held
    until ``end()`` (the trainer ends it after each optimizer step)."""

    def __init__(self, clip_norm: float) -> None:
        self.clip_norm = clip_norm
        self._optimizer: torch.optim.Optimizer | None = None
        self._current: StepPlan | None = None

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """The DP update rule (before accelerate or DeepSpeed wrap it)."""
        self._optimizer = optimizer

    @property
    def current(self) -> StepPlan:
        """The plan of the logical batch in progress (plain DP-SGD clipping for a rule that has no plan)."""
        if self._current is None:
            if isinstance(self._optimizer, HasStepPlan):
                self._current = self._optimizer.plan_step(self.clip_norm)
            else:
                self._current = StepPlan(clip_norm=self.clip_norm)
        return self._current

    def end(self) -> None:
        """The logical batch is released: the next ``current`` asks the update rule again."""
        self._current = None
