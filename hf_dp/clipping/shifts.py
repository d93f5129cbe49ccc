"""Parameters at θ + shift for one evaluation of a micro-batch, θ left exactly as it was.

DiSK (Zhang et al.) evaluates every example at θ + γd and at θ and clips the combination once
(norm_passes.EvaluatedNorms); the shifted pass must leave θ exactly as it was (θ + δ − δ ≠ θ in floating point).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class ParameterShifter:
    """Parameters at θ + shift inside ``with shifter(shift):``, by pointing each ``p.data`` at a buffer holding
    θ + shift, and back at θ's own tensor after (θ is never written). One buffer per shifted parameter, kept
    for the shifter's life and refilled only for a new shift or after θ was written in place."""

    def __init__(self) -> None:
        self._buffers: dict[nn.Parameter, torch.Tensor] = {}
        self._filled_for = None
        self._filled_versions: list[int] = []

    @contextlib.contextmanager
    def __call__(self, shift) -> Iterator[None]:
        if shift is None:
            yield
            return
        params = list(shift.directions)
        buffers = [self._buffers.setdefault(p, torch.empty_like(p, requires_grad=False)) for p in params]
        versions = [p._version for p in params]
        if self._filled_for is not shift or self._filled_versions != versions:
            with torch.no_grad():
                for param, buffer in zip(params, buffers, strict=True):
                    torch.add(param, shift.directions[param], alpha=shift.scale, out=buffer)
            self._filled_for, self._filled_versions = shift, versions
        originals = [p.data for p in params]
        for param, buffer in zip(params, buffers, strict=True):
            param.data = buffer
        try:
            yield
        finally:
            for param, original in zip(params, originals, strict=True):
                param.data = original
