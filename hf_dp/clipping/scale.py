"""Per-coordinate clipping geometries: clip ‖s ⊙ g_i‖ instead of ‖g_i‖ (scale-then-privatize, DP²).

A scale is either a dense tensor shaped like its parameter, or a ``FactoredScale`` s = r cᵀ (rank 1 per
weight matrix), our documented extension (spec A, Part C): with it ‖s ⊙ G_i‖ is the ordinary ghost norm
of the per-example gradient built from the output gradients scaled by r and the inputs scaled by c.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn


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
