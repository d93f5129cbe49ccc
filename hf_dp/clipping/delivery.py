"""How a computed ``Sum`` (sum_passes.py) reaches the gradients: its parts' Σ_i c_i G_i and its surrogate's gradient.

- ``IntoGradients``: the bare module (one process, DDP): the parts added to ``.grad`` (a bf16/fp16 parameter's
  into its float32 sum, sums.py), then the surrogate back-propagated.
- ``AsLinearTerms``: DeepSpeed, whose backward must write the gradients: the Trainer back-propagates
  W·(surrogate + Σ_p ⟨p, Σ_i c_i G_i^p⟩), each term linear in a whole parameter (ZeRO-0/1/2, the parts' sums or
  the totals already formed; ZeRO-3's sums have neither); the framework's mean over its W processes leaves the
  plain Σ_i c_i g_i.
- ``IntoUnshardedGradients``: FSDP2: the parts' W·Σ_i c_i G_i into the ``.grad`` of the unsharded parameters the
  norm pass saw, before the backward of W·surrogate; FSDP2 reduce-scatters a unit's unsharded gradients when its
  part of the backward ends, and those of units the stopped forward never reached in its end-of-backward callback.

The losses are S·L_i under fp16 (loss_scale.py): the parts are weighted by c_i / S and a backward's ``.grad``
unscaled. Each returns the ``MicroStep`` the Trainer completes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.loss_scale import LossScale
from hf_dp.clipping.per_example import Folded, clipped_total
from hf_dp.clipping.sum_passes import Sum


@dataclass
class MicroStep:
    """The per-unit losses (for logging), and what the Trainer back-propagates (None: ``.grad`` holds the sum)."""

    losses: torch.Tensor
    backward: torch.Tensor | None


class Delivery(Protocol):
    def __call__(self, computed: Sum, factors: torch.Tensor, losses: torch.Tensor) -> MicroStep:
        """Deliver Σ_i c_i g_i given the masked clip ``factors`` c_i; ``losses``: the norm pass's, for logging."""
        ...


@dataclass(frozen=True)
class IntoGradients:
    """The parts' Σ_i (c_i / S)(S G_i) into ``.grad``, their per-example gradients then let go, and the surrogate's
    ∇ / S (S·Σ_i c_i g_i from the S-scaled losses) added to ``.grad``."""

    engine: ClippingEngine
    scale: LossScale

    def __call__(self, computed: Sum, factors: torch.Tensor, losses: torch.Tensor) -> MicroStep:
        for param, total in computed.totals.items():
            self.engine.sums.add_total(param, total)
        weights = self.scale.weights(factors) if factors is not None else None
        folded = Folded()  # an input shared by consecutive uses (q, k, v) is scaled by c once
        with torch.no_grad():
            for param, weighted in computed.take_parts():
                for weight, part in weighted:
                    self.engine.sums.add(
                        param, computed.drop.apply(part), weights if weight == 1 else weight * weights, folded
                    )
        if computed.surrogate is not None:
            with self.scale.unscaled_gradients(self.engine.parameters):
                surrogate = computed.surrogate()
                if surrogate.requires_grad:
                    surrogate.backward()
        return MicroStep(self.scale.unscale(losses.detach()), None)


class _LinearTerm(torch.autograd.Function):
    """⟨p, S⟩ with S computed only when the backward reaches p (``total_of``), so one parameter's S is alive at a
    time; its value is 0."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, total_of: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx.total_of, ctx.dtype = total_of, param.dtype
        return param.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad * ctx.total_of()).to(ctx.dtype), None


def _given(total: torch.Tensor) -> torch.Tensor:
    return total


def _surrogate(computed: Sum, losses: torch.Tensor) -> torch.Tensor:
    """The sum's surrogate, or a zero where it has none."""
    return (
        computed.surrogate() if computed.surrogate is not None else losses.new_zeros((), dtype=torch.float32)
    )


@dataclass(frozen=True)
class AsLinearTerms:
    """W·(surrogate + Σ_p ⟨p, Σ_i c_i G_i^p⟩) for the Trainer's backward: a lazy sum's per-parameter totals are formed
    when the backward reaches each parameter, the others at once and their parts let go."""

    world_size: int

    def __call__(self, computed: Sum, factors: torch.Tensor, losses: torch.Tensor) -> MicroStep:
        surrogate = _surrogate(computed, losses)
        for param, total in computed.totals.items():
            surrogate = surrogate + _LinearTerm.apply(param, functools.partial(_given, total))
        for param, weighted in computed.take_parts():
            total_of = functools.partial(clipped_total, param, weighted, factors, computed.drop)
            if not computed.lazy:
                total_of = functools.partial(_given, total_of())
            surrogate = surrogate + _LinearTerm.apply(param, total_of)
        return MicroStep(losses.detach(), surrogate * self.world_size)


@dataclass(frozen=True)
class IntoUnshardedGradients:
    """W·Σ_i c_i G_i (the parts', and the totals group-wise clipping formed) into the unsharded parameters'
    ``.grad`` (no weight is read: its storage may be freed), then W·surrogate for the Trainer's backward, which
    first queues FSDP2's end-of-backward callback (a surrogate-less sum back-propagates a zero leaf for it)."""

    model: nn.Module  # as FSDP2 wrapped it
    world_size: int

    def __call__(self, computed: Sum, factors: torch.Tensor, losses: torch.Tensor) -> MicroStep:
        surrogate = _surrogate(computed, losses)
        if not surrogate.requires_grad:
            surrogate = surrogate.detach().requires_grad_()
        for param, total in computed.totals.items():
            self._add(param, total)
        for param, weighted in computed.take_parts():
            self._add(param, clipped_total(param, weighted, factors, computed.drop))
        queue = _fsdp2_end_of_backward(self.model)
        return MicroStep(losses.detach(), _EndOfBackward.apply(surrogate * self.world_size, queue))

    def _add(self, param: nn.Parameter, total: torch.Tensor) -> None:
        total = (total * self.world_size).to(param.dtype)
        param.grad = total if param.grad is None else param.grad.add_(total)


def _fsdp2_end_of_backward(model: nn.Module) -> Callable[[], None]:
    """FSDP2's end-of-backward callback, which reduce-scatters the ``.grad`` of every unit whose own backward never
    ran. FSDP2 queues it (once) from the first unit's pre-backward hook, on that unit's output; a forward stopped at
    h before any unit returned (the tail over every layer, the root's own uses below h) leaves none to queue it, and
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
