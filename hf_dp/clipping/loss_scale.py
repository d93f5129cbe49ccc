"""fp16 autocast under DP with a fixed loss scale S (``fp16=True``; docs/clipping.md, "Low precision").

fp16 keeps 5 exponent bits: an activation gradient below 2^-24 rounds to 0, above 65504 to inf. The DP step
back-propagates S·L_i instead of L_i, so that every activation gradient is S times larger, and unscales each
per-example gradient before it is clipped: the norms are ‖S g_i‖ / S (float32), the clipped sum is
Σ_i (c_i / S)·(S g_i), and a weighted backward of S·Σ_i c_i L_i has its float32 ``.grad`` divided by S.
S is a fixed power of two (the divisions are exact), chosen before training: unlike a dynamic GradScaler
nothing backs off and no step is skipped on the unnoised gradient. An example whose scaled gradient
overflowed gets c_i = 0 (``ClippingEngine.clip_factors``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.per_example import LossFn

# A token's logit gradient is S·(softmax − onehot)/T_i (L_i is a mean over its T_i tokens): up to S for a
# one-token example, and deeper activation gradients reached 2.8·S (Llama 4×256, V 32000, T 128), so 2^15
# overflows one such example. The clipped sum's error against float64 is flat from S = 2^4 to 2^12 there
# (both paths); 2^10 keeps 22× headroom below overflow and 2^6 above that flat start, for the smaller
# per-token gradients of larger V·T (docs/clipping.md, "Low precision").
DEFAULT_FP16_LOSS_SCALE = 2.0**10


def check_loss_scale(scale: float) -> None:
    """S = 2^k for an integer k (dividing by it is exact), or a one-line error."""
    if not (
        isinstance(scale, int | float) and math.isfinite(scale) and scale > 0 and math.frexp(scale)[0] == 0.5
    ):
        raise ValueError(
            f"DPTrainingArguments: dp_fp16_loss_scale must be a positive power of two, got {scale!r} (the "
            f"per-example gradients are divided by it, exactly only for 2^k): use e.g. {DEFAULT_FP16_LOSS_SCALE:g}"
        )


@dataclass(frozen=True)
class LossScale:
    """S, and the device type whose fp16 autocast the DP forward passes run under; ``LossScale.NONE`` (S = 1, no
    autocast) is the identity. The one place that knows S: the clipping parts see S·L_i and their backward's
    ``.grad`` through it, and the engine never does."""

    NONE: ClassVar[LossScale]

    scale: float
    device_type: str | None  # None: no fp16 autocast

    def __post_init__(self) -> None:
        check_loss_scale(self.scale)

    @staticmethod
    def of(backend: Backend) -> LossScale:
        """The run's fixed fp16 loss scale, or the identity."""
        if backend.fp16_loss_scale is None:
            return LossScale.NONE
        return LossScale(backend.fp16_loss_scale, backend.device_type)

    def wrap(self, losses_of: LossFn) -> LossFn:
        """S·L_i (in at least float32) from a forward under fp16 autocast; the backward, the norms and the clipped
        sum run outside autocast (the layer rules compute in float32)."""
        if self.device_type is None:
            return losses_of

        def forward(module: nn.Module) -> torch.Tensor:
            with torch.autocast(self.device_type, dtype=torch.float16):
                losses = losses_of(module)
            return losses.to(torch.promote_types(losses.dtype, torch.float32)) * self.scale

        return forward

    def unscale(self, scaled: torch.Tensor) -> torch.Tensor:
        """x from S·x: the norms ‖S g_i‖ / S = ‖g_i‖, and the losses S·L_i / S for logging (exact: S = 2^k; S = 1
        returns ``scaled`` itself, no launch)."""
        return scaled if self.scale == 1 else scaled / self.scale

    def weights(self, factors: torch.Tensor) -> torch.Tensor:
        """c_i / S: the weights of the S-scaled per-example gradients S g_i, so Σ_i (c_i / S)(S g_i) = Σ_i c_i g_i
        (S = 1: ``factors`` themselves)."""
        return factors if self.scale == 1 else factors / self.scale

    @contextlib.contextmanager
    def unscaled_gradients(self, params: list[nn.Parameter]) -> Iterator[None]:
        """What a backward inside the block writes to ``.grad`` is divided by S (exact) and added to the gradients
        already there: autograd's S·Σ_i c_i g_i lands as Σ_i c_i g_i. The fp16 weight gradients of that backward
        sum the batch (at most S·B·C); one that overflowed stops training in one line."""
        if self.scale == 1:
            yield
            return
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
            for p in params:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    raise FloatingPointError(
                        f"the weighted backward's fp16 weight gradient (S·Σ_i c_i g_i, S = {self.scale:g}) "
                        "overflowed; lower dp_fp16_loss_scale or per_device_train_batch_size (S·B·C must stay "
                        "below 65504)"
                    )
        finally:
            for p, old in zip(params, kept, strict=True):
                new = None if p.grad is None else p.grad.div_(self.scale)
                p.grad = old if new is None else (new if old is None else old.add_(new))


LossScale.NONE = LossScale(1.0, None)
