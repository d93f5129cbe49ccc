"""A model's clipped step outside the Trainer, from its engine: the one-pass book-keeping step (pipeline.py's
``FactoredSum`` into ``.grad``) as functions the tests call directly.

    c_i = clip(‖s ⊙ u_i‖, C) · mask_i,  u_i = Σ_e w_e g_i^e,   .grad += Σ_e w_e Σ_i c_i G_i^e
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_dp.clipping.engine import ClippingEngine, EvaluationGradients
from hf_dp.clipping.geometry import ClipScales


def clip_and_accumulate(
    engine: ClippingEngine,
    evaluations: Sequence[tuple[EvaluationGradients, float]],
    clip_norm: float,
    example_mask: torch.Tensor | None = None,
    *,
    clip_scale: ClipScales | None = None,
) -> torch.Tensor:
    """Clip each example's weighted combination once and add the clipped sum to ``.grad`` (a bf16/fp16
    parameter's to its float32 sum); returns ‖s ⊙ u_i‖, shape (B,)."""
    norms, terms = engine.norms_and_terms(evaluations, clip_scale)
    mask = torch.ones_like(norms) if example_mask is None else example_mask
    clipped = engine.sums.clip(norms, clip_norm, mask)
    with torch.no_grad():
        for param, weighted in terms.values():
            for weight, part in weighted:
                weights = clipped.factors if weight == 1 else weight * clipped.factors
                engine.sums.add(param, clipped.overflowed.apply(part), weights)
    return norms


def clipped_backward(
    engine: ClippingEngine,
    per_example_loss: torch.Tensor,
    clip_norm: float,
    example_mask: torch.Tensor | None = None,
    *,
    verify: bool = False,
    clip_scale: ClipScales | None = None,
) -> torch.Tensor:
    """``.grad`` += Σ_i c_i ∇L_i of the forward recorded by ``engine.record``; returns ‖s ⊙ ∇L_i‖. ``verify``: the
    unclipped sum checked against autograd (ClippingEngine.per_example_gradients)."""
    gradients = engine.per_example_gradients(per_example_loss, verify=verify)
    return clip_and_accumulate(engine, [(gradients, 1.0)], clip_norm, example_mask, clip_scale=clip_scale)


def per_example_norms(
    engine: ClippingEngine,
    evaluations: Sequence[tuple[EvaluationGradients, float]],
    *,
    clip_scale: ClipScales | None = None,
) -> torch.Tensor:
    """‖s ⊙ u_i‖ with u_i = Σ_e w_e g_i^e, shape (B,); no ``.grad``."""
    return engine.norms_and_terms(evaluations, clip_scale)[0]
