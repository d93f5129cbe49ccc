"""Evaluating one micro-batch more than once: the same dropout masks, and parameters at θ + shift.

DiSK (Zhang et al.) evaluates every example at θ + γd and at θ and clips the combination once
(norm_passes.EvaluatedNorms); a weighted pass runs the norm pass's forward again. Both need the second pass to
see the first one's randomness, and the shifted pass must leave θ exactly as it was (θ + δ − δ ≠ θ in floating
point).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

RngState = tuple[torch.Tensor, list[torch.Tensor]]


def rng_state() -> RngState:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return torch.get_rng_state(), cuda


def replay_rng(state: RngState) -> None:
    """Restore the global generators, so the next pass draws the same dropout masks as the recorded one."""
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


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
