"""DP-SGD (Abadi et al. 2016) and black-box DP-Adam(W): torch's own optimizers run on the released ĝ.

Black-box Adam's second moment carries the noise variance (σC/B̄)²; ``adam_bc`` removes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hf_dp.optim.registry import register_dp_optimizer


@register_dp_optimizer("sgd")
def build_sgd(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.SGD:
    return torch.optim.SGD(params, **kwargs)


@register_dp_optimizer("adam")
def build_adam(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.Adam:
    return torch.optim.Adam(params, **kwargs)


@register_dp_optimizer("adamw")
def build_adamw(params: Iterable[Any], *, mean_noise_std: float, **kwargs: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **kwargs)
