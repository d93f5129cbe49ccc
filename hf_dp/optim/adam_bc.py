"""DP-AdamBC (Tang et al., AAAI 2024; P0 Alg. 7): Adam on ĝ with the privacy-noise bias removed from v.

Black-box Adam on ĝ = ḡ + N(0, Φ), Φ = (σC/B̄)², has E[v̂_t] = v̂*_t + Φ at every t (P0 §A1.2): every
coordinate whose true second moment is below Φ gets about the same learning rate η/√Φ. DP-AdamBC
subtracts Φ:

    m_t = β1 m + (1−β1) ĝ,   v_t = β2 v + (1−β2) ĝ²,
    θ ← θ(1 − ηλ) − η · (m_t / (1−β1^t)) / √max(v_t / (1−β2^t) − Φ, ε²)

Choices, following the papers where a public implementation differs:
- Φ is subtracted AFTER the 1/(1−β2^t) normalisation, where it is the same constant at every t
  (P0 pitfall 3), as in the authors' code (ubc-systopia/DP-AdamBC).
- ε is a floor on the corrected std, not an additive term (P0 Alg. 7; Tang et al. write γ' = ε² on the
  variance). Default ε = 1e-4, P0's best in every setting (floor 1e-8). Some ports compute
  ε + √max(v̂ − Φ, γ') and so add both; the papers and the authors' code do not. That code's optional
  geometric decay of γ' is in neither paper and is not implemented.
- Φ = noise_std² with noise_std = σC/B̄ for the EXPECTED batch size B̄ (P0 pitfall 1): the std of the
  noise the privatiser actually adds. The authors' code divides by a fixed batch size.
- Weight decay is decoupled (AdamW-style, data-independent); the authors' code adds a coupled L2 term
  to the gradient before the moments.
- Moments, the subtraction and the floor are fp32 for bf16/fp16/fp32 parameters (P0 pitfall 5: in
  bf16 the subtraction of two nearly equal numbers loses everything, in fp16 ε² = 1e-8 underflows),
  also across ``load_state_dict``, which in torch would cast floating state to the parameter dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


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


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 parameters (fp64 stays fp64)."""
    return torch.promote_types(p.dtype, torch.float32)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(_to_device(v, device) for v in value)
    return value


class Fp32StateOptimizer(torch.optim.Optimizer):
    """An optimizer whose state keeps its dtype through ``load_state_dict`` (torch would cast it)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            if saved_id in state_dict["state"]:
                self.state[p] = {k: _to_device(v, p.device) for k, v in state_dict["state"][saved_id].items()}


class AdamBC(Fp32StateOptimizer):
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

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("adam_bc does not support sparse gradients")
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
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss


def build(params: Iterable[Any], *, noise_std: float, **kwargs: Any) -> AdamBC:
    """kwargs: lr, betas=(0.9, 0.999), eps=1e-4 (floor ε² on v̂ − Φ), weight_decay=0.0 (decoupled)."""
    return AdamBC(params, noise_std=noise_std, **kwargs)
