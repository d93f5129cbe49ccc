"""Clip geometries and combined evaluations against brute force (one backward per example and point).

The engine clips u_i = Σ_e w_e ∇L_i(θ + shift_e) once, by ‖s ⊙ u_i‖ (dense or rank-1 scale s), and adds the
UN-scaled Σ_i c_i u_i to ``.grad``; ``oracle.per_example`` does the same with per-example autograd.
"""

from __future__ import annotations

import pytest
import torch

from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.geometry import FactoredScale
from hf_dp.losses import per_example_loss
from tests import models, oracle
from tests.engine_steps import clip_and_accumulate, clipped_backward

MODELS = {
    "gpt2_tied": (models.gpt2, lambda: models.token_batch()),
    "bert_classifier": (models.bert_classifier, lambda: models.classification_batch(3)),
    "llama": (models.llama, lambda: models.token_batch()),
    "gpt2_lora": (models.gpt2_lora, lambda: models.token_batch()),
}
MASK = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def dense_scales(model: torch.nn.Module) -> dict:
    return {p: torch.rand_like(p) * 1.5 + 0.25 for p in trainable(model)}


def factored_scales(model: torch.nn.Module) -> dict:
    """Rank-1 scales for matrices (Linear (out, in), Conv1D (in, out), Embedding), dense for vectors."""
    return {
        p: FactoredScale(torch.rand(p.shape[0]).double() + 0.25, torch.rand(p.shape[1]).double() + 0.25)
        if p.dim() == 2
        else torch.rand_like(p) + 0.25
        for p in trainable(model)
    }


def shifted(model: torch.nn.Module, weight: float, size: float = 0.05) -> tuple:
    """DiSK-style evaluations: weight c at θ + shift, 1 − c at θ."""
    return ((weight, {p: size * torch.randn_like(p) for p in trainable(model)}), (1.0 - weight, None))


def engine_combined(
    model, batch, max_norm, evaluations, scale=None, clipping_fn="abadi", mask=None, mode="ghost"
):
    """The trainer's DiSK micro-step: one forward + per_example_gradients per point, then one clip."""
    engine = ClippingEngine(model, clipping_fn=clipping_fn, mode=mode)
    model.zero_grad(set_to_none=True)
    gradients = []
    for weight, shift in evaluations:
        saved = {p: p.detach().clone() for p in (shift or {})}
        with torch.no_grad():
            for p, delta in (shift or {}).items():
                p.add_(delta)
        with engine.record(batch["input_ids"].shape[0]):
            losses = per_example_loss(model, batch)
        gradients.append((engine.per_example_gradients(losses, verify=True), weight))
        with torch.no_grad():
            for p, value in saved.items():
                p.copy_(value)
    norms = clip_and_accumulate(engine, gradients, max_norm, mask, clip_scale=scale)
    engine.remove_hooks()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}, norms.double()


def assert_matches_brute_force(
    model, batch, evaluations, scale=None, clipping_fn="abadi", mask=None, mode="ghost"
):
    _, free_norms = engine_combined(model, batch, 1e12, evaluations, scale)
    max_norm = 0.5 * free_norms.median().item()  # clipping active for about half the examples
    reference, ref_norms = oracle.per_example(
        model, batch, max_norm, evaluations=evaluations, scale=scale, clipping_fn=clipping_fn, mask=mask
    )
    ours, norms = engine_combined(model, batch, max_norm, evaluations, scale, clipping_fn, mask, mode)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-10, atol=0)
    largest = max(r.norm().item() for r in reference.values())
    for name, ref in reference.items():
        error = (ours[name] - ref).norm().item()
        assert error <= 1e-9 * max(ref.norm().item(), 1e-6 * largest), f"{name}: error {error:.3g}"


def build(name: str):
    make_model, make_batch = MODELS[name]
    return make_model().double().eval(), make_batch()


@pytest.mark.parametrize("geometry", ["dense", "factored"])
@pytest.mark.parametrize("name", list(MODELS))
def test_scaled_clipping_matches_brute_force(name: str, geometry: str) -> None:
    model, batch = build(name)
    scale = dense_scales(model) if geometry == "dense" else factored_scales(model)
    assert_matches_brute_force(model, batch, ((1.0, None),), scale)


@pytest.mark.parametrize("clipping_fn", ["abadi", "automatic"])
@pytest.mark.parametrize("name", list(MODELS))
def test_two_evaluations_match_brute_force(name: str, clipping_fn: str) -> None:
    """DiSK's u_i = c·∇L_i(θ + γd) + (1 − c)·∇L_i(θ) at (κ, γ) = (0.7, 0.5), tied cross terms across points."""
    model, batch = build(name)
    assert_matches_brute_force(model, batch, shifted(model, 6 / 7), clipping_fn=clipping_fn, mask=MASK)


@pytest.mark.parametrize("mode", ["ghost", "per_sample"])
@pytest.mark.parametrize("geometry", ["dense", "factored"])
@pytest.mark.parametrize("name", ["gpt2_tied", "bert_classifier"])
def test_scale_and_two_evaluations_together(name: str, geometry: str, mode: str) -> None:
    """γ = −1 at κ = 0.7 gives c = −0.4286: a negative weight, in a scaled geometry."""
    model, batch = build(name)
    scale = dense_scales(model) if geometry == "dense" else factored_scales(model)
    assert_matches_brute_force(model, batch, shifted(model, -3 / 7), scale, "automatic", MASK, mode)


def test_clipped_backward_takes_norm_and_scale() -> None:
    model, batch = build("gpt2_tied")
    scale = factored_scales(model)
    reference, ref_norms = oracle.per_example(model, batch, 0.05, scale=scale)
    engine = ClippingEngine(model)
    with engine.record(5):
        losses = per_example_loss(model, batch)
    norms = clipped_backward(engine, losses, 0.05, verify=True, clip_scale=scale)
    torch.testing.assert_close(norms.double(), ref_norms, rtol=1e-10, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-9, atol=1e-15)


def test_plain_path_is_one_evaluation_of_weight_one() -> None:
    model, batch = build("gpt2_tied")
    engine = ClippingEngine(model)
    with engine.record(5):
        losses = per_example_loss(model, batch)
    norms = clipped_backward(engine, losses, 0.1)
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with engine.record(5):
        losses = per_example_loss(model, batch)
    gradients = engine.per_example_gradients(losses)
    assert torch.equal(clip_and_accumulate(engine, [(gradients, 1.0)], 0.1), norms)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, plain[name]), name


def per_example_grads(model, batch, shift=None) -> list[torch.Tensor]:
    """Flattened ∇L_i(θ + shift) for each example, by autograd on the example alone."""
    params = trainable(model)
    with torch.no_grad():
        for p, delta in (shift or {}).items():
            p.add_(delta)
    rows = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        rows.append(
            torch.cat([g.flatten() for g in torch.autograd.grad(per_example_loss(model, one)[0], params)])
        )
    with torch.no_grad():
        for p, delta in (shift or {}).items():
            p.sub_(delta)
    return rows


def test_clipping_each_evaluation_separately_is_a_different_mechanism() -> None:
    """The sensitivity trap (docs/clipping.md): at (κ, γ) = (0.7, 0.2), c = 2.14, c·clip(a_i) + (1 − c)·clip(b_i)
    reaches (|c| + |1 − c|)·C = 3.29·C, while the engine's joint clip keeps every example at norm ≤ C."""
    model, batch = build("gpt2_tied")
    c, clip = 15 / 7, 1e-3  # every example clipped
    evaluations = shifted(model, c, size=0.5)
    a = per_example_grads(model, batch, evaluations[0][1])
    b = per_example_grads(model, batch, None)
    separate = [
        c * clip * ai / ai.norm() + (1 - c) * clip * bi / bi.norm() for ai, bi in zip(a, b, strict=True)
    ]
    assert max(s.norm().item() for s in separate) > 1.5 * clip
    joint = [(c * ai + (1 - c) * bi) for ai, bi in zip(a, b, strict=True)]
    joint = [u * min(1.0, clip / (u.norm().item() + 1e-6)) for u in joint]
    assert max(u.norm().item() for u in joint) <= clip * (1 + 1e-9)
    ours, _ = engine_combined(model, batch, clip, evaluations)
    flat = torch.cat([ours[n].flatten() for n, p in model.named_parameters() if p.requires_grad])
    torch.testing.assert_close(flat, sum(joint), rtol=1e-9, atol=1e-15)
    assert (flat - sum(separate)).norm() > 0.1 * flat.norm()


def test_scales_that_do_not_fit_are_refused() -> None:
    model, batch = build("gpt2_tied")
    engine = ClippingEngine(model)
    bias = model.transformer.h[0].attn.c_attn.bias
    with engine.record(5):
        losses = per_example_loss(model, batch)
    gradients = engine.per_example_gradients(losses)
    with pytest.raises(ValueError, match="FactoredScale .* needs a 2-D parameter"):
        clip_and_accumulate(engine, [(gradients, 1.0)], 1.0, clip_scale={bias: FactoredScale(bias, bias)})
    with pytest.raises(ValueError, match="shaped like its parameter"):
        clip_and_accumulate(engine, [(gradients, 1.0)], 1.0, clip_scale={bias: bias[:3]})
