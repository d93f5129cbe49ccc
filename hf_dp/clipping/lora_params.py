"""peft's LoRA on a parameter (``target_parameters``: MoE experts' fused weights, an MoE router's weight).

A ``ParamWrapper`` re-parametrises the wrapped module's parameter as W' = W + s·L_e R_e per expert e (L (d0, r),
R (r, d1) from its adapters' weights, ``get_delta_factors``) for the duration of the wrapped call, reading its
adapters' weights itself: nothing calls their modules. The wrapper's call covers them: G_i(W') of the wrapped module
at W' (the routed rule for fused experts, in factored form; the torch.func fallback for anything else), then the
chain rule G_i(L_e) = s G_i(W')[e] R_eᵀ and G_i(R_e) = s L_eᵀ G_i(W')[e] (Hu et al. 2021), laid out as peft stores
them: A (E·r, in), B (out, r·E).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_dp.clipping.errors import UnsupportedModuleError
from hf_dp.clipping.experts import RoutedOuterProductSum, is_routed_experts, routed_experts_rule
from hf_dp.clipping.fallback import functorch_per_example_grads
from hf_dp.clipping.per_example import Materialised
from hf_dp.clipping.wide_gemm import wide

if TYPE_CHECKING:
    from hf_dp.clipping.fallback import ModuleCall
    from hf_dp.clipping.per_example import PerExampleGradient


def claims_nested(module: nn.Module) -> bool:
    """A module whose forward reads its submodules' parameters itself rather than calling them: peft's LoRA on a
    parameter (a ``ParamWrapper``). Its call covers them (hooks.assign_parameters)."""
    return (
        type(module).__name__ == "ParamWrapper"
        and hasattr(module, "parameter_name")
        and hasattr(module, "lora_A")
    )


def wrapped(wrapper: nn.Module) -> nn.Module:
    """The module a chain of wrappers re-parametrises."""
    return _chain(wrapper)[1]


def wraps_fallback(module: nn.Module) -> bool:
    """A wrapper whose wrapped module's G_i(W') comes from the torch.func fallback (anything but fused experts)."""
    return claims_nested(module) and not is_routed_experts(wrapped(module))


def _chain(wrapper: nn.Module) -> tuple[list[tuple[str, nn.Module]], nn.Module, str]:
    """The wrappers from the outermost in, each with its name prefix, the wrapped module and its prefix."""
    wrappers, module, prefix = [], wrapper, ""
    while claims_nested(module):
        wrappers.append((prefix, module))
        module, prefix = module.base_layer, f"{prefix}base_layer."
    return wrappers, module, prefix


def _adapter(wrapper: nn.Module) -> str:
    """The one active adapter of a wrapper (peft refuses a LoRA bias, DoRA and dropout on one), refused in one line
    otherwise."""
    active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(active) != 1 or wrapper.merged or wrapper.disable_adapters:
        raise UnsupportedModuleError(
            f"peft's LoRA on {wrapper.parameter_name} has {len(active)} active adapters (merged: {wrapper.merged}, "
            f"disabled: {wrapper.disable_adapters}): train exactly one active, unmerged adapter"
        )
    return active[0]


def _factors(wrapper: nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(L (E, d0, r), R (E, r, d1), s) with W' = W + s·L_e R_e, detached (E = 1 for a 2-D parameter)."""
    if wrapper.num_experts == 1:
        a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
        return b.detach()[None], a.detach()[None], wrapper.scaling[adapter]
    with torch.no_grad():
        return wrapper.get_delta_factors(adapter)


def _per_pair(factor: torch.Tensor, along: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """factor_{e_p} along_p per pair: (B, P, d) @ factor (E, d, r) gathered at each pair's expert, (B, P, r)."""
    experts, d, r = factor.shape
    every = wide(along) @ factor.to(wide(along).dtype).permute(1, 0, 2).reshape(d, experts * r)
    expert = expert.clamp(min=0)  # a padding pair (-1) has zero factors
    return every.view(*along.shape[:2], experts, r).gather(2, expert[:, :, None, None].expand(-1, -1, 1, r))[
        :, :, 0
    ]


def _lora_parts(
    part: PerExampleGradient, lhs: torch.Tensor, rhs: torch.Tensor, scaling: float, swapped: bool
) -> tuple[PerExampleGradient, PerExampleGradient]:
    """(G_i(A), G_i(B)) in peft's layouts from G_i(W') of W' = W + s·L_e R_e: L = B_e, R = A_e where peft swapped
    in and out (W (E, out, in), and every 2-D W), else L = A_eᵀ, R = B_eᵀ (W (E, in, out))."""
    experts, rank = lhs.shape[0], lhs.shape[2]
    if isinstance(part, RoutedOuterProductSum):
        left, right, expert = part.left, part.right, part.expert
        g_lhs = (
            left,
            scaling * _per_pair(rhs.transpose(1, 2), right, expert),
        )  # Σ L_p ⊗ s·R_e right_p: (E, d0, r)
        g_rhs = (scaling * _per_pair(lhs, left, expert), right)  # Σ s·L_eᵀ left_p ⊗ right_p: (E, r, d1)
        if swapped:
            return (
                RoutedOuterProductSum(*g_rhs, expert, experts),
                RoutedOuterProductSum(*g_lhs, expert, experts, experts_last=True),
            )
        return (
            RoutedOuterProductSum(g_lhs[1], g_lhs[0], expert, experts),
            RoutedOuterProductSum(g_rhs[1], g_rhs[0], expert, experts, experts_last=True),
        )
    grads = part.grads.reshape(part.grads.shape[0], experts, lhs.shape[1], rhs.shape[2])  # (B, E, d0, d1)
    g_lhs = scaling * torch.einsum("beij,erj->beir", grads, rhs.to(grads))  # (B, E, d0, r)
    g_rhs = scaling * torch.einsum("beij,eir->berj", grads, lhs.to(grads))  # (B, E, r, d1)
    batch = grads.shape[0]
    if swapped:  # A (E·r, d1) = R; B (d0, r·E): B[o, j·E + e] = L_e[o, j]
        return Materialised(g_rhs.reshape(batch, experts * rank, -1)), Materialised(
            g_lhs.permute(0, 2, 3, 1).reshape(batch, -1, rank * experts)
        )
    # A (E·r, d0) = Lᵀ; B (d1, r·E): B[o, j·E + e] = R_e[j, o]
    return Materialised(g_lhs.transpose(2, 3).reshape(batch, experts * rank, -1)), Materialised(
        g_rhs.permute(0, 3, 2, 1).reshape(batch, -1, rank * experts)
    )


def parameter_lora_rule(call: ModuleCall) -> dict[str, PerExampleGradient]:
    """Per-example gradients of every adapter in a chain of ``ParamWrapper``s (and of the wrapped module's own
    trained parameters), from G_i(W') of the wrapped module at its re-parametrised values W'."""
    wrappers, base, base_prefix = _chain(call.module)
    values = {name: param.detach() for name, param in base.named_parameters(recurse=False)}
    adapters = []
    for prefix, inner in wrappers:
        adapter = _adapter(inner)
        lhs, rhs, scaling = _factors(inner, adapter)
        name = inner.parameter_name
        delta = scaling * torch.bmm(lhs, rhs.to(lhs))
        values[name] = values[name] + delta.reshape(values[name].shape).to(values[name])
        # a 2-D weight's B A is B_e A_e with E = 1, the layout peft swaps in and out for
        swapped = getattr(inner, "_did_swap_in_out_features", True) or lhs.shape[0] == 1
        adapters.append((prefix, adapter, name, lhs, rhs, scaling, swapped))
    wrapped_call = replace(call, module=base)
    if is_routed_experts(base):
        at_values = routed_experts_rule(wrapped_call, values)
    else:  # only W' of the adapted parameters and the module's own trained ones
        trained = [name for name, param in base.named_parameters(recurse=False) if param.requires_grad]
        needed = sorted({inner.parameter_name for _, inner in wrappers} | set(trained))
        at_values = functorch_per_example_grads(wrapped_call, needed, values)
    found: dict[str, PerExampleGradient] = {f"{base_prefix}{name}": part for name, part in at_values.items()}
    for prefix, adapter, name, lhs, rhs, scaling, swapped in adapters:
        a, b = _lora_parts(at_values[name], lhs, rhs, scaling, swapped)
        found[f"{prefix}lora_A.{adapter}.weight"], found[f"{prefix}lora_B.{adapter}.weight"] = a, b
    return found
