"""make_dp_optimizer: the registry of update rules fed the privatised gradient ĝ.

Each name maps to a ``build(params, *, noise_std, **kwargs)`` function in its own module, imported
on first use. ``noise_std`` = σC/B̄ is the per-coordinate std of the noise in ĝ (in the un-scaled
space); rules that correct for it (DP-AdamBC) use it, the others ignore it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch

_BUILDERS: dict[str, str] = {
    "sgd": "hf_dp.optim.sgd:build",
    "adam": "hf_dp.optim.adam:build_adam",
    "adamw": "hf_dp.optim.adam:build_adamw",
    "adam_bc": "hf_dp.optim.adam_bc:build",
    "stp": "hf_dp.optim.scale_then_privatize:build",
    "dp2": "hf_dp.optim.dp2:build",
    "disk": "hf_dp.optim.disk:build",
    "doppler": "hf_dp.optim.doppler:build",
}
DP_OPTIMIZERS: tuple[str, ...] = tuple(_BUILDERS)


def make_dp_optimizer(
    name: str, params: Iterable[Any], *, noise_std: float = 0.0, **kwargs: Any
) -> torch.optim.Optimizer:
    """Build the update rule ``name`` over ``params``; the trainer attaches the privatiser to it.

    ``noise_std``: σC/B̄, the std of the privacy noise per coordinate of ĝ (DPTrainer passes it).
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown dp_optimizer {name!r}; use one of {sorted(DP_OPTIMIZERS)}")
    module, function = _BUILDERS[name].split(":")
    build = getattr(importlib.import_module(module), function)
    try:
        return build(params, noise_std=noise_std, **kwargs)
    except TypeError as error:
        raise ValueError(
            f"dp_optimizer {name!r} does not accept these dp_optimizer_kwargs: {error}"
        ) from None
