"""Products of per-example gradient factors, summed and returned in float32 or wider.

The factors are kept in the precision the layer's own backward multiplied them in: bf16/fp16 under autocast or
low-precision weights. Two such values multiply exactly in float32, so every Gram, norm and explicit G_i is
summed and returned in float32 (on CUDA by tensor-core GEMMs with float32 accumulation and output). Every
product with a float32 weight, scale or direction is taken at float32's accuracy: the clipped sum's weighted
side is split into three bf16 pieces on CUDA (``bf16_pieces``), elsewhere the factors are widened first.
"""

from __future__ import annotations

import contextlib
from functools import cache

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or as it is when float32/float64 (or integer ids)."""
    return x if x.dtype in (torch.float32, torch.float64) or not x.is_floating_point() else x.float()


def matmul_factors(x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, ∂y) as (B, T, d), every middle dimension folded into T, in the precision the layer's weight gradient
    multiplied them: a bf16/fp16 ∂y means the layer ran in bf16/fp16 (autocast casts x, or the weights are low
    precision), else float32 or wider."""
    a, g = x.reshape(x.shape[0], -1, x.shape[-1]), grad_out.reshape(grad_out.shape[0], -1, grad_out.shape[-1])
    if g.dtype in LOW_PRECISION:
        return a.to(g.dtype), g
    return wide(a), wide(g)


@cache
def _cuda_has_wide_gemm() -> bool:
    """Whether this torch multiplies bf16 matrices into a float32 output on CUDA (``mm``/``bmm(..., out_dtype=)``)."""
    try:
        x = torch.ones(1, 1, 1, dtype=torch.bfloat16, device="cuda")
        outputs = torch.bmm(x, x, out_dtype=torch.float32), torch.mm(x[0], x[0], out_dtype=torch.float32)
        return all(out.dtype == torch.float32 for out in outputs)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def on_tensor_cores(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two bf16/fp16 operands of one dtype on CUDA, where a GEMM can accumulate and return them in float32."""
    return a.dtype in LOW_PRECISION and a.dtype == b.dtype and a.is_cuda and _cuda_has_wide_gemm()


def wide_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b per batch entry, summed and returned in float32 or wider. Two bf16/fp16 operands of one dtype run on
    CUDA as one tensor-core GEMM with float32 accumulation and output; elsewhere they are widened first (the
    same exact products, summed in another order)."""
    if on_tensor_cores(a, b):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(wide(a), wide(b))


def gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, T, T') with entries ⟨a_t, b_t'⟩, as ``wide_bmm``; a factor paired with itself is widened once."""
    if on_tensor_cores(a, b):
        return torch.bmm(a, b.transpose(1, 2), out_dtype=torch.float32)
    a_wide = wide(a)
    return torch.bmm(a_wide, (a_wide if b is a else wide(b)).transpose(1, 2))


def dots(a: torch.Tensor, b: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """⟨a_i, b_i⟩ per example i (a, b shaped (B, ...)), as one batched GEMM in float32 or wider (outside autocast,
    which makes a Gram of the backward bf16); ``into`` (B,): added to it in place (into_i += ⟨a_i, b_i⟩, the norms
    of all layers summed in one buffer, no temporary per layer)."""
    a, b = wide(a.reshape(a.shape[0], 1, -1)), wide(b.reshape(b.shape[0], -1, 1))
    if a.dtype != b.dtype:  # float32 beside float64
        a, b = a.double(), b.double()
    autocast = torch.is_autocast_enabled(a.device.type)
    with torch.autocast(a.device.type, enabled=False) if autocast else contextlib.nullcontext():
        if into is None:
            return torch.bmm(a, b).view(-1)
        if into.dtype == a.dtype and into.is_contiguous():
            into.view(-1, 1, 1).baddbmm_(a, b)
        else:
            into += torch.bmm(a, b).view(-1).to(into)
    return into


def bf16_pieces(x: torch.Tensor) -> list[torch.Tensor]:
    """A float32 x as three bf16 tensors whose sum is x exactly (8 + 8 + 8 significand bits, while |x| ≥ 2^-110
    keeps the third piece normal; the bf16x3 split of Henry, Tang & Heinecke 2019): a float32 operand on bf16
    tensor cores at float32 accuracy."""
    pieces = []
    for _ in range(3):
        pieces.append(x.to(torch.bfloat16))
        x = x - pieces[-1].float()
    return pieces


def weighted_outer_sum_bf16x3(left: torch.Tensor, right: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_{i,t} w_i left_{i,t} ⊗ right_{i,t} for bf16 factors on CUDA, float32: w folded into the smaller side in
    float32, that side split into three bf16 pieces, three tensor-core GEMMs with float32 accumulation."""
    fold_left = left.shape[2] <= right.shape[2]
    weighted = (left if fold_left else right).float() * weights.float()[:, None, None]
    other = (right if fold_left else left).flatten(0, 1)
    total = None
    for piece in bf16_pieces(weighted.flatten(0, 1)):
        a, b = (piece, other) if fold_left else (other, piece)
        product = torch.mm(a.T, b, out_dtype=torch.float32)
        total = product if total is None else total.add_(product)
    return total
