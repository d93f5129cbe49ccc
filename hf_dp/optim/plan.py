"""What a DP optimizer asks of the next logical batch, fixed across its micro-batches.

The trainer calls ``optimizer.plan_step(C)`` once per logical batch. The plan says which clip norm to
use (DP² switches C1/C2 by phase), in which geometry to clip (scale-then-privatize and DP² clip
‖s ⊙ g_i‖), and at which points to evaluate each example's gradient and with which weights before the
per-example COMBINATION is clipped once (DiSK: u_i = c·∇f_i(θ + γd) + (1−c)·∇f_i(θ)).
The privatiser then adds N(0, σ²C²) in the scaled space, i.e. std σC/s per coordinate of the
un-scaled sum, so the optimizer's step always receives ĝ = (Σ_i c_i g_i + σC ξ ⊘ s) / B̄.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from hf_dp.clipping.scale import ClipScales


class Shift(Mapping):
    """{p: scale·direction_p}, computed on access so that a plan pins no copy of the model. The trainer
    applies it in place with one fused ``θ += scale·direction`` over all parameters (``_foreach_add_``)."""

    def __init__(self, scale: float, directions: dict[nn.Parameter, torch.Tensor]) -> None:
        self.scale, self.directions = scale, directions

    def __getitem__(self, p: nn.Parameter) -> torch.Tensor:
        return (self.scale * self.directions[p]).to(p.dtype)

    def __iter__(self) -> Iterator[nn.Parameter]:
        return iter(self.directions)

    def __len__(self) -> int:
        return len(self.directions)


@dataclass(frozen=True)
class Evaluation:
    """One gradient evaluation: per-example losses at θ + shift, weighted in the per-example combination."""

    weight: float = 1.0
    shift: Shift | None = None


@dataclass(frozen=True)
class StepPlan:
    clip_norm: float
    clip_scale: ClipScales | None = None
    evaluations: tuple[Evaluation, ...] = (Evaluation(),)


@runtime_checkable
class PlansSteps(Protocol):
    """A DP optimizer whose clipping or evaluation points depend on its state."""

    def plan_step(self, clip_norm: float) -> StepPlan: ...


def plan_for(optimizer: torch.optim.Optimizer, clip_norm: float) -> StepPlan:
    """The optimizer's plan, or plain DP-SGD clipping (one evaluation, ℓ2 geometry) for a stock optimizer."""
    if isinstance(optimizer, PlansSteps):
        return optimizer.plan_step(clip_norm)
    return StepPlan(clip_norm=clip_norm)
