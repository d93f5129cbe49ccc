"""How a clipped step writes Σ_i c_i g_i once the clip factors c_i are known (the second half of pipeline.py's step).

- ``FactoredSum``: Σ_i c_i G_i from book-keeping's factored per-example gradients, one GEMM a layer.
- ``KeptSum``: Σ_i c_i G_i from the explicit per-example gradients the norm pass kept (LoRA: one pass).
- ``BodySum``: the weighted pass of the body alone from the tail's input h, plus the tail's Σ_i c_i G_i (tail.py),
  the checkpointed layers replayed (replay.py).
- ``WeightedBackward``: ∇(Σ_i c_i L_i) back-propagated through the bare module into ``.grad``.
- ``WeightedThroughFramework``: W·Σ_i c_i L_i handed to the framework (DeepSpeed, FSDP2), which averages the
  gradients over its W processes, so its backward leaves each process its part of the plain Σ_i c_i g_i.
- ``BodyThroughFramework``: the same without the tail and with the checkpointed layers replayed (ZeRO-1/2, FSDP2).
- ``PartsThroughFramework``: ``FactoredSum`` or ``KeptSum`` handed to the framework as a term linear in each
  parameter (ZeRO-0/1/2): one pass.

The losses are S·L_i under fp16 (loss_scale.py): the parts weight the S-scaled gradients by c_i / S and unscale
what a backward writes. Each returns the ``MicroStep`` the Trainer completes, or None when ``.grad`` holds the sum.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from hf_dp.clipping.checks import TOLERANCES, check_projections, projections, sums_match, tail_separable
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.evaluate import replay_rng
from hf_dp.clipping.loss_scale import LossScale
from hf_dp.clipping.norm_passes import Batch, FoundNorms
from hf_dp.clipping.per_example import Dropped, PerExampleGradient, clipped_total
from hf_dp.clipping.replay import LayerReplay
from hf_dp.clipping.tail import Tail, clipped_sums, forward_to, without_dropped

LossFn = Callable[[nn.Module], torch.Tensor]


@dataclass
class MicroStep:
    """The per-unit losses (for logging), and what the Trainer back-propagates (None: ``.grad`` holds the sum)."""

    losses: torch.Tensor
    backward: torch.Tensor | None


class SumPass(Protocol):
    def __call__(
        self, losses_of: LossFn, found: FoundNorms, norms: torch.Tensor, factors: torch.Tensor, batch: Batch
    ) -> MicroStep | None:
        """Σ_i c_i g_i, given the unscaled ``norms`` ‖s ⊙ u_i‖ and the masked clip ``factors`` c_i."""
        ...


@dataclass(frozen=True)
class FactoredSum:
    engine: ClippingEngine
    scale: LossScale

    def __call__(
        self, losses_of: LossFn, found: FoundNorms, norms: torch.Tensor, factors: torch.Tensor, batch: Batch
    ) -> None:
        """Σ_e w_e Σ_i (c_i / S)(S G_i^e); an overflowed example's rows are dropped (0 · inf would be nan)."""
        overflowed = batch.overflowed if batch.overflowed is not None else ~torch.isfinite(norms)
        self.engine.add_terms(found.terms, self.scale.weights(factors), overflowed)


@dataclass(frozen=True)
class KeptSum:
    engine: ClippingEngine
    scale: LossScale

    def __call__(
        self, losses_of: LossFn, found: FoundNorms, norms: torch.Tensor, factors: torch.Tensor, batch: Batch
    ) -> None:
        """Σ_i (c_i / S)(S G_i) from the kept explicit G_i, without the overflowed examples."""
        overflowed = batch.overflowed or Dropped.where(~torch.isfinite(norms))
        weights = self.scale.weights(factors)
        with torch.no_grad():
            for param, part in found.collector.kept_gradients():
                self.engine.add_to_sum(param, overflowed.apply(part), weights)


def _forward_to_tail(
    tail: Tail, replay: LayerReplay | None, losses_of: LossFn, module: nn.Module
) -> torch.Tensor:
    """The weighted pass's forward up to the tail's input h, the checkpointed layers replayed (replay.py)."""
    with replay.replaying() if replay and replay.complete else contextlib.nullcontext():
        return forward_to(tail.boundary, lambda: losses_of(module))


def _layerwise_usable(found: FoundNorms) -> bool:
    return found.points is not None and found.replay is not None and found.points.usable(found.replay.kept)


@dataclass(frozen=True)
class BodySum:
    """``layerwise``: the first step found the layer-by-layer pass exact (layerwise.py)."""

    engine: ClippingEngine
    module: nn.Module
    scale: LossScale
    whole: WeightedBackward  # when the norm pass found no tail
    layerwise: bool = False

    def __call__(
        self, losses_of: LossFn, found: FoundNorms, norms: torch.Tensor, factors: torch.Tensor, batch: Batch
    ) -> None:
        """Σ_i c_i g_i without the tail: the tail's own Σ_i c_i G_i (tail.py), its per-example gradients then let go,
        and the body's backward from h with spread(c) ⊙ ∂(Σ_j L_j)/∂h, or layer by layer with the layers' norm
        modules' Σ_i c_i G_i."""
        tail = found.collector.tail()
        layerwise = self.layerwise and _layerwise_usable(found)
        # the first step checked the layer-by-layer pass, not the chained one: without it, the whole pass
        if tail is None or (self.layerwise and not layerwise):
            self.whole(losses_of, found, norms, factors, batch)
            return
        with torch.no_grad():
            weights = self.scale.weights(factors)
            for param, part in self._kept_parts(tail, found, factors, layerwise, batch.dropped):
                self.engine.add_to_sum(param, part, weights)
        tail.parts.clear()
        if layerwise:
            found.points.norm_parts.clear()
        replay_rng(found.rng)
        self.body_backward(tail, found, losses_of, factors, batch, layerwise)
        self.engine.move_to_low_precision_sums()

    @staticmethod
    def _kept_parts(
        tail: Tail, found: FoundNorms, factors: torch.Tensor, layerwise: bool, dropped: Dropped | None = None
    ) -> list[tuple[nn.Parameter, PerExampleGradient]]:
        dropped = dropped or Dropped.where(factors == 0)
        parts = tail.clipped_parts(factors, dropped)
        return parts + without_dropped(found.points.norm_parts, factors, dropped) if layerwise else parts

    def body_backward(
        self,
        tail: Tail,
        found: FoundNorms,
        losses_of: LossFn,
        factors: torch.Tensor,
        batch: Batch,
        layerwise: bool,
    ) -> None:
        """The body's part of Σ_i c_i g_i into ``.grad``: the forward to h and the backward from it, or layer by
        layer from the points' kept gradients (layerwise.py)."""
        with self.scale.unscaled_gradients(self.engine.parameters):
            if layerwise:
                points, kept = found.points, found.replay.kept
                points.backward(
                    kept, points.below(tail.boundary), factors, batch.units, lambda: losses_of(self.module)
                )
                return
            hidden = _forward_to_tail(tail, found.replay, losses_of, self.module)
            if hidden.requires_grad:
                hidden.backward(tail.hidden_gradient(factors, batch.units))

    def matches_whole(
        self,
        losses_of: LossFn,
        found: FoundNorms,
        factors: torch.Tensor,
        batch: Batch,
        layerwise: bool = False,
    ) -> bool:
        """The first step: the clipped sum without the tail (``layerwise``: layer by layer) equals the whole
        weighted pass's, now in ``.grad``, for every clipped parameter (checks.py); ``.grad`` is left as the whole
        pass wrote it."""
        tail = found.collector.tail()
        if tail is None or (layerwise and not _layerwise_usable(found)):
            return False
        params = self.engine.parameters
        set_aside = [
            p.grad for p in params
        ]  # the whole pass's; reentrant checkpointing allows backward() only
        for param in params:
            param.grad = None
        self.body_backward(tail, found, losses_of, factors, batch, layerwise)
        sums = {id(p): None if p.grad is None else p.grad.float() for p in params}
        for param, grad in zip(params, set_aside, strict=True):
            param.grad = grad
        with torch.no_grad():
            weights = self.scale.weights(factors)
            for param, part in self._kept_parts(tail, found, factors, layerwise):
                sums[id(param)] = part.accumulate(sums[id(param)], weights, param.float())
        whole = {id(p): p.grad for p in params}
        return sums_match(params, sums, whole, found.collector.low_precision)


@dataclass(frozen=True)
class WeightedBackward:
    """``check``: the first step, which checks the taps against autograd along random probes and, where the norm
    pass kept the tail, whether ``BodySum`` would be exact (``found.tail_exact``, ``found.layerwise_exact``)."""

    engine: ClippingEngine
    module: nn.Module
    scale: LossScale
    check: bool = False

    def __call__(
        self, losses_of: LossFn, found: FoundNorms, norms: torch.Tensor, factors: torch.Tensor, batch: Batch
    ) -> None:
        """∇(Σ_i c_i S·L_i) / S into ``.grad``, the forward drawing the norm pass's dropout masks."""
        params = self.engine.parameters
        replay_rng(found.rng)
        before = projections(params, found.collector) if self.check else None
        with self.scale.unscaled_gradients(params):
            (factors.detach().to(found.losses.dtype) * losses_of(self.module)).sum().backward()
        if self.check:
            check_projections(
                params, self.engine.parameter_name, found.collector, self.scale.weights(factors), before
            )
            if found.collector.options.keep_tail:
                self._check_body(losses_of, found, factors, batch)
        self.engine.move_to_low_precision_sums()

    def _check_body(self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch) -> None:
        """Whether ``BodySum`` is exact layer by layer (which also checks the tail), else with the layers chained."""
        body = BodySum(self.engine, self.module, self.scale, self)
        if found.points is not None:
            replay_rng(found.rng)
            found.layerwise_exact = body.matches_whole(losses_of, found, factors, batch, layerwise=True)
        if not found.layerwise_exact:
            replay_rng(found.rng)
            found.tail_exact = body.matches_whole(losses_of, found, factors, batch)
        else:
            found.tail_exact = True


@dataclass(frozen=True)
class TailCheck:
    """The first step through a framework: whether ``BodyThroughFramework`` would be exact, checked on the bare
    module without a backward that writes gradients (checks.tail_separable), and where the norm pass kept the
    points, whether it would be exact layer by layer too (``found.layerwise_exact``, layerwise.py)."""

    engine: ClippingEngine
    module: nn.Module

    def __call__(self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch) -> bool:
        tail = found.collector.tail()
        if tail is None:
            return False
        replay_rng(found.rng)
        low_precision = found.collector.low_precision
        separable = tail_separable(
            tail, self.module, losses_of, factors, batch.units, lambda: self.engine.parameters, low_precision
        )
        if separable and _layerwise_usable(found):
            points = found.points
            found.layerwise_exact = points.matches_chain(
                found.replay.kept,
                points.below(tail.boundary),
                tail.hidden_gradient(factors, batch.units),
                factors,
                batch.units,
                low_precision,
            )
        return separable


# How a weighted pass through a framework treats the checkpointed layers: runs them, runs them and compares each
# output with the norm pass's (the first step), or replays the norm pass's outputs (replay.py).
LayerUse = Literal["run", "compare", "replay"]


def _layers(found: FoundNorms, use: LayerUse) -> contextlib.AbstractContextManager[None]:
    replay = found.replay
    if use == "run" or not replay or not replay.complete:
        return contextlib.nullcontext()
    if use == "replay":
        return replay.replaying()
    return replay.comparing(TOLERANCES.tail.at(found.collector.low_precision))


@dataclass(frozen=True)
class WeightedThroughFramework:
    """The first step (``tail_check``, ``layers="compare"``) also finds whether later steps may skip the tail
    (``found.tail_exact``) and replay the checkpointed layers (``found.replay_exact``)."""

    model: nn.Module  # as the framework wrapped it
    world_size: int
    tail_check: TailCheck | None = None
    layers: LayerUse = "run"

    def __call__(
        self, losses_of: LossFn, found: FoundNorms, norms: torch.Tensor, factors: torch.Tensor, batch: Batch
    ) -> MicroStep:
        """W·Σ_i c_i L_i of the wrapped model's forward (same dropout masks), for the Trainer's backward."""
        if self.tail_check is not None and found.collector.options.keep_tail:
            found.tail_exact = self.tail_check(losses_of, found, factors, batch)
        replay_rng(found.rng)
        with _layers(found, self.layers):
            losses = losses_of(self.model)
        if self.layers == "compare":
            found.replay_exact = bool(found.replay and found.replay.complete and found.replay.matched)
        weighted = (factors.detach().to(losses.dtype) * losses).sum() * self.world_size
        return MicroStep(losses.detach(), weighted)


@dataclass(frozen=True)
class BodyThroughFramework:
    """``BodySum`` for a framework whose backward must write the gradients: the wrapped model's forward stops at h
    (checkpointed layers replayed), and the Trainer back-propagates W·⟨h, spread(c) ⊙ ∂(Σ_j L_j)/∂h⟩, the body's
    part of Σ_i c_i g_i times W, while the tail parameters get W·Σ_i c_i G_i; the framework's mean over its W
    processes leaves the plain sum. DeepSpeed ZeRO-1/2 (whole parameters, reduced by hooks on their gradient
    accumulation) takes those as terms of the loss, Σ_p ⟨p, W·Σ_i c_i G_i^p⟩, each linear in p. FSDP2
    (``tail_into_grad``) takes them in the ``.grad`` of the unsharded parameters the norm pass saw, written
    before the backward: it reduce-scatters a unit's unsharded gradients when its part of the backward ends, and
    those of units the stopped forward never reached in its end-of-backward callback; no tail weight is read (its
    storage may be freed). ``layerwise`` (ZeRO-1/2, where the first step found it exact): the layers below the tail
    one by one instead (layerwise.py), each layer's parameters given their part by a term whose backward recomputes
    the layer, and the norm modules' Σ_i c_i G_i as the tail's."""

    model: nn.Module  # as the framework wrapped it
    world_size: int
    replay: bool  # the checkpointed layers return the norm pass's outputs (checked by the first step)
    whole: WeightedThroughFramework  # when the norm pass found no tail
    tail_into_grad: bool = False
    layerwise: bool = False

    def __call__(
        self, losses_of: LossFn, found: FoundNorms, norms: torch.Tensor, factors: torch.Tensor, batch: Batch
    ) -> MicroStep:
        tail = found.collector.tail()
        if tail is None:
            return self.whole(losses_of, found, norms, factors, batch)
        replay_rng(found.rng)
        parts = tail.parts
        if self.layerwise and _layerwise_usable(found):
            points, forward = found.points, lambda: losses_of(self.model)
            terms = [points.embeddings_term(factors, batch.units, forward)]
            terms += [
                points.layer_term(found.replay.kept, k, factors, batch.units)
                for k in range(points.below(tail.boundary))
            ]
            surrogate = sum((t for t in terms if t is not None), factors.new_zeros((), dtype=torch.float32))
            parts = parts + points.norm_parts
        else:  # the chained body from h (the layers replayed)
            hidden = _forward_to_tail(tail, found.replay if self.replay else None, losses_of, self.model)
            gradient = tail.hidden_gradient(factors, batch.units)
            surrogate = (
                (hidden * gradient.to(hidden.dtype)).sum() if hidden.requires_grad else hidden.new_zeros(())
            )
        for param, total in clipped_sums(parts, factors, batch.dropped).items():
            if not self.tail_into_grad:
                surrogate = surrogate + (param * total.to(param.dtype)).sum()
                continue
            total = (total * self.world_size).to(param.dtype)
            if param.grad is None:
                param.grad = total
            else:
                param.grad.add_(total)
        tail.parts.clear()  # the sums are formed: the per-example gradients may go before the backward
        if found.points is not None:
            found.points.norm_parts.clear()
        surrogate = surrogate * self.world_size
        if self.tail_into_grad:
            surrogate = _EndOfBackward.apply(surrogate, _fsdp2_end_of_backward(self.model))
        return MicroStep(found.losses.detach(), surrogate)


def _fsdp2_end_of_backward(model: nn.Module) -> Callable[[], None]:
    """FSDP2's end-of-backward callback, which reduce-scatters the ``.grad`` of every unit whose own backward never
    ran. FSDP2 queues it from the first unit's pre-backward hook, on that unit's output; a forward stopped at h
    before any unit returned (the tail over every layer, the root's own uses below h) leaves none to queue it, and
    the tail's sums would wait in ``.grad`` for the next backward. (A private method of torch 2.13's FSDP2; the
    two-process tests run through it.)"""
    from torch.distributed.fsdp import FSDPModule  # here: only an FSDP2 run needs torch.distributed

    root = next((m for m in model.modules() if isinstance(m, FSDPModule)), None)  # the outermost first
    if root is None:  # a model FSDP2 does not shard (the one-process tests of the pass)
        return lambda: None
    return root._get_fsdp_state()._register_root_post_backward_final_callback


class _EndOfBackward(torch.autograd.Function):
    """The identity on a loss whose backward first calls ``queue`` (which may queue an end-of-backward callback)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, queue: Callable[[], None]) -> torch.Tensor:
        ctx.queue = queue
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.queue()
        return grad, None


class _LinearTerm(torch.autograd.Function):
    """⟨p, S⟩ with S computed only when the backward reaches p, so one parameter's S is alive at a time."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, total_of: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx.total_of, ctx.dtype = total_of, param.dtype
        return param.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad * ctx.total_of()).to(ctx.dtype), None


@dataclass(frozen=True)
class PartsThroughFramework:
    """``FactoredSum`` and ``KeptSum`` for a framework whose backward must write the gradients (DeepSpeed ZeRO-0/1/2,
    whole parameters): the Trainer back-propagates W·Σ_p ⟨p, Σ_i c_i G_i^p⟩ from the norm pass's per-example
    gradients (book-keeping's factors, or the explicit gradients kept for few trainable weights), whose gradient
    is W times the clipped sum; the framework's mean over its W processes leaves the plain sum. One pass: no
    second forward or backward of the model."""

    world_size: int

    def __call__(
        self, losses_of: LossFn, found: FoundNorms, norms: torch.Tensor, factors: torch.Tensor, batch: Batch
    ) -> MicroStep:
        if found.terms is not None:
            parts = [(param, weighted) for param, weighted in found.terms.values()]
        else:
            parts = [(param, [(1.0, part)]) for param, part in found.collector.kept_gradients()]
        surrogate = factors.new_zeros((), dtype=torch.float32)
        dropped = batch.dropped or (Dropped.where(factors == 0) if parts else None)
        for param, weighted in parts:
            total_of = functools.partial(clipped_total, param, weighted, factors, dropped)
            surrogate = surrogate + _LinearTerm.apply(param, total_of)
        return MicroStep(found.losses.detach(), surrogate * self.world_size)
