"""The clipped sums of a logical batch, as handed to the mechanism: an explicit value, taken once per release.

A float32 (or float64) parameter's clipped sum Σ_i c_i g_i lives in its ``.grad``. A bf16/fp16 parameter's is
kept in float32 beside it (``wide``), so that the noise is added in float32 and only the released ĝ is cast
(a noise draw in bf16 would itself be quantised: docs/clipping.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ClippedSums:
    """Σ_i c_i g_i per parameter: ``wide`` holds the float32 sums of low-precision parameters, ``.grad`` the rest."""

    wide: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)

    def of(self, param: nn.Parameter) -> torch.Tensor:
        """The parameter's clipped sum in at least float32: its float32 sum (plus any ``.grad``), its ``.grad``,
        or zeros (an empty batch is still noised)."""
        wide = self.wide.pop(param, None)
        if wide is not None:
            return wide if param.grad is None else wide.add_(param.grad.float())
        if param.grad is not None:
            dtype = torch.promote_types(param.dtype, torch.float32)
            return param.grad if param.grad.dtype == dtype else param.grad.float()
        return torch.zeros_like(param, dtype=torch.promote_types(param.dtype, torch.float32))
