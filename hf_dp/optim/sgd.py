"""DP-SGD (Abadi et al. 2016), optionally with heavy-ball momentum: torch's SGD run on ĝ (post-processing)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def build(params: Iterable[Any], *, noise_std: float, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, **kwargs)
