"""The torch.func fallback for a module without a rule (``functorch_per_example_grads``), and its tap inside the
norm pass's backward (activation checkpointing, FSDP2, group-wise clipping): the module's whole call is tapped, so
that the fallback runs when the gradients of all its outputs arrive.

``tap_call`` saves the call's tensor arguments through autograd (a checkpoint drops and recomputes them like any
other saved activation) and returns its floating outputs as fresh tensors: the gradient at each is then only what
flows back into that output (an MoE router's scores are a function of its logits; the gradient at the logits
themselves would count the scores' path twice). Its backward rebuilds the call and hands it, with every output's
gradient, to ``receive``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from hf_dp.clipping.per_example import Materialised, PerExampleGradient
from hf_dp.clipping.rows import ExampleRows
from hf_dp.clipping.wide_gemm import wide

Received = Callable[[tuple, dict, list[torch.Tensor | None]], None]


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module without a layer rule, once its backward is done: its arguments, the gradient of each of
    its tensor outputs in order (None where none arrived or the output is not floating), and whose rows its inputs
    hold (``rows``: the example of each row of a flattened input, rows.py; None: the ``batch_size`` rows of the
    batch itself). What a call rule (rules.register_call_rule) and the torch.func fallback start from."""

    module: nn.Module
    args: tuple
    kwargs: dict
    grad_outputs: list[torch.Tensor | None]
    batch_size: int
    rows: ExampleRows | None = None


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


def functorch_per_example_grads(
    call: ModuleCall, param_names: list[str], values: dict[str, torch.Tensor] | None = None
) -> dict[str, PerExampleGradient]:
    """Fallback for modules without a rule: G_i = ∂⟨f(x_i; θ), ∂y_i⟩/∂θ, by vmap over examples (torch.func).

    Exact for any module whose output for example i depends only on example i's inputs. With ``call.rows`` the
    module takes flattened tokens (rows.py), so it is vmapped over rows (exact when each output row depends on its
    input row only) and G_i = Σ_(rows r of i) G_r. ``values``: the parameters' values where they are not the
    module's own (peft's LoRA on a parameter: W + s·B A).
    """
    rows = call.rows
    if rows is not None:
        per_row = functorch_per_example_grads(
            replace(call, batch_size=rows.count, rows=None), param_names, values
        )
        return {name: Materialised(rows.sum_per_example(part.grads)) for name, part in per_row.items()}
    module, args, kwargs, grad_outputs, batch_size = (
        call.module,
        call.args,
        call.kwargs,
        call.grad_outputs,
        call.batch_size,
    )
    values = values or {}
    # nested names: joined reads
    params = {n: values.get(n, p).detach() for n, p in module.named_parameters() if n in param_names}
    is_batched = [isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == batch_size for a in args]
    batched_kwargs = {
        k: v
        for k, v in kwargs.items()
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch_size
    }
    static_kwargs = {k: v for k, v in kwargs.items() if k not in batched_kwargs}
    used = [i for i, g in enumerate(grad_outputs) if g is not None]

    def objective(p: dict, example_args: list, example_kwargs: dict, cotangents: list) -> torch.Tensor:
        call_args = [a.unsqueeze(0) if b else a for a, b in zip(example_args, is_batched, strict=True)]
        call_kwargs = {**static_kwargs, **{k: v.unsqueeze(0) for k, v in example_kwargs.items()}}
        out = functional_call(module, p, tuple(call_args), call_kwargs, strict=False)
        outs = [o for o in (out if isinstance(out, tuple | list) else (out,)) if isinstance(o, torch.Tensor)]
        return sum(
            (outs[i] * c.unsqueeze(0).to(outs[i].dtype)).sum() for i, c in zip(used, cotangents, strict=True)
        )

    arg_dims = [0 if b else None for b in is_batched]
    per_example = vmap(grad(objective), in_dims=(None, arg_dims, 0, 0))(
        params, list(args), batched_kwargs, [grad_outputs[i] for i in used]
    )
    return {name: Materialised(wide(per_example[name])) for name in params}
