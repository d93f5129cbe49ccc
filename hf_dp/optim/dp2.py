"""DP² — delayed preconditioners (Li, Zaheer, Liu, Reddi, McMahan, Smith, ICLR 2023, Alg. 1).

Cycles of s1 DP-SGD steps (clip C1, lr α) then s2 adaptive steps (clip C2 in the geometry ‖g_i ⊘ D‖,
D = √v + ε, lr α2). The SGD phase sums its privatised gradients in A; at the first adaptive step
(r = t mod (s1+s2) = s1) v ← βv + (1−β)(A/s1)² (RMSProp) or v ← v + (A/s1)² (AdaGrad), then A ← 0.
The adaptive step is w ← w − α2 ĝ_D with ĝ_D = (Σ_i clip(g_i ⊘ D; C2) + N(0, σ²C2²))/B̄ = ĝ ⊘ D, the
preconditioned noisy gradient itself (no un-scaling, no second division, no momentum). docs/optimizers.md.
v and A are (at least) float32 and, with the step count, in the state_dict.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch

from hf_dp.clipping.plan import StepPlan
from hf_dp.optim.base import DPOptimizer, state_dtype
from hf_dp.optim.registry import register_dp_optimizer

# Li et al. 2023 (DP²), Table 2: ε 1e-7 tuned on IMDB (1e-5 StackOverflow, 1e-3 MovieLens); C2 = 5 on all three
# tasks. The delay s was tuned per data set (195–31,250 steps, 0.5–25 epochs); 50 steps each keeps an adaptive
# phase in short fine-tuning runs. β = 0.9 is the reference code's default.
DEFAULT_EPS = 1e-7
DEFAULT_ADAPTIVE_CLIP_NORM = 5.0
DEFAULT_DELAY_STEPS = 50


class DP2(DPOptimizer):
    """DP²-RMSProp / DP²-AdaGrad. The scheduler's lr is α; adaptive steps multiply it by α2/α."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        *,
        sgd_steps: int = DEFAULT_DELAY_STEPS,
        adaptive_steps: int = DEFAULT_DELAY_STEPS,
        adaptive_clip_norm: float = DEFAULT_ADAPTIVE_CLIP_NORM,
        lr_adaptive: float | None = None,
        beta: float = 0.9,
        eps: float = DEFAULT_EPS,
        variant: Literal["rmsprop", "adagrad"] = "rmsprop",
        weight_decay: float = 0.0,
    ) -> None:
        if sgd_steps < 1 or adaptive_steps < 1:
            raise ValueError(
                f"sgd_steps and adaptive_steps must be ≥ 1, got {sgd_steps} and {adaptive_steps}"
            )
        if adaptive_clip_norm <= 0:
            raise ValueError(f"adaptive_clip_norm (C2) must be > 0, got {adaptive_clip_norm}")
        if variant not in ("rmsprop", "adagrad"):
            raise ValueError(f"variant must be 'rmsprop' or 'adagrad', got {variant!r}")
        if not 0 <= beta < 1 or eps <= 0 or lr <= 0:
            raise ValueError(f"need 0 ≤ beta < 1, eps > 0 and lr > 0; got beta={beta}, eps={eps}, lr={lr}")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))
        self.adaptive_lr_ratio = 1.0 if lr_adaptive is None else lr_adaptive / lr  # α2/α
        self.sgd_steps, self.adaptive_steps = sgd_steps, adaptive_steps
        self.adaptive_clip_norm, self.beta, self.variant = adaptive_clip_norm, beta, variant

    @property
    def steps_taken(self) -> int:
        """t: the number of completed steps (kept in every parameter's state, all equal)."""
        for state in self.state.values():
            return int(state["step"])
        return 0

    def in_adaptive_phase(self) -> bool:
        return self.steps_taken % (self.sgd_steps + self.adaptive_steps) >= self.sgd_steps

    def _scales(self) -> dict[torch.Tensor, torch.Tensor]:
        """1/D = 1/(√v + ε) per parameter."""
        return {
            p: 1 / (self._state(p)["v"].sqrt() + group["eps"])
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad
        }

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["v"] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
            state["accumulator"] = torch.zeros_like(state["v"])
        return state

    def plan_step(self, clip_norm: float) -> StepPlan:
        """SGD phase: ℓ2 clipping at the plan's C (C1). Adaptive phase: ‖g_i ⊘ D‖ ≤ C2."""
        if not self.in_adaptive_phase():
            return StepPlan(clip_norm=clip_norm)
        with torch.no_grad():
            return StepPlan(clip_norm=self.adaptive_clip_norm, clip_scale=self._scales())

    def update(self) -> None:
        adaptive = self.in_adaptive_phase()
        for group in self.param_groups:
            lr = group["lr"] * (self.adaptive_lr_ratio if adaptive else 1.0)
            for p in group["params"]:
                state = self._state(p)
                if p.grad is not None:
                    grad = p.grad.to(state["v"].dtype)
                    if adaptive:
                        update = grad / (state["v"].sqrt() + group["eps"])
                    else:
                        state["accumulator"].add_(grad)
                        update = grad
                    self.decay(p, lr, group["weight_decay"])
                    p.add_(update.to(p.dtype), alpha=-lr)
                state["step"] += 1
                if int(state["step"]) % (self.sgd_steps + self.adaptive_steps) == self.sgd_steps:
                    self._refresh(state)

    def _refresh(self, state: dict) -> None:
        """Before the first adaptive step of a cycle: v from the mean of the SGD phase's ĝ, then A ← 0."""
        mean_sq = (state["accumulator"] / self.sgd_steps).square_()
        if self.variant == "rmsprop":
            state["v"].mul_(self.beta).add_(mean_sq, alpha=1 - self.beta)
        else:
            state["v"].add_(mean_sq)
        state["accumulator"].zero_()


@register_dp_optimizer("dp2", rule_class=DP2, scaled_geometry=True)
def build(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> DP2:
    """``mean_noise_std`` is unused: DP² steps on the noisy gradient as released."""
    return DP2(params, **kwargs)
