"""DP-AdamBC (Tang et al., AAAI 2024): Adam on ĝ with the privacy-noise variance removed from v̂.

Black-box Adam on ĝ = ḡ + N(0, Φ), Φ = (σC/B̄)², has E[v̂_t] = v̂*_t + Φ: every coordinate whose true second
moment is below Φ gets about the same step η/√Φ. DP-AdamBC subtracts Φ:

    m_t = β1 m + (1−β1) ĝ,   v_t = β2 v + (1−β2) ĝ²,
    θ ← θ(1 − ηλ) − η · (m_t / (1−β1^t)) / √max(v_t / (1−β2^t) − Φ, ε²)

ε is a floor (default 1e-4), Φ uses the expected batch B̄, weight decay is decoupled, state is fp32; where
this follows the paper rather than the authors' code: docs/optimizers.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hf_dp.optim.base import DPOptimizer, state_dtype
from hf_dp.optim.registry import register_dp_optimizer


def require_noise_std(noise_std: float | None, who: str) -> float:
    """The noise std σC/B̄, or a one-line ValueError if it is missing or not positive."""
    if noise_std is None or not noise_std > 0:
        raise ValueError(
            f"{who} needs noise_std = σC/B̄ > 0 (the per-coordinate std of the privacy noise in ĝ, "
            f"which DPTrainer passes), got {noise_std!r}"
        )
    return float(noise_std)


def corrected_denominator(v_hat: torch.Tensor, noise_std: float, eps: float) -> torch.Tensor:
    """√max(v̂ − noise_std², ε²), in place on ``v_hat`` (a fresh tensor owned by the caller)."""
    return v_hat.sub_(noise_std**2).clamp_min_(eps**2).sqrt_()


class AdamBC(DPOptimizer):
    """DP-AdamBC; state per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (fp32; fp64 for fp64)."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        noise_std: float,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-4,
        weight_decay: float = 0.0,
    ) -> None:
        noise_std = require_noise_std(noise_std, "adam_bc")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"adam_bc needs 0 ≤ β < 1, got betas={betas}")
        if not eps > 0:
            raise ValueError(f"adam_bc needs eps > 0 (the floor ε² on the corrected v̂), got {eps}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "noise_std": noise_std,
        }
        super().__init__(params, defaults)

    def update(self) -> None:
        for group, p in self.params_with_grad():
            beta1, beta2 = group["betas"]
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p))
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p))
            state["step"] += 1
            t = state["step"]
            grad = p.grad.to(state_dtype(p))
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            v_hat = state["exp_avg_sq"] / (1 - beta2**t)
            denominator = corrected_denominator(v_hat, group["noise_std"], group["eps"])
            update = (state["exp_avg"] / (1 - beta1**t)).div_(denominator)
            self.decay(p, group["lr"], group["weight_decay"])
            p.add_(update, alpha=-group["lr"])


@register_dp_optimizer("adam_bc", rule_class=AdamBC)
def build(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> AdamBC:
    """kwargs: lr, betas=(0.9, 0.999), eps=1e-4 (floor ε² on v̂ − Φ), weight_decay=0.0 (decoupled)."""
    return AdamBC(params, noise_std=mean_noise_std, **kwargs)
