"""DOPPLER (Zhang, Bu, Hong, Razaviyayn 2024, Alg. 2/3): a low-pass filter on the privatised gradients ĝ.

    m_t = −Σ_{τ=1..n_a} a_τ m_{t−τ} + Σ_{τ=0..n_b} b_τ ĝ_{t−τ},   m̂_t = m_t / c_{a,t},
    c_{a,t} = −Σ_τ a_τ c_{a,t−τ} + Σ_{τ≤min(t,n_b)} b_τ,         θ ← θ(1 − ηλ) − η·m̂_t / D_t

with D_t = 1 (base "sgd", Alg. 2), √v̂_t + ε (base "adam", Alg. 3) or √max(v̂_t − (σC/B̄)², ε²) (base "adam_bc").
The filter replaces Adam's first moment; v is the bias-corrected EMA of the raw ĝ². Filters come from the
paper's tables (``hf_dp.optim.filters.FILTERS``) or are the user's own (b, a), checked before training. Where
this departs from the printed Alg. 3 (its box has defects): docs/optimizers.md. State per parameter, fp32:
``step``, the last n_b gradients ``g_hist`` and n_a outputs ``m_hist`` (newest first), the trackers ``c_hist``
and, for the Adam bases, ``exp_avg_sq``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hf_dp.optim.adam_bc import corrected_denominator, require_noise_std
from hf_dp.optim.base import DPOptimizer, state_dtype
from hf_dp.optim.filters import resolve_filter, validate_filter
from hf_dp.optim.registry import register_dp_optimizer

BASES = ("sgd", "adam", "adam_bc")
DEFAULT_EPS = {"sgd": 0.0, "adam": 1e-8, "adam_bc": 1e-4}


class Doppler(DPOptimizer):
    """LP-DPSGD / LP-DPAdam / LP-DPAdamBC over a validated filter (b, a)."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        b: Sequence[float],
        a: Sequence[float] = (),
        base: str = "sgd",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        beta2: float = 0.999,
        eps: float | None = None,
        noise_std: float = 0.0,
    ) -> None:
        defaults = {
            "b": tuple(float(x) for x in b),
            "a": tuple(float(x) for x in a),
            "base": base,
            "lr": lr,
            "weight_decay": weight_decay,
            "beta2": beta2,
            "eps": DEFAULT_EPS.get(base, 0.0) if eps is None else eps,
            "noise_std": noise_std,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            validate_filter(group["b"], group["a"])
            if group["base"] not in BASES:
                raise ValueError(f"unknown doppler base {group['base']!r}; use one of {list(BASES)}")
            if group["base"] != "sgd" and not 0 <= group["beta2"] < 1:
                raise ValueError(f"doppler needs 0 ≤ beta2 < 1, got {group['beta2']}")
            if group["base"] == "adam_bc":
                require_noise_std(group["noise_std"], "doppler with base='adam_bc'")
                if not group["eps"] > 0:
                    raise ValueError(
                        f"doppler with base='adam_bc' needs eps > 0 (the floor ε²), got {group['eps']}"
                    )

    def update(self) -> None:
        for group, p in self.params_with_grad():
            update = self._filtered(group, self.state[p], p)
            self.decay(p, group["lr"], group["weight_decay"])
            p.add_(update, alpha=-group["lr"])

    @staticmethod
    def _filtered(group: dict[str, Any], state: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """One step of the filter and the base rule for one parameter: returns m̂_t / D_t (fp32)."""
        b, a, base = group["b"], group["a"], group["base"]
        if not state:
            state["step"] = 0
            state["g_hist"] = [torch.zeros_like(p, dtype=state_dtype(p)) for _ in b[1:]]
            state["m_hist"] = [torch.zeros_like(p, dtype=state_dtype(p)) for _ in a]
            state["c_hist"] = [0.0 for _ in a]
            if base != "sgd":
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p))
        t = state["step"]
        grad = p.grad.to(state_dtype(p))
        m = grad * b[0]
        for b_tau, g_past in zip(b[1:], state["g_hist"], strict=True):
            m.add_(g_past, alpha=b_tau)
        for a_tau, m_past in zip(a, state["m_hist"], strict=True):
            m.add_(m_past, alpha=-a_tau)
        c = sum(b[: t + 1]) - sum(a_tau * c_past for a_tau, c_past in zip(a, state["c_hist"], strict=True))
        if state["g_hist"]:
            oldest = state["g_hist"].pop()
            state["g_hist"].insert(0, oldest.copy_(grad))
        if a:
            state["m_hist"] = [m, *state["m_hist"][:-1]]
            state["c_hist"] = [c, *state["c_hist"][:-1]]
        state["step"] = t + 1
        update = m / c
        if base == "sgd":
            return update
        beta2 = group["beta2"]
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        v_hat = state["exp_avg_sq"] / (1 - beta2 ** (t + 1))
        if base == "adam":
            return update.div_(v_hat.sqrt_().add_(group["eps"]))
        return update.div_(corrected_denominator(v_hat, group["noise_std"], group["eps"]))


DEFAULT_FILTER = "first_order_v1"


@register_dp_optimizer("doppler", rule_class=Doppler)
def build(
    params: Iterable[Any],
    *,
    mean_noise_std: float,
    filter: str | None = None,
    b: Sequence[float] | None = None,
    a: Sequence[float] | None = None,
    **kwargs: Any,
) -> Doppler:
    """``filter``: a table name (``hf_dp.optim.filters.FILTERS``), or custom ``b`` and ``a``; with neither,
    ``first_order_v1`` (DOPPLER's ablation finds a first-order filter enough, App. C).

    kwargs: base ("sgd" | "adam" | "adam_bc"), lr, weight_decay (decoupled), beta2 and eps (Adam bases).
    """
    if filter is None and b is None and a is None:
        filter = DEFAULT_FILTER
    b, a = resolve_filter(filter, b, a)
    return Doppler(params, b=b, a=a, noise_std=mean_noise_std, **kwargs)
