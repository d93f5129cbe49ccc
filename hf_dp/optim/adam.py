"""Black-box DP-Adam / DP-AdamW: torch's Adam(W) run on ĝ (post-processing; P0 Alg. 5).

Its second moment carries the noise bias (σC/B̄)² (P0 §A1.2); ``adam_bc`` removes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def build_adam(params: Iterable[Any], *, noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, **kwargs)


def build_adamw(params: Iterable[Any], *, noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **kwargs)
