"""The clipped sums of a logical batch: how they are written, and the explicit value the mechanism receives.

A float32 (or float64) parameter's clipped sum Σ_i c_i g_i lives in its ``.grad``. A bf16/fp16 parameter's is
kept in float32 beside it (``wide``), so that the noise is added in float32 and only the released ĝ is cast
(a noise draw in bf16 would itself be quantised: docs/clipping.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_dp.clipping.geometry import ClippingFn, clip_factors
from hf_dp.clipping.per_example import Dropped, Folded, PerExampleGradient, Weighted, summed_dtype
from hf_dp.clipping.wide_gemm import LOW_PRECISION

# per parameter id: the parameter and its weighted per-example parts (uses, evaluations)
Terms = dict[int, tuple[nn.Parameter, list[Weighted]]]


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
        dtype = summed_dtype(param.dtype)
        if param.grad is not None:
            return param.grad if param.grad.dtype == dtype else param.grad.float()
        return torch.zeros_like(param, dtype=dtype)


def _not_finite(x: torch.Tensor) -> torch.Tensor:
    """~isfinite(x) as ~(|x| < inf) (nan compares false): three operators where ``torch.isfinite`` and ~ take five."""
    return ~(x.abs() < math.inf)


@dataclass(frozen=True)
class Clipped:
    """A micro-batch's clip factors c_i · mask_i and what its sums leave out, decided together (``SumWriter.clip``):
    ``overflowed`` the examples whose norm is not finite (book-keeping's and the kept sums drop their rows),
    ``dropped`` those whose factor is 0 (the tail's sums); ``bad_losses``: a real unit's loss is not finite."""

    factors: torch.Tensor
    overflowed: Dropped
    dropped: Dropped
    bad_losses: bool = False


class SumWriter:
    """Writes the clipped sum Σ_i c_i g_i of a logical batch: c_i from the norms, then Σ_i w_i G_i per parameter
    into ``.grad``, or for a bf16/fp16 parameter into its float32 sum, which the mechanism noises in float32
    before the one cast; ``take()`` hands the sums to the release."""

    def __init__(self, clipping_fn: ClippingFn) -> None:
        self.clipping_fn = clipping_fn
        self.nonfinite_examples = 0  # examples clipped to zero because their gradient overflowed
        self.low_precision: dict[nn.Parameter, torch.Tensor] = {}  # the float32 sums of bf16/fp16 parameters

    def _factors(self, norms: torch.Tensor, overflowed: torch.Tensor, clip_norm: float) -> torch.Tensor:
        """c_i at ``clip_norm`` (geometry.clip_factors); 0 for an example whose gradient is not finite (an overflow
        in low precision, ``overflowed``; its c_i, nan or 0, is overwritten): it then contributes nothing, within
        the sensitivity C."""
        if not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        return clip_factors(norms, clip_norm, self.clipping_fn).masked_fill_(overflowed, 0.0)

    def clip(
        self,
        norms: torch.Tensor,
        clip_norm: float,
        mask: torch.Tensor,
        losses: torch.Tensor | None = None,
    ) -> Clipped:
        """A micro-batch's c_i · mask_i (``_factors``) and, from ONE host read (a device synchronisation)
        whatever the number of parameters: the examples whose norm is not finite (counted in
        ``nonfinite_examples``), those whose factor is 0, and with ``losses`` whether a real unit's loss is not
        finite. The read is one integer, n_nonfinite + (B + 1)·n_zero + (B + 1)²·n_bad_losses."""
        overflowed = _not_finite(norms)
        factors = self._factors(norms, overflowed, clip_norm) * mask.to(norms.dtype)
        dropped = factors == 0
        base = norms.shape[0] + 1
        code = torch.add(overflowed.sum(), dropped.sum(), alpha=base)
        if losses is not None:
            code = code.add_((_not_finite(losses) & mask.bool()).sum(), alpha=base * base)
        value = int(code)
        nonfinite, zero, bad_losses = value % base, value // base % base, value // (base * base)
        self.nonfinite_examples += nonfinite
        return Clipped(
            factors,
            Dropped(overflowed if nonfinite else None),
            Dropped(dropped if zero else None),
            bad_losses > 0,
        )

    def add(
        self,
        param: nn.Parameter,
        part: PerExampleGradient,
        weights: torch.Tensor,
        folded: Folded | None = None,
    ) -> None:
        """The clipped sum += Σ_i w_i G_i (``folded``: the delivery's memo of a scaled input, per_example.py)."""
        if param.dtype not in LOW_PRECISION:
            param.grad = part.accumulate(param.grad, weights, param, folded)
            return
        wide = self.low_precision.get(param)
        like = (
            wide if wide is not None else torch.empty(param.shape, dtype=torch.float32, device=param.device)
        )
        self.low_precision[param] = part.accumulate(wide, weights, like, folded)

    def add_total(self, param: nn.Parameter, total: torch.Tensor) -> None:
        """The clipped sum += an already formed Σ_i c_i G_i (float32 or wider; group-wise clipping)."""
        if param.dtype in LOW_PRECISION:
            wide = self.low_precision.get(param)
            self.low_precision[param] = total if wide is None else wide.add_(total)
        elif param.grad is None:
            param.grad = total.to(param.dtype)
        else:
            param.grad.add_(total.to(param.dtype))

    def read_groups(
        self, norms: torch.Tensor, mask: torch.Tensor, losses: torch.Tensor | None = None
    ) -> bool:
        """Group-wise clipping, whose sums the backward formed: in ONE host read, the examples with a norm that is
        not finite in some group (counted in ``nonfinite_examples``; their factor was 0 there) and, with
        ``losses``, whether a real unit's loss is not finite."""
        base = norms.shape[0] + 1
        code = (~torch.isfinite(norms).all(dim=1)).sum()
        if losses is not None:
            code = code.add((~torch.isfinite(losses) & mask.bool()).sum(), alpha=base)
        value = int(code)
        self.nonfinite_examples += value % base
        return value // base > 0

    def move_from_gradients(self, params: list[nn.Parameter]) -> None:
        """After autograd wrote a micro-batch's clipped sum into a bf16/fp16 ``.grad``: add it to the float32 sum."""
        for param in params:
            if param.dtype in LOW_PRECISION and param.grad is not None:
                wide = self.low_precision.get(param)
                grad = param.grad.float()
                self.low_precision[param] = grad if wide is None else wide.add_(grad)
                param.grad = None

    def take(self) -> ClippedSums:
        """The logical batch's clipped sums for the release; the float32 sums start empty again."""
        sums, self.low_precision = ClippedSums(self.low_precision), {}
        return sums
