"""Fused MoE experts: per-example gradients of 3-D expert weights in factored form, without the torch.func fallback.

An experts module (transformers' ``@use_experts_implementation``: Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, …) holds
every expert's weights in one tensor, W_up (E, out, in) and W_down (E, in', out'), and routes each token t to k
experts e_tk with weights w_tk: y_t = Σ_k w_tk · W_down[e] act(W_up[e] x_t). Each routed pair p = (t, k) is a
linear use of one expert's slice, so

    G_i(W_up)[e] = Σ_{p of example i, e_p = e} δ_p ⊗ x_p,   ‖G_i(W_up)‖² = Σ_{p,p'} [e_p = e_p'] ⟨δ_p, δ_p'⟩⟨x_p, x_p'⟩

(the ghost norm of Li et al. 2022 restricted to pairs that share an expert), with δ_p the gradient at the pair's
up-projection output, obtained from the gradient at the module's output by the pair's own backward through its
down projection and gate. The fallback instead materialises B·T·k per-row copies of all E experts' weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hf_dp.clipping.per_example import (
    MATERIALISE_OVERHEAD_STEPS,
    Folded,
    Like,
    Materialised,
    OuterProductSum,
    Zeroed,
    example_chunks,
)
from hf_dp.clipping.row_maps import ExampleRows
from hf_dp.clipping.wide_gemm import LOW_PRECISION, dots, gram, wide, wide_bmm

if TYPE_CHECKING:
    from hf_dp.clipping.fallback import ModuleCall
    from hf_dp.clipping.geometry import ClipScale
    from hf_dp.clipping.per_example import PerExampleGradient

# transformers' expert forwards that compute exactly the routed sum above from the decorator's layout flags
_GENERIC_FORWARDS = ("grouped_mm", "batched_mm")
# experts classes whose own (eager) forward is that routed sum too, each tested against brute force
_EAGER_ROUTED_SUM = ("MixtralExperts", "Qwen2MoeExperts")


@dataclass
class RoutedOuterProductSum:
    """G_i[e] = Σ_{p of example i with expert_p = e} left_p ⊗ right_p, shaped (experts, rows, cols) like a fused
    expert weight (``experts_last``: (rows, cols, experts)); left (B, P, rows), right (B, P, cols) and expert (B, P)
    per routed pair (pairs that pad an example's, as ``ExampleRows.as_examples`` lays them out, have zero factors
    and expert -1)."""

    left: torch.Tensor
    right: torch.Tensor
    expert: torch.Tensor
    experts: int
    experts_last: bool = False  # the parameter is laid out (rows, cols, experts): peft's LoRA B of experts

    @property
    def batch_size(self) -> int:
        return self.right.shape[0]

    def gram_is_cheaper(self, steps: int | None = None) -> bool:
        """A Gram over ``steps`` pair products per example (P² masked, E·m² grouped by expert) costs steps·(rows +
        cols); materialising E blocks about (P + 256·E)·rows·cols (``OuterProductSum.gram_is_cheaper``'s costs, with
        every expert's block written and read back)."""
        rows, cols, pairs = self.left.shape[2], self.right.shape[2], self.left.shape[1]
        steps = pairs * pairs if steps is None else steps
        return steps * (rows + cols) <= (pairs + MATERIALISE_OVERHEAD_STEPS * self.experts) * rows * cols

    def grouped_by_expert(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each example's pairs grouped by expert, (B·E, m, rows) and (B·E, m, cols) with m the fullest group's size
        (one host read), where that Gram, E·m² products per example, is smaller than the masked one's P²; else None."""
        batch, pairs = self.expert.shape
        offset = torch.arange(batch, device=self.expert.device)[:, None] * self.experts
        valid = (self.expert >= 0).flatten()
        group = (self.expert + offset).flatten()[valid]
        sizes = torch.bincount(group, minlength=batch * self.experts)
        widest = int(sizes.max()) if group.numel() else 0
        if self.experts * widest * widest >= pairs * pairs:
            return None
        groups = ExampleRows(group, batch * self.experts, None)
        left, right = groups.as_examples(self.left.flatten(0, 1)[valid], self.right.flatten(0, 1)[valid])
        return left, right

    def squared_norm(self, materialise: bool, into: torch.Tensor | None = None) -> torch.Tensor:
        """‖G_i‖² per example: Σ_{p,p'} [e_p = e_p'] ⟨left_p, left_p'⟩⟨right_p, right_p'⟩, by one Gram per (example,
        expert) group of pairs or a Gram over all of an example's pairs masked to those sharing an expert, whichever
        is smaller; or from the explicit G_i."""
        grouped = None if materialise else self.grouped_by_expert()
        steps = None if grouped is None else self.experts * grouped[0].shape[1] ** 2
        if grouped is not None and self.gram_is_cheaper(steps):
            left, right = grouped
            squared = (
                dots(gram(left, left), gram(right, right)).view(self.batch_size, self.experts).sum(dim=1)
            )
            return squared if into is None else into.add_(squared.to(into))
        if materialise or not self.gram_is_cheaper():
            floats = self.experts * self.left.shape[2] * self.right.shape[2]
            norms = [
                dots(grads, grads, None if into is None else into[a:b])
                for a, b in example_chunks(self.batch_size, floats)
                for grads in (self.materialise(a, b),)
            ]
            return into if into is not None else torch.cat(norms)
        left = gram(self.left, self.left)
        same = self.expert[:, :, None] == self.expert[:, None, :]
        return dots(left * same.to(left.dtype), gram(self.right, self.right), into)

    def materialise(self, start: int, stop: int) -> torch.Tensor:
        """The explicit per-example gradients (stop − start, experts, rows, cols), float32 or wider."""
        left, right, expert = self.left[start:stop], self.right[start:stop], self.expert[start:stop]
        grads = torch.stack(
            [
                wide_bmm(left.mul((expert == e)[:, :, None]).transpose(1, 2), right)
                for e in range(self.experts)
            ],
            1,
        )
        return grads.permute(0, 2, 3, 1) if self.experts_last else grads

    def explicit(self, shape: torch.Size) -> Materialised:
        """All B explicit per-example gradients, shaped (B, *shape)."""
        return Materialised(self.materialise(0, self.batch_size).reshape(-1, *shape))

    def scaled(self, scale: ClipScale) -> None:
        """A clip geometry on a 3-D weight is dense: the norm needs the explicit G_i (None)."""
        return None

    def without_examples(self, drop: torch.Tensor, zeroed: Zeroed | None = None) -> RoutedOuterProductSum:
        """The same sum with G_i = 0 for the examples in ``drop`` (B,), bool (``zeroed`` unused: the pairs' rows
        are the rule's own)."""
        mask = drop[:, None, None]
        left, right = self.left.masked_fill(mask, 0.0), self.right.masked_fill(mask, 0.0)
        return RoutedOuterProductSum(left, right, self.expert, self.experts, self.experts_last)

    def project(self, direction: torch.Tensor) -> torch.Tensor:
        """⟨G_i, V⟩ = Σ_p left_pᵀ V[e_p] right_p per example, V shaped (experts, rows, cols)."""
        right = wide(self.right)
        rows, cols = self.left.shape[2], right.shape[2]
        v = direction.reshape(rows, cols, -1).permute(2, 0, 1) if self.experts_last else direction
        v = v.reshape(self.experts, rows, cols).to(right)
        left = wide(self.left)
        total = right.new_zeros(self.batch_size)
        for e in range(self.experts):
            total += ((left @ v[e]) * right).sum(dim=2).mul((self.expert == e).to(right.dtype)).sum(dim=1)
        return total

    def accumulate(
        self,
        grad: torch.Tensor | None,
        weights: torch.Tensor,
        like: torch.Tensor | Like,
        folded: Folded | None = None,
    ) -> torch.Tensor:
        """grad + Σ_i w_i G_i (grad None: a fresh tensor shaped like ``like``): the pairs sorted by expert (one host
        read of the per-expert counts) and one GEMM per expert on its own pairs, w folded into the right side, in
        float32 or wider (``folded`` unused: no two uses share a scaled side)."""
        rows, cols = self.left.shape[2], self.right.shape[2]
        right = wide(self.right)
        right = right * weights.to(right.dtype)[:, None, None]
        left = wide(self.left).to(right.dtype).reshape(-1, rows)
        right, expert = right.reshape(-1, cols), self.expert.reshape(-1)
        order = torch.argsort(expert, stable=True)
        expert = expert.clamp(min=0)  # padding pairs: zero factors, any expert
        counts = torch.bincount(expert, minlength=self.experts).tolist()
        target = torch.zeros((self.experts, rows, cols), dtype=right.dtype, device=right.device)
        for e, (a, b) in enumerate(zip(left[order].split(counts), right[order].split(counts), strict=True)):
            if a.shape[0]:
                target[e].addmm_(a.T, b)
        fresh = (target.permute(1, 2, 0) if self.experts_last else target).reshape(like.shape).to(like.dtype)
        return fresh if grad is None else grad.add_(fresh)


def is_routed_experts(module: nn.Module) -> bool:
    """A transformers experts module (``@use_experts_implementation``) whose forward is the routed sum this rule
    differentiates: a generic implementation, or an eager one tested to be it; no expert parallelism, no norm
    after each expert."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "has_gate") or not hasattr(module, "num_experts"):
        return False
    implementation = getattr(config, "_experts_implementation", None)
    known = implementation in _GENERIC_FORWARDS or (
        implementation == "eager" and type(module).__name__ in _EAGER_ROUTED_SUM
    )
    up = _up_name(module)
    layout = [up, "down_proj", *([f"{up}_bias", "down_proj_bias"] if module.has_bias else [])]
    params = dict(module.named_parameters(recurse=False))
    return (
        known
        and not module.has_post_expert_norm
        and not getattr(module, "_is_expert_parallel", False)
        and sorted(params) == sorted(layout)
        and params[up].dim() == 3
        and params["down_proj"].dim() == 3
    )


def _up_name(module: nn.Module) -> str:
    """The up projection's parameter: ``gate_up_proj`` (gate and up fused) or ``up_proj`` (no gate)."""
    return "gate_up_proj" if module.has_gate else "up_proj"


def _call_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden_states (N, d), top_k_index (N, k), top_k_weights (N, k)) of an experts call."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs[name] for name in names[len(args) :]]
    return values[0], values[1], values[2]


def _linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x Wᵀ for an expert's (out, in) slice, x W for a transposed (in, out) one."""
    return x @ weight if transposed else F.linear(x, weight)


def _pair_gradients(
    module: nn.Module,
    values: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    grad_out: torch.Tensor,
    token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per routed pair p = (t, k), flattened t-major: (δ_p at the up projection's output, the down projection's
    input a_p, its output's gradient w_p ∂y_t, and the valid-pair mask), each pair back-propagated through its own
    expert's slice (of ``values``, the module's parameters by name), gate and routing weight as the forward computed
    them (a bf16/fp16 ∂y: in that precision); ``token``: each pair's row."""
    count, k = index.shape
    dtype = grad_out.dtype if grad_out.dtype in LOW_PRECISION else hidden.dtype
    name = _up_name(module)
    up, up_bias, down_weight = values[name], values.get(f"{name}_bias"), values["down_proj"]
    expert = index.reshape(-1)
    d_out = (grad_out[token] * weights.reshape(-1, 1).to(grad_out.dtype)).to(dtype)
    valid = expert < module.num_experts  # expert parallelism's sentinel: no expert here
    d_up = d_out.new_zeros(count * k, up.shape[2] if module.is_transposed else up.shape[1])
    acts = d_out.new_zeros(count * k, down_weight.shape[1] if module.is_transposed else down_weight.shape[2])
    x = hidden.detach().to(dtype)
    # the pairs grouped by expert (the sentinel's last), each group's size in one host read
    order = torch.argsort(expert, stable=True)
    sizes = torch.bincount(expert[valid], minlength=module.num_experts).tolist()
    for e, pairs in enumerate(order[: sum(sizes)].split(sizes)):
        if not pairs.numel():
            continue
        with torch.enable_grad():
            h = _linear(x[token[pairs]], up[e].detach().to(dtype), module.is_transposed)
            if up_bias is not None:
                h = h + up_bias[e].detach().to(dtype)
            h = h.detach().requires_grad_(True)
            a = module._apply_gate(h) if module.has_gate else module.act_fn(h)
            down = down_weight[e].detach().to(dtype)
            d_a = d_out[pairs] @ (down.T if module.is_transposed else down)
            (d_h,) = torch.autograd.grad(a, h, d_a.to(a.dtype))
        d_up[pairs], acts[pairs] = d_h.to(dtype), a.detach().to(dtype)
    return d_up, acts, d_out, valid


def routed_experts_rule(
    call: ModuleCall, values: dict[str, torch.Tensor] | None = None
) -> dict[str, PerExampleGradient]:
    """G_i of the up (gate_up) and down projections as routed outer-product sums, of their per-expert biases as
    one-hot sums over the experts (an embedding's form): G_i(b_down)[e] = Σ_{p of i, e_p = e} w_p ∂y_p; at the
    parameters' ``values`` where given (peft's LoRA on them: W + s·B A), else at the module's own."""
    module, rows, batch_size = call.module, call.rows, call.batch_size
    hidden, index, weights = _call_inputs(call.args, call.kwargs)
    grad_out = call.grad_outputs[0] if call.grad_outputs[0] is not None else torch.zeros_like(hidden)
    own = {name: param.detach() for name, param in module.named_parameters(recurse=False)}
    k = index.shape[1]
    token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(k)
    d_up, acts, d_out, valid = _pair_gradients(
        module, own | (values or {}), hidden, index, weights, grad_out, token
    )
    example = token if rows is None else rows.example[token]
    per_example = None if rows is None or rows.per_example is None else rows.per_example * k
    pairs = ExampleRows(example, batch_size, k if rows is None else per_example)
    x = hidden.detach().to(d_up.dtype)[token]
    expert = index.reshape(-1).masked_fill(~valid, -1)
    d_up, acts, d_out, x = (t.masked_fill(~valid[:, None], 0.0) for t in (d_up, acts, d_out, x))
    d_up, acts, d_out, x, shifted = pairs.as_examples(d_up, acts, d_out, x, expert + 1)
    expert = shifted - 1  # the pairs that pad an example's (zeros) and the sentinel's: -1
    experts, up = module.num_experts, _up_name(module)
    if module.is_transposed:  # W (E, in, out): G[e] = Σ input ⊗ output gradient
        found = {
            up: RoutedOuterProductSum(x, d_up, expert, experts),
            "down_proj": RoutedOuterProductSum(acts, d_out, expert, experts),
        }
    else:
        found = {
            up: RoutedOuterProductSum(d_up, x, expert, experts),
            "down_proj": RoutedOuterProductSum(d_out, acts, expert, experts),
        }
    if module.has_bias:
        ids = expert.clamp(min=0)  # the padding pairs' factors are zero
        found[f"{up}_bias"] = OuterProductSum(ids, d_up, experts)
        found["down_proj_bias"] = OuterProductSum(ids, d_out, experts)
    return found
