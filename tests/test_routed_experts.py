"""Fused MoE experts (clipping/experts.py): their per-example gradients come from the routed rule, in factored form,
never from the torch.func fallback. Its algebra against explicit per-example gradients, the rule against one
backward per token, and whole DP steps of Mixtral (each transformers forward: eager, grouped GEMM, batched GEMM)
and GPT-OSS (transposed weights, per-expert biases, its own clamped gate) against the brute-force clipped sum."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping import rules
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.experts import RoutedOuterProductSum, is_routed_experts, routed_experts_rule
from hf_dp.clipping.fallback import ModuleCall
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.row_maps import ExampleRows
from tests import models, oracle
from tests.test_checkpointing import ONE_PROCESS, ZERO2, checkpointed_steps
from tests.test_engine import assert_close
from tests.test_flattened_rows import qwen2_moe


def _explicit(part: RoutedOuterProductSum) -> torch.Tensor:
    """G_i[e] = Σ_p [e_p = e] left_p ⊗ right_p, one pair at a time (a padding pair, expert -1, in none)."""
    batch, pairs = part.expert.shape
    grads = torch.zeros(batch, part.experts, part.left.shape[2], part.right.shape[2], dtype=torch.float64)
    for i in range(batch):
        for p in range(pairs):
            if part.expert[i, p] >= 0:
                grads[i, part.expert[i, p]] += torch.outer(part.left[i, p], part.right[i, p])
    return grads


def _routed(pairs: int, experts: int, seed: int = 0) -> RoutedOuterProductSum:
    """Three examples' pairs, the last two of example 1 padding (zero factors, expert -1)."""
    g = torch.Generator().manual_seed(seed)
    left = torch.randn(3, pairs, 5, generator=g, dtype=torch.float64)
    right = torch.randn(3, pairs, 4, generator=g, dtype=torch.float64)
    expert = torch.randint(0, experts, (3, pairs), generator=g)
    left[1, -2:], right[1, -2:], expert[1, -2:] = 0.0, 0.0, -1
    return RoutedOuterProductSum(left, right, expert, experts)


@pytest.mark.parametrize(("pairs", "experts", "grouped"), [(24, 4, True), (7, 2, False)])
def test_the_routed_sum_s_norm_projection_and_clipped_sum_equal_its_explicit_gradients(
    pairs: int, experts: int, grouped: bool
) -> None:
    """The norm by one Gram per (example, expert) group where that is smaller (E·m² < P²), else by the Gram over an
    example's pairs masked to those sharing an expert; and from the explicit gradients."""
    part = _routed(pairs, experts)
    assert (part.grouped_by_expert() is not None) is grouped
    explicit = _explicit(part)
    squared = explicit.flatten(1).pow(2).sum(1)
    assert part.gram_is_cheaper()
    torch.testing.assert_close(part.squared_norm(False), squared, rtol=1e-12, atol=0)
    torch.testing.assert_close(part.squared_norm(True), squared, rtol=1e-12, atol=0)
    into = torch.ones(3, dtype=torch.float64)
    torch.testing.assert_close(part.squared_norm(False, into=into), 1 + squared, rtol=1e-12, atol=0)
    torch.testing.assert_close(part.explicit(explicit.shape[1:]).grads, explicit, rtol=1e-12, atol=0)
    g = torch.Generator().manual_seed(1)
    direction = torch.randn(explicit.shape[1:], generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        part.project(direction), explicit.flatten(1) @ direction.flatten(), rtol=1e-12, atol=0
    )
    weights = torch.tensor([0.5, 0.0, 2.0], dtype=torch.float64)
    start = torch.ones(explicit.shape[1:], dtype=torch.float64)
    summed = part.accumulate(start.clone(), weights, start)
    torch.testing.assert_close(
        summed, start + torch.einsum("b,bers->ers", weights, explicit), rtol=1e-12, atol=0
    )
    dropped = part.without_examples(torch.tensor([False, True, False]))
    assert (
        dropped.squared_norm(False)[1] == 0 and dropped.squared_norm(False)[0] == part.squared_norm(False)[0]
    )


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_the_rule_equals_one_backward_per_token_with_expert_parallelism_s_sentinel_skipped(
    implementation,
) -> None:
    """Each row its own example: G_r = ∂⟨experts(x_r), ∂y_r⟩/∂W by autograd, one row at a time; a pair routed to the
    sentinel expert E (eager Mixtral skips it) contributes nothing."""
    torch.manual_seed(0)
    dtype = torch.float32 if implementation == "grouped_mm" else torch.float64  # no float64 grouped GEMM
    model = models.mixtral().to(dtype)
    model.config._experts_implementation = implementation
    experts = model.model.layers[0].mlp.experts
    assert is_routed_experts(experts) and rules.call_rule_for(experts) is routed_experts_rule
    tokens, k = 6, 2
    hidden = torch.randn(tokens, 16, dtype=dtype)
    index = torch.stack([torch.randperm(4)[:k] for _ in range(tokens)])
    if implementation == "eager":
        index[2, 1] = experts.num_experts
    weights = torch.rand(tokens, k, dtype=dtype)
    grad_out = torch.randn(tokens, 16, dtype=dtype)
    found = routed_experts_rule(ModuleCall(experts, (hidden, index, weights), {}, [grad_out], tokens))
    tolerance = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    params = [experts.gate_up_proj, experts.down_proj]
    for r in range(tokens):
        out = experts(hidden[r : r + 1], index[r : r + 1], weights[r : r + 1])
        expected = torch.autograd.grad((out * grad_out[r : r + 1]).sum(), params)
        for name, want in zip(("gate_up_proj", "down_proj"), expected, strict=True):
            got = found[name].explicit(want.shape).grads[r]
            torch.testing.assert_close(got, want, **tolerance)


def test_rows_of_several_examples_are_summed_per_example() -> None:
    """Flattened rows (B·T, d) of B examples, row r of example r // T, and routed rows picked in any order."""
    torch.manual_seed(1)
    experts = models.mixtral().double().model.layers[0].mlp.experts
    hidden, index = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 4, (8, 2))
    weights, grad_out = torch.rand(8, 2, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    per_row = routed_experts_rule(ModuleCall(experts, (hidden, index, weights), {}, [grad_out], 8))
    example = torch.tensor([1, 0, 1, 1, 0, 2, 2, 0])
    for rows in (ExampleRows(torch.arange(8) // 4, 2, 4), ExampleRows(example, 3, None)):
        per_example = routed_experts_rule(
            ModuleCall(experts, (hidden, index, weights), {}, [grad_out], rows.rows, rows)
        )
        for name, part in per_example.items():
            shape = getattr(experts, name).shape
            want = rows.sum_per_example(per_row[name].explicit(shape).grads)
            torch.testing.assert_close(part.explicit(shape).grads, want, rtol=1e-12, atol=1e-14)


def gpt_oss() -> nn.Module:
    """GPT-OSS: experts stored transposed (E, in, out) with per-expert biases and an interleaved, clamped gate."""
    config = transformers.GptOssConfig(
        **models.DECODER_SIZES,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"] * 2,
        use_cache=False,
    )
    return transformers.GptOssForCausalLM(config)


def _mixtral(implementation: str):
    def build() -> nn.Module:
        model = models.mixtral()
        model.config._experts_implementation = implementation
        return model

    return build


# name: (builder, dtype): the grouped GEMM takes no float64
MODELS = {
    "mixtral_eager": (_mixtral("eager"), torch.float64),
    "mixtral_batched_mm": (_mixtral("batched_mm"), torch.float64),
    "mixtral_grouped_mm": (_mixtral("grouped_mm"), torch.float32),
    "qwen2_moe": (qwen2_moe, torch.float32),
    "gpt_oss": (gpt_oss, torch.float32),
}


def _moe_off_the_fallback(monkeypatch) -> None:
    """From here on the torch.func fallback fails the test if an MoE layer's experts or router take it."""
    fallback = rules.functorch_per_example_grads

    def refuse_moe(call, *args, **kwargs):
        assert not is_routed_experts(call.module), "the experts took the torch.func fallback"
        assert "Router" not in type(call.module).__name__, "the router took the torch.func fallback"
        return fallback(call, *args, **kwargs)

    monkeypatch.setattr(rules, "functorch_per_example_grads", refuse_moe)


@pytest.mark.parametrize("mode", ["ghost", "per_sample"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_dp_step_with_trained_experts_equals_brute_force_without_the_fallback(
    name, mode, monkeypatch
) -> None:
    """Two steps (the checked first one and a later one), some examples clipped; in ghost mode no expert's
    per-example gradient is ever materialised, and the torch.func fallback never runs for the experts."""
    build, dtype = MODELS[name]
    torch.manual_seed(0)
    model = build().to(dtype).train()
    batch = models.token_batch()
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    reference, _ = oracle.per_example(model, batch, max_norm=norms.median().item())
    _moe_off_the_fallback(monkeypatch)
    if mode == "ghost":
        monkeypatch.setattr(RoutedOuterProductSum, "materialise", lambda *_: pytest.fail("materialised"))
    engine = ClippingEngine(model, mode=mode)
    assert sum(is_routed_experts(m) for m in engine.layers.owned) == 2
    step = clipped_step(engine, model, Backend())
    for ours in checkpointed_steps(model, batch, norms.median().item(), strategy=step, steps=2):
        assert_close(ours, reference, rtol=1e-9 if dtype == torch.float64 else 1e-4, floor=1e-6)


def test_an_eager_experts_forward_not_known_to_be_the_routed_sum_takes_the_fallback() -> None:
    """A model's own eager forward may differ from the routed sum (GPT-OSS's does): only the generic forwards and
    the eager ones tested here take the rule; another eager one keeps the exact torch.func fallback."""
    model = gpt_oss()
    experts = model.model.layers[0].mlp.experts
    assert is_routed_experts(experts)
    model.config._experts_implementation = "eager"
    assert not is_routed_experts(experts) and rules.call_rule_for(experts) is None


@pytest.mark.parametrize("backend", ["one process", "zero2"])
@pytest.mark.parametrize("name", ["mixtral_batched_mm", "gpt_oss"])
def test_a_checkpointed_step_with_trained_experts_equals_brute_force(name, backend, monkeypatch) -> None:
    """The rule inside the backward (the experts' call tapped whole, fallback.py), on one process and through
    ZeRO-2, every example clipped, three steps. The routers cast their logits to float32 (``.float()``), which
    brute force (per example) and the checkpointed weighted pass (on the batch) round differently: 1e-6."""
    build, dtype = MODELS[name]
    torch.manual_seed(0)
    model = build().to(dtype).train()
    batch = models.token_batch()
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    _moe_off_the_fallback(monkeypatch)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, ONE_PROCESS if backend == "one process" else ZERO2)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=3):
        assert_close(ours, reference, rtol=1e-6 if dtype == torch.float64 else 1e-4, floor=1e-6)
