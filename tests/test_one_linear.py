"""Modules without a layer rule whose parameters one ``linear`` call reads (clipping/one_linear.py): MoE routers and
modules built like them. The rule against one backward per example, through a softmax and top-k after the linear
call and with the logits also returned; a forward that reads its weight otherwise keeps the torch.func fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_dp.clipping import one_linear, rules
from hf_dp.clipping.fallback import ModuleCall
from hf_dp.clipping.one_linear import one_linear_rule, reads_one_linear
from hf_dp.clipping.row_maps import ExampleRows


class Router(nn.Module):
    """A router as transformers writes one: logits, their softmax's top-k renormalised, all three returned."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(4, dtype=torch.float64)) if bias else None

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight, self.bias)
        top, index = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index


class ReadsTwice(Router):
    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight) + F.linear(x.tanh(), self.weight)


class ReadsByMatmul(Router):
    def forward(self, x: torch.Tensor):
        return x @ self.weight.T


def _per_example(module: nn.Module, x: torch.Tensor, grads: list) -> dict[str, torch.Tensor]:
    """One backward per example (its rows of x): ∂⟨outputs_i, grads_i⟩/∂θ."""
    params = dict(module.named_parameters())
    found: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for i in range(x.shape[0]):
        outputs = [o for o in module(x[i : i + 1]) if o.is_floating_point()]
        total = sum((o * g[i : i + 1]).sum() for o, g in zip(outputs, grads, strict=False) if g is not None)
        for name, grad in zip(params, torch.autograd.grad(total, list(params.values())), strict=True):
            found[name].append(grad)
    return {name: torch.stack(grads) for name, grads in found.items()}


@pytest.mark.parametrize("bias", [False, True])
def test_the_rule_equals_one_backward_per_example_through_softmax_and_top_k(bias: bool) -> None:
    torch.manual_seed(0)
    router = Router(bias)
    assert reads_one_linear(router) and rules.call_rule_for(router) is one_linear_rule
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    grads = [torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 2, dtype=torch.float64), None]
    found = one_linear_rule(ModuleCall(router, (x,), {}, grads, 3))
    for name, want in _per_example(router, x, grads).items():
        got = found[name].explicit(getattr(router, name).shape).grads
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_flattened_rows_are_summed_per_example() -> None:
    """Rows (N, d) of examples picked in any order: each example's gradient is the sum of its rows'."""
    torch.manual_seed(1)
    router = Router(bias=True)
    x = torch.randn(7, 6, dtype=torch.float64)
    grads = [torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64), None]
    per_row = one_linear_rule(ModuleCall(router, (x,), {}, grads, 7))
    rows = ExampleRows(torch.tensor([2, 0, 2, 1, 0, 2, 1]), 3, None)
    per_example = one_linear_rule(ModuleCall(router, (x,), {}, grads, 3, rows))
    for name, part in per_example.items():
        shape = getattr(router, name).shape
        want = rows.sum_per_example(per_row[name].explicit(shape).grads)
        torch.testing.assert_close(part.explicit(shape).grads, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("module_class", [ReadsTwice, ReadsByMatmul])
def test_a_forward_that_reads_its_weight_otherwise_keeps_the_fallback(module_class) -> None:
    """The rule covers nothing (the dispatch then takes the torch.func fallback) and the module is not offered to
    it again; the fallback's per-example gradients equal one backward per example."""
    torch.manual_seed(2)
    module = module_class(bias=False)
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    grads = [torch.randn(3, 5, 4, dtype=torch.float64)]
    assert one_linear_rule(ModuleCall(module, (x,), {}, grads, 3)) == {}
    assert not reads_one_linear(module) and module in one_linear._OTHERWISE
    found = rules.per_call_grads(ModuleCall(module, (x,), {}, grads, 3), ["weight"])
    expected = torch.stack(
        [
            torch.autograd.grad((module(x[i : i + 1]) * grads[0][i : i + 1]).sum(), module.weight)[0]
            for i in range(3)
        ]
    )
    torch.testing.assert_close(found["weight"].grads, expected, rtol=1e-12, atol=1e-14)
