"""What the first step finds about a model's weighted pass (``Calibration``, fixed for the run), and the checks
that find it.

Later steps may skip the tail (tail.py), reaching down over ``tail_layers`` checkpointed layers, run the layers
below it one by one (layerwise.py) and, through a framework, replay the checkpointed layers (replay.py): each only
where the first step found it equal to the whole weighted pass (within ``TOLERANCES.tail``). The first step runs the
whole pass, and the check around its delivery:

- ``CheckedInGradients`` (the bare module): after the whole pass wrote ``.grad``, the taps' projections against
  autograd's (checks.check_projections), weighted by the clip factors and by fixed unequal weights, then the body's sum without the tail, layer by layer and else chained,
  against it, written into set-aside gradients.
- ``CheckedThroughFramework`` (DeepSpeed ZeRO-1/2, FSDP2), whose backward runs once: before the whole pass, whether
  the tail separates (checks.tail_separable, with ``autograd.grad``) and the layer-by-layer pass equals the chain
  (``LayerByLayer.matches_chain``); during it, each checkpointed layer's output against the norm pass's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from hf_dp.clipping.checks import check_projections, engine_sum_weights, sums_match, tail_separable
from hf_dp.clipping.delivery import MicroStep
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.layerwise import LayerByLayer
from hf_dp.clipping.loss_scale import LossScale
from hf_dp.clipping.norm_passes import Batch, FoundNorms
from hf_dp.clipping.per_example import LossFn, clipped_total
from hf_dp.clipping.rng_replay import replay_rng
from hf_dp.clipping.sum_passes import BodySum, Sum, layerwise_usable


@dataclass(frozen=True)
class Calibration:
    """The first step's findings: later weighted passes skip the tail (``skips_tail``) reaching down over
    ``tail_layers`` checkpointed layers, run the layers below it one by one (``layerwise``), and through a
    framework replay the checkpointed layers (``replays``). All off: the whole weighted pass."""

    skips_tail: bool = False
    tail_layers: int = 0
    layerwise: bool = False
    replays: bool = False


def weighted_gradients(
    params: list[torch.nn.Parameter],
    losses: Callable[[], torch.Tensor],
    weights: torch.Tensor,
    found: FoundNorms,
    by_grad: bool = False,
) -> dict[int, torch.Tensor | None] | None:
    """Autograd's gradient of Σ_i w_i L_i per parameter id, from one more forward (its RNG replayed) and backward
    of the bare module, ``.grad`` set aside and put back; ``by_grad``: with ``autograd.grad``, which runs no
    gradient accumulation and so none of a framework's reduction hooks, and None where a reentrant checkpoint
    refuses it."""
    kept = [p.grad for p in params]
    for param in params:
        param.grad = None
    try:
        replay_rng(found.rng)
        values = losses()
        weighted = (values * weights.to(values.dtype)).sum()
        if by_grad:
            try:
                found_grads = torch.autograd.grad(weighted, params, allow_unused=True)
            except RuntimeError as error:
                if "use_reentrant=True" not in str(error):  # torch's refusal of .grad() through one
                    raise
                return None
            return dict(zip((id(p) for p in params), found_grads, strict=True))
        weighted.backward()
        return {id(p): p.grad for p in params}
    finally:
        for param, grad in zip(params, kept, strict=True):
            param.grad = grad


class FirstStepCheck(Protocol):
    def __call__(
        self,
        deliver: Callable[[], MicroStep],
        losses_of: LossFn,
        found: FoundNorms,
        factors: torch.Tensor,
        batch: Batch,
    ) -> tuple[MicroStep, Calibration]:
        """``deliver()`` the first step's whole weighted pass, and what the checks around it found."""
        ...


@dataclass(frozen=True)
class CheckedInGradients:
    """The whole pass into ``.grad`` (of the first micro-batch: None or 0 before it, checks.GradientGuard), checked
    against the taps along random probes, then against ``body``'s sum without the tail."""

    engine: ClippingEngine
    scale: LossScale
    body: BodySum

    def __call__(
        self,
        deliver: Callable[[], MicroStep],
        losses_of: LossFn,
        found: FoundNorms,
        factors: torch.Tensor,
        batch: Batch,
    ) -> tuple[MicroStep, Calibration]:
        step = deliver()
        collector = found.collector
        weights = self.scale.weights(factors)
        check_projections(self.engine.parameters, self.engine.parameter_name, collector, weights)
        self._check_attribution(losses_of, found, factors)
        if found.tail is None:
            return step, Calibration()
        layerwise = found.points is not None and self._matches(
            replace(self.body, layerwise=True).body(losses_of, found, factors, batch, keep=True),
            weights,
            found,
        )
        skips_tail = layerwise or self._matches(
            replace(self.body, layerwise=False).body(losses_of, found, factors, batch, keep=True),
            weights,
            found,
        )
        return step, Calibration(skips_tail=skips_tail, tail_layers=found.reached, layerwise=layerwise)

    def _check_attribution(self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor) -> None:
        """The taps' projections again, against autograd's gradient of Σ_i r_i L_i for fixed unequal r_i
        (checks.engine_sum_weights): the clip factors above may all be equal on the first step, and then a gradient
        credited to the wrong example would pass. One more forward and backward of the bare module, its RNG
        replayed, ``.grad`` set aside and put back."""
        params = self.engine.parameters
        weights = engine_sum_weights(factors.shape[0], factors.device)
        gradients = weighted_gradients(params, lambda: losses_of(self.body.module), weights, found)
        check_projections(params, self.engine.parameter_name, found.collector, weights, gradients)

    def _matches(self, body: Sum | None, weights: torch.Tensor, found: FoundNorms) -> bool:
        """The body's sum (its surrogate's backward, with the whole pass's ``.grad`` set aside, plus its parts)
        equals the whole pass's, now in ``.grad``, for every clipped parameter (checks.sums_match); ``.grad`` is
        left as the whole pass wrote it (reentrant checkpointing allows ``backward()`` only)."""
        if body is None:
            return False
        params = self.engine.parameters
        whole = [p.grad for p in params]
        for param in params:
            param.grad = None
        with self.scale.unscaled_gradients(params):
            surrogate = body.surrogate()
            if surrogate.requires_grad:
                surrogate.backward()
        sums = {id(p): None if p.grad is None else p.grad.float() for p in params}
        for param, grad in zip(params, whole, strict=True):
            param.grad = grad
        for param, weighted in body.take_parts():
            total = clipped_total(param, weighted, weights, body.drop)
            sums[id(param)] = total if sums[id(param)] is None else sums[id(param)] + total
        return sums_match(params, sums, {id(p): p.grad for p in params}, found.low_precision)


@dataclass(frozen=True)
class CheckedGroups:
    """Group-wise clipping's first step (groups.py), whose sums the norm pass formed: the taps saw every use of
    every parameter, checked along random probes against autograd's gradient of Σ_i mask_i r_i L_i for fixed
    unequal r_i (checks.engine_sum_weights: a gradient credited to the wrong example shows), from one more forward
    and backward of the bare module on this step only, its ``.grad`` set aside (None or 0 before the first
    micro-batch, checks.GradientGuard); nothing is left to find. ``by_grad``: through ZeRO-1/2, with
    ``autograd.grad`` (none of DeepSpeed's reduction hooks run)."""

    engine: ClippingEngine
    module: torch.nn.Module
    by_grad: bool = False

    def __call__(
        self,
        deliver: Callable[[], MicroStep],
        losses_of: LossFn,
        found: FoundNorms,
        factors: torch.Tensor | None,
        batch: Batch,
    ) -> tuple[MicroStep, Calibration]:
        params = self.engine.parameters
        weights = batch.mask.to(found.norms.dtype) * engine_sum_weights(
            batch.mask.shape[0], batch.mask.device
        )
        gradients = weighted_gradients(params, lambda: losses_of(self.module), weights, found, self.by_grad)
        if gradients is not None:
            check_projections(params, self.engine.parameter_name, found.collector, weights, gradients)
        return deliver(), Calibration()


@dataclass(frozen=True)
class CheckedThroughFramework:
    """Before the whole pass (as the framework wrapped the model, its layers compared: sum_passes.WholeSum), the
    tail and the layers on the bare ``module`` without a backward that writes gradients; where every process holds
    every parameter whole (ZeRO-1/2: ``attribution``), the taps' projections too, against ``autograd.grad`` of
    Σ_i r_i L_i for fixed unequal r_i (as ``CheckedInGradients._check_attribution``), unless a reentrant checkpoint
    hides its recomputation from ``autograd.grad`` (or refuses it)."""

    engine: ClippingEngine
    module: torch.nn.Module
    attribution: bool = False

    def __call__(
        self,
        deliver: Callable[[], MicroStep],
        losses_of: LossFn,
        found: FoundNorms,
        factors: torch.Tensor,
        batch: Batch,
    ) -> tuple[MicroStep, Calibration]:
        finder = found.collector.tail_finder
        if self.attribution and not (finder is not None and finder.saw_reentrant):
            params = self.engine.parameters
            weights = engine_sum_weights(factors.shape[0], factors.device)
            gradients = weighted_gradients(
                params, lambda: losses_of(self.module), weights, found, by_grad=True
            )
            if gradients is not None:
                check_projections(params, self.engine.parameter_name, found.collector, weights, gradients)
        skips_tail, layerwise = self._tail(losses_of, found, factors, batch)
        step = deliver()
        replay = found.replay
        replays = bool(replay and replay.complete and replay.matched)
        return step, Calibration(skips_tail, found.reached, layerwise and replays, replays)

    def _tail(
        self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch
    ) -> tuple[bool, bool]:
        """Whether the body from h plus the tail's Σ_i c_i G_i is the whole pass, and whether layer by layer too."""
        tail = found.tail
        if tail is None:
            return False, False
        replay_rng(found.rng)
        low_precision = found.low_precision
        separable = tail_separable(
            tail, self.module, losses_of, factors, batch.units, lambda: self.engine.parameters, low_precision
        )
        if not (separable and layerwise_usable(found)):
            return separable, False
        layers = LayerByLayer(found.points, found.replay.kept, factors, batch.units)
        below = found.points.below(tail.boundary)
        layerwise = layers.matches_chain(below, tail.hidden_gradient(factors, batch.units), low_precision)
        return separable, layerwise
