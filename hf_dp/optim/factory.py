"""make_dp_optimizer: the registry of update rules fed the privatised gradient.

DP-SGD, DP-Adam and DP-AdamW are the stock torch optimizers run on ĝ (post-processing of the
privatised gradient, Abadi et al. 2016; P0 Alg. 5 for Adam).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

DP_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def make_dp_optimizer(name: str, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """Build the update rule ``name`` over ``params``; the trainer attaches the privatiser to it."""
    if name not in DP_OPTIMIZERS:
        raise ValueError(f"unknown dp_optimizer {name!r}; use one of {sorted(DP_OPTIMIZERS)}")
    try:
        return DP_OPTIMIZERS[name](params, **kwargs)
    except TypeError as error:
        raise ValueError(
            f"dp_optimizer {name!r} does not accept these dp_optimizer_kwargs: {error}"
        ) from None
