"""Layers applied to an input shared by all examples: T5's and MPNet's relative attention bias, whose bucket ids
(q, k) carry no batch dimension.

Such a layer's output y is the same for every example, and autograd's gradient at y is already the sum over
the batch. Example i's share is what flows back along its own path from the point where a tensor s made from y
meets the batch (``position_bias + mask``, ``scores + position_bias``, ``bias.expand(B, …)``): the row tracker
(rows.py) finds that operation and hands it s broadcast to the batch explicitly, s_B = s.expand(B, …), which
leaves its result unchanged. The gradient at s_B is then per example, ḡ_i = ∂L_i/∂s; pulled back to y in one
batched vector-Jacobian product, ∂L_i/∂y = (∂s/∂y)ᵀ ḡ_i, it is what the layer's rule needs with its input
repeated for every example: G_i(θ) = (∂y/∂θ)ᵀ ∂L_i/∂y. A clipped parameter read outside its module's forward
(DeBERTa reads its relative embeddings' weight) is such an output itself: G_i = ∂L_i/∂W.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_dp.clipping.per_example import Materialised, PerExampleGradient
from hf_dp.clipping.wide_gemm import wide


@dataclass(eq=False)
class SharedUse:
    """One call of a layer on an input without a batch dimension, and Σ over the points where what it made meets
    the batch of each example's gradient at its output y: ``cotangent`` (B, *y.shape)."""

    module: nn.Module
    x: torch.Tensor | None
    output: torch.Tensor
    rows: int
    parameter: str | None = None  # the module's parameter itself, read outside its forward: G_i = ∂L_i/∂y
    cotangent: torch.Tensor | None = field(default=None, repr=False)
    # [True] once a gradient reached y along any path (none does where the output is only used detached: peft's
    # DoRA reads its adapters on an identity matrix for its weight norm)
    reached: list[bool] = field(default_factory=lambda: [False], repr=False)

    def receive(self, made: torch.Tensor, per_example: torch.Tensor) -> None:
        """ḡ_i at a tensor ``made`` from y, (B, *made.shape): pulled back to y and added."""
        if made is self.output:
            at_output = per_example
        else:
            at_output = _pulled_back(made, self.output, per_example)
            if at_output is None:
                return
        self.cotangent = at_output if self.cotangent is None else self.cotangent + at_output

    def per_example(self, rule: Callable) -> dict[str, PerExampleGradient] | None:
        """The layer's per-example gradients: its rule on (x repeated for every example, ∂L_i/∂y), or ∂L_i/∂y
        itself for a parameter read directly; None when no example's loss reached it."""
        if self.cotangent is None:
            return None
        if self.parameter is not None:
            return {self.parameter: Materialised(wide(self.cotangent))}
        return rule(self.module, self.x.expand(self.rows, *self.x.shape), self.cotangent)


def _pulled_back(made: torch.Tensor, output: torch.Tensor, per_example: torch.Tensor) -> torch.Tensor | None:
    """(∂made/∂output)ᵀ ḡ_i for every example i: one batched vector-Jacobian product, or one per example where the
    path back runs through a checkpoint's recomputation, which has no batching rule (``detach``)."""
    try:
        (found,) = torch.autograd.grad(
            made, output, per_example, retain_graph=True, is_grads_batched=True, allow_unused=True
        )
        return found
    except RuntimeError as error:
        if "Batching rule not implemented" not in str(error):
            raise
    rows = [
        torch.autograd.grad(made, output, g, retain_graph=True, allow_unused=True)[0] for g in per_example
    ]
    if all(row is None for row in rows):
        return None
    return torch.stack([torch.zeros_like(output) if row is None else row for row in rows])


class _Anchored(torch.autograd.Function):
    """y ↦ y that requires grad through ``anchor`` (the norm pass freezes the parameters); no gradient to it. Its
    backward marks ``reached`` (a one-element list) when a gradient arrives at y."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, anchor: torch.Tensor, reached: list[bool] | None) -> torch.Tensor:
        ctx.reached = reached
        return output.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reached is not None:
            ctx.reached[:] = [True]
        return grad, None, None


def anchored(output: torch.Tensor, anchor: torch.Tensor, reached: list[bool] | None = None) -> torch.Tensor:
    """The shared output, differentiable whether or not the layer's parameters are frozen; ``reached`` turns
    [True] when a gradient arrives at it."""
    return _Anchored.apply(output, anchor, reached)


class _Broadcast(torch.autograd.Function):
    """s_B ↦ s_B whose backward hands each example's gradient ḡ_i = ∂L_i/∂s to every use s was made from."""

    @staticmethod
    def forward(ctx, expanded: torch.Tensor, made: torch.Tensor, uses: list[SharedUse]) -> torch.Tensor:
        ctx.made, ctx.uses = made, uses
        return expanded.view_as(expanded)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        per_example = grad.reshape(grad.shape[0], *ctx.made.shape)
        for use in ctx.uses:
            use.receive(ctx.made, per_example)
        return grad, None, None


def broadcast(made: torch.Tensor, rows: int, rank: int, uses: list[SharedUse]) -> torch.Tensor:
    """``made`` (no batch dimension, or a leading 1) as the (B, …) tensor of ``rank`` dimensions the operation
    would broadcast it to, its per-example gradients handed to ``uses``."""
    aligned = made.reshape((1,) * max(rank - made.dim(), 0) + tuple(made.shape))
    return _Broadcast.apply(aligned.expand(rows, *aligned.shape[1:]), made, uses)
