"""The brute-force reference every exactness test compares with.

Σ_u c_u g_u over privacy units u (an example, a record, a user's rows, a preference pair), written out with no
hf_dp clipping code: ONE autograd backward per unit (per unit and evaluation point), each unit's loss built on
its own; g_u = Σ_e w_e ∇L_u(θ + shift_e) (one evaluation at θ unless given); its norm ‖s ⊙ g_u‖ in the
geometry s (1 unless given); c_u = min(1, C/(‖·‖ + 1e-6)) ("abadi", the engine's +1e-6) or C/(‖·‖ + 0.01)
("automatic"), times the unit's mask; the sum accumulated in float64 unless asked otherwise.

- ``clipped_sum``: units given as loss callables (each builds its unit's scalar loss afresh).
- ``per_example``: every row of a batch is a unit, run alone.
- ``per_unit``: units of parts (rows, records), each part run alone, L_u the mean of its parts' losses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from hf_dp.losses import per_example_loss

UnitLoss = Callable[[], torch.Tensor]
LossFn = Callable[[nn.Module, dict], torch.Tensor]


class Reference(NamedTuple):
    total: dict[str, torch.Tensor]  # Σ_u c_u g_u by trainable parameter name
    norms: torch.Tensor  # ‖s ⊙ g_u‖ per unit, before clipping
    losses: torch.Tensor  # L_u per unit, at the first evaluation point (detached)


def clip_factor(norm: float, max_norm: float, clipping_fn: str = "abadi") -> float:
    if clipping_fn == "abadi":
        return min(1.0, max_norm / (norm + 1e-6))  # the +1e-6 of the engine's abadi clip
    if clipping_fn == "automatic":
        return max_norm / (norm + 0.01)
    raise ValueError(f"clipping_fn={clipping_fn!r}: the oracle knows 'abadi' and 'automatic'")


def clipped_sum(
    model: nn.Module,
    unit_losses: Sequence[UnitLoss],
    max_norm: float,
    *,
    evaluations: tuple = ((1.0, None),),
    scale: dict | None = None,
    clipping_fn: str = "abadi",
    mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    groups: dict[str, tuple[str, float]] | None = None,
) -> Reference:
    """Σ_u c_u g_u, one backward per unit and evaluation. ``evaluations``: (weight, {Parameter: shift} or None)
    pairs, θ shifted in place for the unit's loss and restored after; ``scale``: Parameter → a dense tensor or
    a FactoredScale (the geometry the norm is taken in; the sum itself is unscaled); ``mask``: a weight per
    unit (0 drops it); ``groups``: parameter name → (its group, C_g), each group of g_u clipped on its own to C_g
    (group-wise clipping; ``max_norm`` unused)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    scales = {}
    if scale:
        from hf_dp.clipping.geometry import dense_scale

        scales = {id(p): dense_scale(s).double() for p, s in scale.items()}
    total = {n: torch.zeros_like(p, dtype=dtype) for n, p in named}
    norms, losses = [], []
    for u, loss_of in enumerate(unit_losses):
        combined = [torch.zeros_like(p, dtype=dtype) for p in params]
        for e, (weight, shift) in enumerate(evaluations):
            saved = {p: p.detach().clone() for p in (shift or {})}
            with torch.no_grad():
                for p, delta in (shift or {}).items():
                    p.add_(delta)
            loss = loss_of()
            if e == 0:
                losses.append(loss.detach())
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            with torch.no_grad():
                for p, value in saved.items():
                    p.copy_(value)
            for k, (g, p) in enumerate(zip(grads, params, strict=True)):
                combined[k] += weight * (torch.zeros_like(p) if g is None else g).to(dtype)
        norm = torch.sqrt(
            sum(
                (g if id(p) not in scales else g * scales[id(p)]).pow(2).sum()
                for g, p in zip(combined, params, strict=True)
            )
        )
        norms.append(norm)
        weight = 1.0 if mask is None else float(mask[u])
        if groups is None:
            factors = dict.fromkeys((n for n, _ in named), clip_factor(norm.item(), max_norm, clipping_fn))
        else:
            squared: dict[str, float] = {}
            for (n, p), g in zip(named, combined, strict=True):
                g = g if id(p) not in scales else g * scales[id(p)]
                squared[groups[n][0]] = squared.get(groups[n][0], 0.0) + g.pow(2).sum().item()
            factors = {
                n: clip_factor(squared[groups[n][0]] ** 0.5, groups[n][1], clipping_fn) for n, _ in named
            }
        for (n, _), g in zip(named, combined, strict=True):
            total[n] += weight * factors[n] * g
    return Reference(total, torch.stack(norms), torch.stack(losses))


def rows(batch: dict[str, torch.Tensor], indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
    """Each of the batch's rows ``indices`` as a batch of one."""
    return [{k: v[i : i + 1] for k, v in batch.items()} for i in indices]


def unit_losses(
    model: nn.Module, units: Sequence[Sequence[dict]], loss_fn: LossFn = per_example_loss
) -> list[UnitLoss]:
    """L_u = the mean of loss_fn over the unit's parts (batches of one row), each part run alone."""
    return [
        lambda parts=parts: sum(loss_fn(model, part)[0] for part in parts) / len(parts) for parts in units
    ]


def per_unit(
    model: nn.Module,
    units: Sequence[Sequence[dict]],
    max_norm: float,
    loss_fn: LossFn = per_example_loss,
    **options,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_u c_u ∇L_u over units of parts (rows of a user, a pair's two rows, a record run unpacked), and the norms."""
    reference = clipped_sum(model, unit_losses(model, units, loss_fn), max_norm, **options)
    return reference.total, reference.norms


def per_example(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    max_norm: float,
    loss_fn: LossFn = per_example_loss,
    **options,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_i c_i ∇L_i over the batch's rows, each row run alone, and the norms (options: ``clipped_sum``'s)."""
    units = [[row] for row in rows(batch, range(batch["input_ids"].shape[0]))]
    return per_unit(model, units, max_norm, loss_fn, **options)
