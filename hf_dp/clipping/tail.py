"""Activation checkpointing's weighted pass without the model's tail.

The tail is what runs after the last checkpointed block: a causal LM's final norm and LM head, and the loss. It is
position-wise (each position's loss depends on the body only through that position's hidden state h), so
∂L_i/∂h is ∂(Σ_j L_j)/∂h restricted to unit i's rows or tokens, and the weighted pass's gradient at h is

    ∂(Σ_i c_i L_i)/∂h = spread(c) ⊙ ∂(Σ_j L_j)/∂h        (spread: c_i on each row or token of unit i).

So the norm pass keeps ∂(Σ_j L_j)/∂h (B·T·d floats) and the tail's per-example gradients G_i (explicit, or the
layer's factors when those are smaller), and the weighted pass runs the body alone: forward up to h, backward
from h with spread(c) ⊙ ∂(Σ L)/∂h, plus Σ_i c_i G_i for the tail's parameters. That drops the LM head's forward,
both of its backward GEMMs and the loss from the second pass (a third of a checkpointed Llama 8×512 step at
vocabulary 32k).

The same holds with h the input of a checkpointed layer wherever no unit's loss reads another unit's rows or tokens
(rows apart; packed records kept apart by their attention, checks.check_records_apart): the tail may reach down
over the last layers (``deepen``) while their per-example gradients fit a budget. Each layer so kept leaves the
weighted pass without its recomputation and backward: three of the seven layer-forwards a checkpointed DP step
costs, against four for the stock step. The first step checks the result against the whole weighted pass and uses
the whole pass for good if they differ (a loss term that reaches the body other than through h, e.g. a router's
auxiliary loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_dp.clipping.per_example import Dropped, OuterProductSum, PerExampleGradient, Weighted, clipped_total
from hf_dp.clipping.units import PrivacyUnits


@dataclass
class TailBoundary:
    """The tail's input h: the input of its first module's ``call``-th call (``at_output``: the output of the last
    checkpointed layer's call, where no clipped parameter follows it), and ∂(Σ_i L_i)/∂h from the norm pass (kept
    only if ``wanted`` by the time the backward reaches h)."""

    module: nn.Module
    call: int
    gradient: torch.Tensor | None = None
    wanted: bool = True
    at_output: bool = False

    def watch(self, hidden: torch.Tensor) -> None:
        """Keep h's gradient when the norm pass's backward reaches it."""

        def keep(gradient: torch.Tensor) -> None:
            if self.wanted:
                self.gradient = gradient.detach().clone()

        hidden.register_hook(keep)


@dataclass
class LayerCall:
    """A checkpointed layer's call in the norm pass's forward: the number of the first use inside it (taps.py), and
    its input as a candidate boundary."""

    first_use: int
    boundary: TailBoundary
    differentiable: bool  # its input requires a gradient (h, where the body's backward would start)


@dataclass
class Tail:
    """What the norm pass kept of the tail: its boundary and each use's per-example gradients."""

    boundary: TailBoundary
    parts: list[tuple[nn.Parameter, PerExampleGradient]] = field(default_factory=list)

    def hidden_gradient(self, factors: torch.Tensor, units: PrivacyUnits | None) -> torch.Tensor:
        """spread(c) ⊙ ∂(Σ_i L_i)/∂h (``weighted_by_units``)."""
        return weighted_by_units(self.boundary.gradient, factors, units)

    def take_parts(self) -> list[tuple[nn.Parameter, PerExampleGradient]]:
        """The tail's per-example gradients, handed over once (the tail no longer holds them)."""
        parts, self.parts = self.parts, []
        return parts

    def clipped_sums(
        self, factors: torch.Tensor, dropped: Dropped | None = None
    ) -> dict[nn.Parameter, torch.Tensor]:
        """Σ_i c_i G_i per tail parameter (all its tail uses), float32 or wider."""
        return clipped_sums(self.parts, factors, dropped)


def clipped_sums(
    parts: list[tuple[nn.Parameter, PerExampleGradient]],
    factors: torch.Tensor,
    dropped: Dropped | None = None,
) -> dict[nn.Parameter, torch.Tensor]:
    """Σ_i c_i G_i per parameter over all its kept uses, float32 or wider, without the examples whose clip factor
    is 0: ``dropped``, or decided here once for all the parameters."""
    uses: dict[nn.Parameter, list[Weighted]] = {}
    for param, part in parts:
        uses.setdefault(param, []).append((1.0, part))
    if uses and dropped is None:
        dropped = Dropped.where(factors == 0)
    return {param: clipped_total(param, weighted, factors, dropped) for param, weighted in uses.items()}


def keep_form(part: PerExampleGradient, shape: torch.Size) -> PerExampleGradient:
    """The smaller exact form of a tail use's per-example gradients: explicit (B, *shape), or the layer's factors."""
    if isinstance(part, OuterProductSum) and part.left.is_floating_point():
        factor_bytes = sum(x.numel() * x.element_size() for x in (part.left, part.right))
        explicit_dtype = torch.promote_types(part.right.dtype, torch.float32)  # explicit G_i: float32+
        explicit_bytes = part.batch_size * shape.numel() * explicit_dtype.itemsize
        if explicit_bytes <= factor_bytes:
            return part.explicit(shape)
    return part


def weighted_by_units(
    gradient: torch.Tensor, factors: torch.Tensor, units: PrivacyUnits | None
) -> torch.Tensor:
    """spread(c) ⊙ ∂(Σ_i L_i)/∂h, exactly 0 on the rows and tokens of units with c_i = 0 (their gradient may not be
    finite)."""
    return UnitWeights(factors, units)(gradient)


class UnitWeights:
    """``weighted_by_units`` for several gradients of one micro-batch, spread(c) and its zeros formed once per shape."""

    def __init__(self, factors: torch.Tensor, units: PrivacyUnits | None) -> None:
        self.factors, self.units = factors, units
        self._formed: dict[tuple[torch.Size, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, gradient: torch.Tensor) -> torch.Tensor:
        key = (gradient.shape, gradient.dtype)
        if key not in self._formed:
            weights = spread(self.factors, self.units, gradient.shape).to(gradient.dtype)
            self._formed[key] = (weights, weights != 0)
        weights, nonzero = self._formed[key]
        return torch.where(nonzero, gradient * weights, 0.0)


def paired(hidden: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """A term whose gradient towards h is ``gradient`` (times the incoming one), as ⟨h, gradient⟩'s is: one operator
    in the backward where the product and its sum take three. Its value is 0."""
    return _Paired.apply(hidden, gradient.to(hidden.dtype))


class _Paired(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        ctx.gradient = gradient
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.gradient * grad, None


def spread(factors: torch.Tensor, units: PrivacyUnits | None, shape: torch.Size) -> torch.Tensor:
    """c per unit → c on each row (or token) of a (R, T, ...) tensor, broadcastable to ``shape``."""
    if units is None or units.is_trivial:
        per_row = factors
    elif units.per_row:
        per_row = factors[units.unit_of_row()]
    else:
        of_token = units.unit_of_token
        per_token = torch.where(of_token >= 0, factors[of_token.clamp(min=0)], 0.0)
        return per_token.reshape(*per_token.shape, *[1] * (len(shape) - 2))
    return per_row.reshape(-1, *[1] * (len(shape) - 1))


class _ReachedBoundary(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _hook_boundary(boundary: TailBoundary, swap: Callable[[torch.Tensor], torch.Tensor | None]):
    """A hook on the boundary's module that hands h (its ``call``-th input, or output) to ``swap``, which may return
    the tensor to go on with; returns the hook's handle."""
    calls = 0

    def counted() -> bool:
        nonlocal calls
        calls += 1
        return calls == boundary.call

    if boundary.at_output:

        def after(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            return swap(output) if counted() else None

        return boundary.module.register_forward_hook(after)

    def before(module: nn.Module, args: tuple) -> tuple | None:
        if not counted():
            return None
        swapped = swap(args[0])
        return None if swapped is None else (swapped, *args[1:])

    return boundary.module.register_forward_pre_hook(before)


def forward_to(boundary: TailBoundary, forward: Callable[[], object]) -> torch.Tensor:
    """Run ``forward`` until it reaches the tail's input h (``boundary``) and return h, without running the tail."""

    def stop(hidden: torch.Tensor) -> None:
        raise _ReachedBoundary(hidden)

    handle = _hook_boundary(boundary, stop)
    try:
        forward()
    except _ReachedBoundary as reached:
        return reached.hidden
    finally:
        handle.remove()
    raise RuntimeError(
        "the weighted pass never reached the tail the norm pass saw: its forward changed between passes"
    )


def forward_from_leaf(
    boundary: TailBoundary, forward: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``forward`` with the tail's input h replaced by a detached leaf copy; return its output and the leaf,
    so that a gradient towards the leaf runs through the tail alone."""
    leaf: torch.Tensor | None = None

    def cut(hidden: torch.Tensor) -> torch.Tensor:
        nonlocal leaf
        leaf = hidden.detach().requires_grad_(True)
        return leaf

    handle = _hook_boundary(boundary, cut)
    try:
        output = forward()
    finally:
        handle.remove()
    if leaf is None:
        raise RuntimeError(
            "the check's forward never reached the tail the norm pass saw: its forward changed between passes"
        )
    return output, leaf
