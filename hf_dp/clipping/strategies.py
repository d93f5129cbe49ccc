"""Clipping strategies: how one micro-batch's clipped sum Σ_i c_i g_i reaches the gradients.

- ``Bookkeeping`` (Bu et al. 2023): one backward for output gradients only, per-example norms, and the clipped
  sum written to ``.grad`` by the engine; one process and DDP (the mechanism sums across processes).
- ``TwoPass``: a norm pass on the bare module whose gradients never reach the framework, then the weighted
  loss W·Σ_i c_i L_i back-propagated THROUGH the framework (DeepSpeed ZeRO today; activation checkpointing and
  FSDP plug in here), with both passes drawing the same dropout masks.
- ``NonPrivate``: the same code path without clipping (``disable_dp``).

Each returns a ``MicroStep``: the per-example losses (for logging) and the tensor the Trainer's own
``training_step`` must back-propagate (None when ``.grad`` already holds the micro-batch's contribution).
See docs/clipping.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.evaluate import ParameterShifter, evaluate_at_points, replay_rng, rng_state
from hf_dp.optim.plan import StepPlan

LossFn = Callable[[nn.Module], torch.Tensor]


def require_per_example(losses, batch_size: int, source: str) -> torch.Tensor:
    """The per-example losses, or a one-line error: under DP a loss must come one per example."""
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or losses.shape[0] != batch_size:
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(
            f"{source} returned {shape}; under DP it must return one loss per example, shape ({batch_size},), "
            "or override compute_per_example_loss instead"
        )
    return losses


@dataclass
class MicroStep:
    losses: torch.Tensor
    backward: torch.Tensor | None


class GradientWrittenOutsideClipping(RuntimeError):
    """Something other than the clipping strategy wrote a parameter's ``.grad`` during a DP step."""


class Bookkeeping:
    """Σ_i c_i u_i into ``.grad``, u_i = Σ_e w_e ∇L_i(θ + shift_e) clipped once per example in the plan's geometry.

    It owns ``.grad`` between two releases: at a logical batch's first micro-batch every gradient must be
    None or zero, and ``check_untouched`` (before the release) and every later micro-batch find each ``.grad``
    exactly as this strategy left it (same tensor, same version), or training stops before any noise is added.
    """

    def __init__(self, engine: ClippingEngine, module: nn.Module) -> None:
        self.engine, self.module = engine, module
        self.shifter = ParameterShifter()
        self._verified = False
        self._left: list | None = None  # the gradients' (identity, version) after this strategy's last write

    def _versions(self) -> list:
        return [None if p.grad is None else (id(p.grad), p.grad._version) for p in self.engine.parameters]

    def check_untouched(self, before_release: bool = True) -> None:
        if self._left is None:
            stray = [p for p in self.engine.parameters if p.grad is not None and p.grad.any()]
        else:
            stray = [] if self._versions() == self._left else [None]
        if stray:
            raise GradientWrittenOutsideClipping(
                "a gradient reached the parameters outside per-example clipping (an extra backward in a "
                "training_step or a callback?); under DP every gradient must come from the per-example loss: "
                "override compute_per_example_loss to change it"
            )
        if before_release:
            self._left = None

    def run(self, losses_of: LossFn, mask: torch.Tensor, plan: StepPlan, model: nn.Module) -> MicroStep:
        batch_size, verify = mask.shape[0], not self._verified
        self.check_untouched(before_release=False)
        if not mask.any():  # nothing to add; the release still adds noise to the zero sum
            self._left = self._versions()
            return MicroStep(mask.new_zeros(batch_size), None)
        if len(plan.evaluations) == 1 and plan.evaluations[0].shift is None:
            with self.engine.record(batch_size):
                losses = losses_of(self.module)
            self.engine.clipped_backward(
                losses, plan.clip_norm, mask, verify=verify, clip_scale=plan.clip_scale
            )
        else:
            evaluated, losses = evaluate_at_points(
                self.engine, self.module, losses_of, plan.evaluations, batch_size, self.shifter, verify
            )
            self.engine.clip_and_accumulate(evaluated, plan.clip_norm, mask, clip_scale=plan.clip_scale)
        self._verified = True
        self._left = self._versions()
        return MicroStep(losses.detach(), None)


class TwoPass:
    """Norm pass on the bare module (no ``.grad`` touched), then W·Σ_i c_i L_i through the wrapped model.

    DeepSpeed averages gradients over the W processes, so the factor W leaves this rank's partition of the
    plain sum Σ_i c_i g_i for the mechanism. Every process runs both passes even with no real example, so the
    framework's collectives match.
    """

    def __init__(self, engine: ClippingEngine, module: nn.Module, world_size: int) -> None:
        self.engine, self.module, self.world_size = engine, module, world_size

    def run(self, losses_of: LossFn, mask: torch.Tensor, plan: StepPlan, model: nn.Module) -> MicroStep:
        if plan.requires_bookkeeping:
            raise ValueError(
                "a scaled clip geometry or shifted evaluations need the book-keeping clipping strategy"
            )
        batch_size = mask.shape[0]
        state = rng_state()
        with self.engine.record(batch_size):
            losses = losses_of(self.module)
        norms = self.engine.per_example_norms([(self.engine.per_example_gradients(losses), 1.0)])
        factors = self.engine.clip_factors(norms, plan.clip_norm) * mask
        replay_rng(state)
        losses = losses_of(model)
        weighted = (factors.detach().to(losses.dtype) * losses).sum() * self.world_size
        return MicroStep(losses.detach(), weighted)


class NonPrivate:
    """Σ_i L_i of the real examples, back-propagated by the Trainer (×W through DeepSpeed's mean, as above)."""

    def __init__(self, module: nn.Module | None, scale: float = 1.0) -> None:
        self.module, self.scale = module, scale  # module None: run the wrapped model (DeepSpeed)

    def run(self, losses_of: LossFn, mask: torch.Tensor, plan: StepPlan, model: nn.Module) -> MicroStep:
        if self.module is not None and not mask.any():
            return MicroStep(mask.new_zeros(mask.shape[0]), None)
        losses = losses_of(self.module if self.module is not None else model)
        return MicroStep(losses.detach(), (losses * mask.to(losses.dtype)).sum() * self.scale)


def clipping_strategy(
    engine: ClippingEngine | None, module: nn.Module, world_size: int, deepspeed: bool
) -> Bookkeeping | TwoPass | NonPrivate:
    """What the run needs: no engine means no DP; DeepSpeed owns the gradients, so it gets the two passes."""
    if engine is None:
        return NonPrivate(None, world_size) if deepspeed else NonPrivate(module)
    return TwoPass(engine, module, world_size) if deepspeed else Bookkeeping(engine, module)
