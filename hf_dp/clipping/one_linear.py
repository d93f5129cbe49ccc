"""Modules without a layer rule whose parameters only one ``linear`` call reads: MoE routers (Mixtral, Qwen2-MoE,
GPT-OSS: logits z = x Wᵀ + b, then softmax and top-k of z), and any module built the same way.

Their per-example gradient is a linear layer's, G_i(W) = Σ_t ∂z_t ⊗ x_t and G_i(b) = Σ_t ∂z_t, given the gradient
∂z at the linear call's output. ``one_linear_rule`` re-runs the module's own forward on its recorded inputs with a
``TorchFunctionMode`` that makes that output a leaf, then pulls the gradients of all the module's outputs back to it
(a router's scores are a function of its logits, which it also returns). The torch.func fallback instead
materialises each row's W. A module whose forward reads W otherwise, or calls ``linear`` on it twice, keeps the
fallback (``reads_one_linear`` then says no for it).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from hf_dp.clipping.per_example import linear_parts
from hf_dp.clipping.reads import reads_values

if TYPE_CHECKING:
    from hf_dp.clipping.fallback import ModuleCall
    from hf_dp.clipping.per_example import PerExampleGradient

# modules whose forward turned out to read their weight other than in one linear call: the torch.func fallback
_OTHERWISE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def reads_one_linear(module: nn.Module) -> bool:
    """A module holding a 2-D ``weight`` (and a ``bias``) and no other parameter of its own, not yet found to read
    them otherwise than in one ``linear`` call."""
    own = dict(module.named_parameters(recurse=False))
    weight = own.get("weight")
    return (
        weight is not None
        and weight.dim() == 2
        and set(own) <= {"weight", "bias"}
        and module not in _OTHERWISE
    )


class _LinearOutput(TorchFunctionMode):
    """During the module's forward: the output of ``linear(x, weight, bias)`` made a leaf (``found``: (x, leaf));
    any other read of the weight or bias, or a second such call, sets ``otherwise``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.found: tuple[torch.Tensor, torch.Tensor] | None = None
        self.otherwise = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owned = [
            t for t in tree_leaves((args, kwargs)) if t is self.weight or (t is self.bias and t is not None)
        ]
        if not owned or not reads_values(func):
            return out
        if func is F.linear and self.found is None:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if weight is self.weight and bias is self.bias and x is not weight:
                leaf = out.detach().requires_grad_(True)
                self.found = (x.detach(), leaf)
                return leaf
        self.otherwise = True
        return out


def one_linear_rule(call: ModuleCall) -> dict[str, PerExampleGradient]:
    """G_i(W) = Σ_t ∂z_t ⊗ x_t as a linear layer's factors (∂z: every output's gradient pulled back to the linear
    call's output z), G_i(b) = Σ_t ∂z_t; empty (the torch.func fallback) where the forward reads W otherwise."""
    module, rows = call.module, call.rows
    bias = module.bias if isinstance(getattr(module, "bias", None), nn.Parameter) else None
    watch = _LinearOutput(module.weight, bias)
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in call.args]
    with torch.enable_grad(), watch:
        out = module.forward(*detached, **call.kwargs)
    if watch.otherwise or watch.found is None:
        _OTHERWISE.add(module)
        return {}
    x, leaf = watch.found
    outputs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
    used = [
        (o, g) for o, g in zip(outputs, call.grad_outputs, strict=True) if g is not None and o.requires_grad
    ]
    grads = (
        torch.autograd.grad([o for o, _ in used], leaf, [g for _, g in used], allow_unused=True)[0]
        if used
        else None
    )
    grad_z = torch.zeros_like(leaf) if grads is None else grads
    if rows is not None:
        x, grad_z = rows.as_examples(x, grad_z)
    return linear_parts(x, grad_z, module.weight.shape[0], bias is not None)
