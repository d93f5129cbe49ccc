"""DiSK — simplified Kalman filter on the privatised gradient (Zhang, Bu, Balle, Hong, Razaviyayn, Mirrokni, Alg. 3).

Each example's gradient is evaluated at θ_t + γd and at θ_t on the same examples and the COMBINATION
u_i = c·∇f_i(θ_t + γd) + (1−c)·∇f_i(θ_t), c = (1−κ)/(κγ), is clipped once (sensitivity C, the same σ and
accounting as DP-SGD). The privatised ĝ is filtered, g̃ ← (1−κ)g̃ + κĝ, with g̃ started at the first ĝ
(the paper's convention; the Opacus port's ``lerp_(grad, 1−κ)`` swaps the roles of κ and 1−κ, so there
κ = 1 would freeze g̃), and g̃ is handed to the base optimizer as its gradient. d = θ_{t+1} − θ_t is the
ACTUAL displacement (learning-rate schedule, Adam scaling and weight decay included). docs/optimizers.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from hf_dp.clipping.plan import Evaluation, HasStepPlan, Shift, StepPlan
from hf_dp.optim.base import DPOptimizer, state_dtype
from hf_dp.optim.registry import make_dp_optimizer, register_dp_optimizer


class DiSK(DPOptimizer):
    """Wraps a DP update rule, sharing its ``param_groups`` (so the trainer's scheduler drives it)."""

    def __init__(self, base: torch.optim.Optimizer, kappa: float = 0.7, gamma: float = 0.5) -> None:
        if not 0 < kappa <= 1:
            raise ValueError(f"DiSK needs 0 < kappa ≤ 1 (the weight of the new gradient), got {kappa}")
        if gamma == 0:
            raise ValueError(
                "DiSK needs gamma ≠ 0 (c = (1 − κ)/(κγ)); use kappa=1 for the base optimizer alone"
            )
        if isinstance(base, HasStepPlan):
            raise ValueError(f"DiSK cannot wrap {type(base).__name__}, which plans its own clipping")
        self.base, self.kappa, self.gamma = base, kappa, gamma
        super().__init__(base.param_groups, base.defaults)
        self.param_groups = base.param_groups

    @property
    def evaluations_per_step(self) -> int:
        """2 when both θ + γd and θ are evaluated (c ∉ {0, 1}), else 1."""
        return 1 if self.c == 0 or math.isclose(self.c, 1.0, rel_tol=1e-12) else 2

    @property
    def c(self) -> float:
        """The weight of the extrapolated point, (1 − κ)/(κγ)."""
        return (1 - self.kappa) / (self.kappa * self.gamma)

    @torch.no_grad()
    def plan_step(self, clip_norm: float) -> StepPlan:
        """One evaluation at θ when c = 0 or d = 0 (t = 0), one at θ + γd when c = 1, else both."""
        displaced = {p: state["displacement"] for p, state in self.state.items() if "displacement" in state}
        if self.c == 0 or not any(d.any() for d in displaced.values()):
            return StepPlan(clip_norm=clip_norm)
        shift = Shift(self.gamma, displaced)
        if math.isclose(self.c, 1.0, rel_tol=1e-12):
            return StepPlan(clip_norm=clip_norm, evaluations=(Evaluation(shift=shift),))
        return StepPlan(
            clip_norm=clip_norm, evaluations=(Evaluation(weight=self.c, shift=shift), Evaluation(1 - self.c))
        )

    def update(self) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        lerped: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in params:
            state = self.state[p]
            if "filtered" in state:
                lerped.append((state["filtered"], p.grad.to(state["filtered"].dtype)))
            else:
                state["step"] = torch.tensor(0.0)
                state["filtered"] = p.grad.to(state_dtype(p), copy=True)
                state["displacement"] = torch.empty_like(state["filtered"])
        states = [self.state[p] for p in params]
        displacements = [state["displacement"] for state in states]
        # fused over all parameters (torch._foreach_*): at GPT-2 width every pass moves hundreds of MB
        if lerped:
            torch._foreach_lerp_([f for f, _ in lerped], [g for _, g in lerped], self.kappa)
        torch._foreach_add_([state["step"] for state in states], 1.0)
        for p, displacement in zip(params, displacements, strict=True):
            torch.neg(p, out=displacement)  # −θ_t, until the base has stepped
        # the base reads g̃ as its gradient: lent as .grad (no copy unless the parameter is in low precision),
        # then .grad is given back its privatised ĝ
        privatised = [p.grad for p in params]
        for p, state in zip(params, states, strict=True):
            p.grad = state["filtered"].to(p.grad.dtype)
        self.base.step()
        for p, grad in zip(params, privatised, strict=True):
            p.grad = grad
        torch._foreach_add_(displacements, params)  # d = θ_{t+1} − θ_t

    def state_dict(self) -> dict:
        """g̃, d and the step count per parameter, and the base optimizer's state under ``"base"``."""
        return {**super().state_dict(), "base": self.base.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.base.load_state_dict(state_dict.pop("base"))
        super().load_state_dict(state_dict)
        self.param_groups = self.base.param_groups  # loading made new group dicts: share the base's again


@register_dp_optimizer("disk", shifted_evaluations=True)
def build(
    params: Iterable[Any],
    *,
    mean_noise_std: float,
    kappa: float = 0.7,
    gamma: float = 0.5,
    base: str = "adamw",
    **base_kwargs: Any,
) -> torch.optim.Optimizer:
    """DiSK over ``make_dp_optimizer(base, ...)``. The base is told the stationary noise std of g̃,
    √(κ/(2−κ))·σC/B̄ (the filter's stationary variance), which only a noise-aware base (adam_bc) uses."""
    if base == "disk":
        raise ValueError("DiSK cannot wrap itself")
    inner = make_dp_optimizer(
        base, params, mean_noise_std=mean_noise_std * math.sqrt(kappa / (2 - kappa)), **base_kwargs
    )
    return DiSK(inner, kappa=kappa, gamma=gamma)
