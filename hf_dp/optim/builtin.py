"""The eight built-in update rules, registered under their ``dp_optimizer`` names (docs/optimizers.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hf_dp.optim.adam_bc import AdamBC
from hf_dp.optim.registry import register_dp_optimizer


@register_dp_optimizer("sgd")
def build_sgd(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    """DP-SGD (Abadi et al. 2016): torch's SGD on ĝ, momentum and weight decay included."""
    return torch.optim.SGD(params, **kwargs)


@register_dp_optimizer("adam")
def build_adam(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    """Black-box DP-Adam: torch's Adam on ĝ; its second moment carries the noise bias (σC/B̄)²."""
    return torch.optim.Adam(params, **kwargs)


@register_dp_optimizer("adamw")
def build_adamw(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    """Black-box DP-AdamW: torch's AdamW on ĝ."""
    return torch.optim.AdamW(params, **kwargs)


@register_dp_optimizer("adam_bc")
def build_adam_bc(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    """DP-AdamBC (Tang et al. 2024): the noise variance (σC/B̄)² removed from v̂."""
    return AdamBC(params, noise_std=mean_noise_std, **kwargs)


build_adam_bc.rule = AdamBC.__init__


@register_dp_optimizer("stp", requires_bookkeeping=True)
def build_stp(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    """Scale-then-privatize Adam (Ganesh et al.): clips ‖s ⊙ g_i‖ with s from the previous step's v̂."""
    from hf_dp.optim.scale_then_privatize import ScaleThenPrivatize

    return ScaleThenPrivatize(params, **kwargs)


@register_dp_optimizer("dp2", requires_bookkeeping=True)
def build_dp2(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    """DP² (Li et al. 2023): delayed preconditioners; defaults in hf_dp.optim.dp2.DP2."""
    from hf_dp.optim.dp2 import DP2

    return DP2(params, **kwargs)


@register_dp_optimizer("disk", requires_bookkeeping=True)
def build_disk(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    """DiSK (Zhang et al.): a simplified Kalman filter over a base rule; two evaluations per step."""
    from hf_dp.optim.disk import build

    return build(params, noise_std=mean_noise_std, **kwargs)


@register_dp_optimizer("doppler")
def build_doppler(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    """DOPPLER (Zhang, Bu, Hong, Razaviyayn 2024): a low-pass filter on ĝ."""
    from hf_dp.optim.doppler import build

    return build(params, noise_std=mean_noise_std, **kwargs)
