"""A module without a rule inside the norm pass's backward (activation checkpointing, FSDP2, group-wise clipping):
its whole call is tapped, so that the torch.func fallback (rules.functorch_per_example_grads) runs when the
gradients of all its outputs arrive.

``tap_call`` saves the call's tensor arguments through autograd (a checkpoint drops and recomputes them like any
other saved activation) and returns its floating outputs as fresh tensors: the gradient at each is then only what
flows back into that output (an MoE router's scores are a function of its logits; the gradient at the logits
themselves would count the scores' path twice). Its backward rebuilds the call and hands it, with every output's
gradient, to ``receive``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

Received = Callable[[tuple, dict, list[torch.Tensor | None]], None]


class _TapCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, receive, rebuild, inputs: int, *tensors):
        ctx.receive, ctx.rebuild, ctx.inputs = receive, rebuild, inputs
        ctx.save_for_backward(*tensors[:inputs])
        return tuple(t.detach() for t in tensors[inputs:])

    @staticmethod
    def backward(ctx, *grads):
        args, kwargs = ctx.rebuild(ctx.saved_tensors)
        ctx.receive(args, kwargs, list(grads))
        return (None, None, None, None, *[None] * ctx.inputs, *grads)


def tap_call(anchor: torch.Tensor, args: tuple, kwargs: dict, output, receive: Received):
    """``output`` with its floating tensors replaced by fresh ones whose backward calls ``receive(args, kwargs,
    grads)``, the gradient of every tensor output in order (None for one that is not floating)."""
    flat, spec = tree_flatten((args, kwargs))
    where = [k for k, value in enumerate(flat) if isinstance(value, torch.Tensor)]
    out_flat, out_spec = tree_flatten(output)
    tensors = [k for k, value in enumerate(out_flat) if isinstance(value, torch.Tensor)]
    tapped = [k for k in tensors if out_flat[k].is_floating_point()]

    def rebuild(saved: tuple[torch.Tensor, ...]) -> tuple[tuple, dict]:
        values = list(flat)
        for k, tensor in zip(where, saved, strict=True):
            values[k] = tensor
        return tree_unflatten(values, spec)

    def received(call_args: tuple, call_kwargs: dict, grads: list[torch.Tensor | None]) -> None:
        by_output = dict(zip(tapped, grads, strict=True))
        receive(call_args, call_kwargs, [by_output.get(k) for k in tensors])

    fresh = _TapCall.apply(
        anchor, received, rebuild, len(where), *[flat[k] for k in where], *[out_flat[k] for k in tapped]
    )
    for k, tensor in zip(tapped, fresh, strict=True):
        out_flat[k] = tensor
    return tree_unflatten(out_flat, out_spec)
