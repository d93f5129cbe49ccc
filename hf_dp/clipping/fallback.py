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

import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers.cache_utils import Cache

from hf_dp.clipping.errors import UnsupportedModuleError
from hf_dp.clipping.per_example import Materialised, PerExampleGradient
from hf_dp.clipping.row_maps import ExampleRows
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


# the kwargs of a transformers cache, its positions and its switch: replayed as absent (``without_cache``)
CACHE_KWARGS = frozenset({"cache", "cache_params", "past_key_values", "past_key_value", "cache_position"})


def without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with no cache: a transformers ``Cache`` (or a kwarg that names one, or its positions) as None and
    ``use_cache`` False. By the time the gradients arrive the forward has written this call's own states into the
    cache, so it cannot be replayed; a training forward starts its cache empty, and an empty cache leaves the
    output unchanged (one that held earlier tokens would fail the first step's check, checks.check_engine_sum)."""

    def dropped(name: str | None, value: object) -> object:
        if isinstance(value, Cache) or (name in CACHE_KWARGS and value is not None):
            return None
        return False if name == "use_cache" and value is not None else value

    return tuple(dropped(None, a) for a in args), {k: dropped(k, v) for k, v in kwargs.items()}


def functorch_per_example_grads(
    call: ModuleCall, param_names: list[str], values: dict[str, torch.Tensor] | None = None
) -> dict[str, PerExampleGradient]:
    """Fallback for modules without a rule: G_i = ∂⟨f(x_i; θ), ∂y_i⟩/∂θ, by vmap over examples (torch.func).

    Exact for any module whose output for example i depends only on example i's inputs: every tensor among its
    arguments (nested in tuples, lists and dicts too) whose first dimension is the batch is split per example, and
    a cache is left out (``without_cache``). An output of k·B rows with k > 1 (a router that flattens its (B, T, d)
    input to B·T tokens) is taken example-major, example i's rows k·i to k·i + k - 1, as a reshape of the module's
    own makes them, checked once per module (``_check_example_major``). With ``call.rows`` the module
    takes flattened tokens (rows.py), so it is vmapped over rows (exact when each output row depends on its input
    row only) and G_i = Σ_(rows r of i) G_r. ``values``: the parameters' values where they are not the module's
    own (peft's LoRA on a parameter: W + s·B A).
    """
    rows = call.rows
    if rows is not None:
        per_row = functorch_per_example_grads(
            replace(call, batch_size=rows.count, rows=None), param_names, values
        )
        return {name: Materialised(rows.sum_per_example(part.grads)) for name, part in per_row.items()}
    module, batch_size = call.module, call.batch_size
    values = values or {}
    # nested names: joined reads
    params = {n: values.get(n, p).detach() for n, p in module.named_parameters() if n in param_names}
    flat, spec = tree_flatten(without_cache(call.args, call.kwargs))
    batched = [
        k
        for k, v in enumerate(flat)
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch_size
    ]
    used = [i for i, g in enumerate(call.grad_outputs) if g is not None]
    cotangents, token_rows = [], set()
    for i in used:  # (B, ...) per example, or k·B rows as (B, k, ...)
        g = call.grad_outputs[i]
        if g.dim() == 0 or g.shape[0] % batch_size:
            raise UnsupportedModuleError(
                f"{type(module).__name__} has no per-example rule and returns an output of {tuple(g.shape)}, whose "
                f"first dimension is not a multiple of the batch ({batch_size}), so the torch.func fallback cannot "
                "tell its examples apart: register a rule for it (docs/clipping.md), or freeze it"
            )
        if g.shape[0] > batch_size:
            token_rows.add(i)
        cotangents.append(g.reshape(batch_size, -1, *g.shape[1:]) if i in token_rows else g)

    def outputs(p: dict, example_leaves: list | None) -> list[torch.Tensor]:
        """The call's tensor outputs, as tap_call numbers them: of one example's inputs, or (None) the batch's."""
        leaves = list(flat)
        for k, leaf in zip(batched, example_leaves or [], strict=False):
            leaves[k] = leaf.unsqueeze(0)
        call_args, call_kwargs = tree_unflatten(leaves, spec)
        out = functional_call(module, p, tuple(call_args), call_kwargs, strict=False)
        return [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]

    if token_rows and module not in _EXAMPLE_MAJOR:
        _check_example_major(module, token_rows, batch_size, outputs, params, [flat[k] for k in batched])

    def objective(p: dict, example_leaves: list, example_cotangents: list) -> torch.Tensor:
        outs = outputs(p, example_leaves)
        total = 0
        for i, c in zip(used, example_cotangents, strict=True):
            c = c if i in token_rows else c.unsqueeze(0)
            total = total + (outs[i] * c.to(outs[i].dtype)).sum()
        return total

    per_example = vmap(grad(objective), in_dims=(None, 0, 0))(params, [flat[k] for k in batched], cotangents)
    return {name: Materialised(wide(per_example[name])) for name in params}


# the modules whose k·B output rows were found example-major (``_check_example_major``), once each
_EXAMPLE_MAJOR: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _check_example_major(
    module: nn.Module,
    token_rows: set[int],
    batch_size: int,
    outputs: Callable[[dict, list | None], list[torch.Tensor]],
    params: dict[str, torch.Tensor],
    example_leaves: list[torch.Tensor],
) -> None:
    """The fallback credits rows k·i .. k·i + k − 1 of an output of k·B rows to example i: checked once per module
    (one batch forward and one per-example forward of it, without grad) against the module run on each example
    alone, so that a module ordering its rows otherwise (time-major) is refused on every backend, also where the first
    step's check does not run (FSDP2)."""
    with torch.no_grad():
        whole = outputs(params, None)
        alone = vmap(lambda leaves: outputs(params, leaves))(example_leaves)
    for i in sorted(token_rows):
        ours, theirs = whole[i].reshape(batch_size, -1, *whole[i].shape[1:]), alone[i]
        tolerance = 1e-5 if ours.dtype in (torch.float32, torch.float64) else 2e-2
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=tolerance, atol=tolerance):
            raise UnsupportedModuleError(
                f"{type(module).__name__} has no per-example rule and returns {tuple(whole[i].shape)}, whose rows "
                f"k·i .. k·i + k − 1 are not example i's own (they are not example-major), so the torch.func fallback "
                "cannot credit them: register a rule for it (docs/clipping.md), or freeze it"
            )
    _EXAMPLE_MAJOR[module] = True
