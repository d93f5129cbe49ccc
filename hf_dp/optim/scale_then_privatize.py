"""Scale-then-privatize (STP) Adam (Ganesh et al., Alg. 8; Li et al. 2022/2023).

Step t clips per example in the geometry ‖s_t ⊙ g_i‖ ≤ C with s_t = 1/(√ν̂_{t−1} + ε1), Adam's bias-corrected
second moment of the PREVIOUS step (s_1 = 1/ε1), held fixed for the whole logical batch. The privatiser adds
isotropic noise in the scaled space and un-scales, so ``step()`` receives ĝ = (Σ_i c_i g_i + σC ξ ⊘ s_t)/B̄
and runs Adam(W) on it with its own ε2: ν is fed the un-scaled noisy ĝ.
Post-processing only: s_t depends on earlier releases, so privacy equals DP-SGD's.

``factored=True`` is our extension, not from the papers (docs/optimizers.md): a
matrix gets the rank-1 scale s = r cᵀ from the row and column means of ν̂ (Adafactor's ν ≈ r̄ c̄ᵀ/mean ν̂),
with √ε1 inside each factor, so the scaled norms stay ghost norms; vectors keep the dense scale.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hf_dp.clipping.geometry import ClipScale, FactoredScale
from hf_dp.clipping.plan import StepPlan
from hf_dp.optim.registry import register_dp_optimizer

# ε1: Ganesh et al. tuned it with η and C and did not report it; 1e-4 is their best ε for DP-AdamBC.
DEFAULT_SCALE_EPS = 1e-4


class ScaleThenPrivatize(torch.optim.AdamW):
    """AdamW (decoupled weight decay, ε2 = ``eps``) whose plan clips in the geometry s = 1/(√ν̂_{t−1} + ε1)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        scale_eps: float = DEFAULT_SCALE_EPS,
        weight_decay: float = 0.0,
        factored: bool = False,
    ) -> None:
        if scale_eps <= 0:
            raise ValueError(f"scale_eps (ε1) must be > 0, since s_1 = 1/ε1; got {scale_eps}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.scale_eps = scale_eps
        self.factored = factored

    @torch.no_grad()
    def plan_step(self, clip_norm: float) -> StepPlan:
        scales = {
            p: self._scale(p, group["betas"][1])
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad
        }
        return StepPlan(clip_norm=clip_norm, clip_scale=scales)

    def _second_moment(self, p: torch.Tensor, beta2: float) -> torch.Tensor:
        """ν̂_{t−1} = ν_{t−1}/(1 − β2^{t−1}) in float32; zero before the first step."""
        state = self.state.get(p)
        if not state or "exp_avg_sq" not in state:
            return torch.zeros_like(p, dtype=torch.float32)
        return state["exp_avg_sq"].float() / (1 - beta2 ** float(state["step"]))

    def _scale(self, p: torch.Tensor, beta2: float) -> ClipScale:
        nu_hat = self._second_moment(p, beta2)
        if not (self.factored and p.dim() == 2):
            return 1 / (nu_hat.sqrt() + self.scale_eps)
        # √ν̂_jk ≈ (√r_j / m^¼)(√c_k / m^¼) with r, c the row and column means and m the mean of ν̂
        quarter = nu_hat.mean().clamp(min=torch.finfo(torch.float32).tiny).pow(0.25)
        root_eps = self.scale_eps**0.5
        return FactoredScale(
            rows=1 / (nu_hat.mean(dim=1).sqrt() / quarter + root_eps),
            cols=1 / (nu_hat.mean(dim=0).sqrt() / quarter + root_eps),
        )


@register_dp_optimizer("stp", rule_class=ScaleThenPrivatize, scaled_geometry=True)
def build(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> ScaleThenPrivatize:
    """``mean_noise_std`` is unused: STP's noise is shaped by s_t, and ν keeps it."""
    return ScaleThenPrivatize(params, **kwargs)
