"""Clip factors and clip geometries: c_i from ‖g_i‖, and ‖s ⊙ g_i‖ instead of ‖g_i‖ (STP, DP²).

c_i = min(1, C/‖g_i‖) (Abadi et al. 2016) or C/(‖g_i‖ + γ) ("automatic", Bu et al. 2022); both keep
‖c_i g_i‖ ≤ C. A scale is either a dense tensor shaped like its parameter, or a ``FactoredScale`` s = r cᵀ
(rank 1 per weight matrix, our extension), with which ‖s ⊙ G_i‖ stays an ordinary ghost norm of the
per-example gradient built from output gradients scaled by r and inputs scaled by c. See docs/clipping.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

ClippingFn = Literal["abadi", "automatic"]
ClippingMode = Literal["ghost", "per_sample"]
CLIPPING_FNS: tuple[str, ...] = get_args(ClippingFn)
CLIPPING_MODES: tuple[str, ...] = get_args(ClippingMode)

# Automatic clipping's stability constant γ in C / (‖g_i‖ + γ) (Bu et al. 2022).
AUTOMATIC_CLIPPING_GAMMA = 0.01
# Abadi clipping's stability constant ε in min(1, C / (‖g_i‖ + ε)): a zero gradient divides by it, not by 0.
ABADI_CLIPPING_EPSILON = 1e-6


def clip_factors(norms: torch.Tensor, max_norm: float, fn: ClippingFn) -> torch.Tensor:
    """c_i: min(1, C/(‖g_i‖ + ε)) ("abadi", Abadi et al. 2016) or C/(‖g_i‖ + γ) ("automatic", Bu et al. 2022);
    both keep ‖c_i g_i‖ ≤ C."""
    if fn == "abadi":
        return (max_norm / (norms + ABADI_CLIPPING_EPSILON)).clamp(max=1.0)
    return max_norm / (norms + AUTOMATIC_CLIPPING_GAMMA)


@dataclass(frozen=True)
class FactoredScale:
    """s = outer(rows, cols) for a 2-D parameter: rows has its first dimension, cols its second."""

    rows: torch.Tensor
    cols: torch.Tensor

    def dense(self) -> torch.Tensor:
        return torch.outer(self.rows, self.cols)


ClipScale = torch.Tensor | FactoredScale
ClipScales = Mapping[nn.Parameter, ClipScale]


def dense_scale(scale: ClipScale) -> torch.Tensor:
    """The scale as a tensor shaped like its parameter."""
    return scale.dense() if isinstance(scale, FactoredScale) else scale


def unsharded(scale: ClipScale) -> ClipScale:
    """The whole scale of an FSDP2-sharded parameter (its DTensor parts gathered), for the norm pass, which sees
    each layer's whole per-example gradient; a plain scale as it is. Gathered layer by layer, when the layer's
    norm is computed, so at most one layer's scale is whole at a time."""
    if isinstance(scale, FactoredScale):
        return FactoredScale(rows=unsharded(scale.rows), cols=unsharded(scale.cols))
    return scale.full_tensor() if isinstance(scale, DTensor) else scale


def owned_scale(scale: ClipScale, gradient: torch.Tensor) -> torch.Tensor:
    """The dense scale over the part of ``gradient`` this process noises: an FSDP2 DTensor gradient's local shard
    (a whole scale is cut into that shard locally), else all of it."""
    if not isinstance(gradient, DTensor):
        return dense_scale(unsharded(scale))
    if not isinstance(scale, DTensor):
        mesh = gradient.device_mesh
        whole = dense_scale(unsharded(scale)).to(gradient.device)
        scale = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return scale.redistribute(gradient.device_mesh, gradient.placements).to_local()


def scales_by_id(scales: ClipScales | None, clipped: list[nn.Parameter]) -> dict[int, ClipScale]:
    """The clip scales of the ``clipped`` parameters by id, checked against their shapes."""
    found: dict[int, ClipScale] = {}
    by_id = {id(p): p for p in clipped}
    for param, scale in (scales or {}).items():
        if id(param) not in by_id:
            continue
        if isinstance(scale, FactoredScale):
            shape = (scale.rows.numel(), scale.cols.numel())
            if param.dim() != 2 or tuple(param.shape) != shape:
                raise ValueError(
                    f"a FactoredScale {shape} needs a 2-D parameter of that shape, got {tuple(param.shape)}"
                )
        elif scale.shape != param.shape:
            raise ValueError(
                f"a dense clip scale must be shaped like its parameter {tuple(param.shape)}, got {tuple(scale.shape)}"
            )
        found[id(param)] = scale
    return found
