"""Per-example gradients of one parameter use, kept in the cheapest exact form.

A layer's per-example weight gradient is a sum over positions of outer products, G_i = Σ_t u_{i,t} ⊗ v_{i,t}
(Linear: u = output gradient, v = input). Its squared norm is Σ_{t,t'} ⟨u_t, u_t'⟩⟨v_t, v_t'⟩ (the "ghost"
Gram form of Goodfellow 2015 and Li et al. 2022), or ‖G_i‖² from the materialised G_i when that is cheaper
(Bu et al. 2023, book-keeping). The clipped sum Σ_i c_i G_i is one GEMM over (example, position) pairs.

The factors are kept in the precision the layer's own backward multiplied them in (bf16/fp16 under autocast or
low-precision weights); their products are summed and returned in float32 or wider (wide_gemm.py).

``combined_squared_norm``: ‖s ⊙ Σ_k w_k G^k_i‖² of weighted uses of one parameter (tied uses, DiSK's points)
in a clip geometry s (docs/clipping.md): a rank-1 s = r cᵀ scales the two factors, a dense s scales embedding
rows and vectors exactly and otherwise needs the explicit per-example gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Union

import torch

from hf_dp.clipping.geometry import ClipScale, FactoredScale, dense_scale, unsharded
from hf_dp.clipping.wide_gemm import (
    dots,
    gram,
    matmul_factors,
    on_tensor_cores,
    weighted_outer_sum_bf16x3,
    wide,
    wide_bmm,
)

if TYPE_CHECKING:
    from hf_dp.clipping.experts import RoutedOuterProductSum

# a micro-batch's per-example losses (U,) from a forward of the module given (bare, or as a framework wrapped it)
LossFn = Callable[[torch.nn.Module], torch.Tensor]

# Materialised per-example gradients are built this many floats at a time (about 256 MB).
_CHUNK_FLOATS = 64 * 1024 * 1024
# Writing and reading back an explicit G_i costs like this many more positions of its GEMM (2 CPU cores, Llama
# shapes at T 512: a 32000×512 head 0.24 s explicit vs 0.18 s by the Gram; a 512×512 layer 4.2 vs 6.8 ms).
MATERIALISE_OVERHEAD_STEPS = 256


@dataclass
class OuterProductSum:
    """G_i = Σ_t left_{i,t} ⊗ right_{i,t}, shaped like the parameter (rows × cols).

    ``left`` is dense (B, T, rows) or, for embeddings, integer row ids (B, T) standing for one-hot rows.
    """

    left: torch.Tensor
    right: torch.Tensor
    rows: int

    @property
    def is_index(self) -> bool:
        return not self.left.is_floating_point()

    @property
    def batch_size(self) -> int:
        return self.right.shape[0]

    def left_gram(self, other: OuterProductSum) -> torch.Tensor:
        """(B, T, T') with entries ⟨left_t, other.left_t'⟩."""
        if self.is_index and other.is_index:
            return (self.left[:, :, None] == other.left[:, None, :]).to(
                torch.float64 if self.right.dtype == torch.float64 else torch.float32  # no dispatcher call
            )
        if self.is_index:
            return other.left_gram(self).transpose(1, 2)
        if other.is_index:
            index = other.left[:, None, :].expand(-1, self.left.shape[1], -1)
            return wide(torch.gather(self.left, 2, index))
        return gram(self.left, other.left)

    def inner(self, other: OuterProductSum, into: torch.Tensor | None = None) -> torch.Tensor:
        """⟨G_i, G'_i⟩ per example, by the Gram identity (``into``: added to it, ``dots``)."""
        return dots(self.left_gram(other), gram(self.right, other.right), into)

    def gram_is_cheaper(self, other: OuterProductSum | None = None) -> bool:
        """The (cross-)Gram costs T·T'(rows + cols) per example, materialising both sides (T + T')·rows·cols, and
        materialising G_i for its own norm (``other`` None) about (T + 256)·rows·cols; with one-hot rows the Gram
        is a gather and always cheaper."""
        if self.is_index or (other is not None and other.is_index):
            return True
        rows, cols = self.left.shape[2], self.right.shape[2]
        steps = self.left.shape[1]
        if other is None:
            return steps * steps * (rows + cols) <= (steps + MATERIALISE_OVERHEAD_STEPS) * rows * cols
        other_steps = other.left.shape[1]
        return steps * other_steps * (rows + cols) <= (steps + other_steps) * rows * cols

    def squared_norm(self, materialise: bool, into: torch.Tensor | None = None) -> torch.Tensor:
        """‖G_i‖² per example, by the Gram or from the explicit G_i (``into``: added to it, ``dots``)."""
        if materialise or not self.gram_is_cheaper():
            bounds = example_chunks(self.batch_size, self.rows * self.right.shape[2])
            parts = [into if into is None else into[a:b] for a, b in bounds]
            chunks = [dots(g, g, part) for g, part in zip(self.materialise_chunks(), parts, strict=True)]
            if into is not None:
                return into
            return chunks[0] if len(chunks) == 1 else torch.cat(chunks)  # one chunk: no copy
        return self.inner(self, into)

    def materialise(self, start: int, stop: int) -> torch.Tensor:
        """The explicit per-example gradients (stop − start, rows, cols) of examples start..stop, float32 or wider."""
        if self.is_index:
            right = wide(self.right[start:stop])
            grads = right.new_zeros(stop - start, self.rows, right.shape[2])
            return grads.scatter_add_(1, self.left[start:stop, :, None].expand(-1, -1, right.shape[2]), right)
        return wide_bmm(self.left[start:stop].transpose(1, 2), self.right[start:stop])

    def explicit(self, shape: torch.Size) -> Materialised:
        """All B explicit per-example gradients, shaped (B, *shape)."""
        return Materialised(self.materialise(0, self.batch_size).reshape(-1, *shape))

    def materialise_chunks(self) -> Iterator[torch.Tensor]:
        """Yield the explicit per-example gradients (b, rows, cols) a few examples at a time."""
        for start, stop in example_chunks(self.batch_size, self.rows * self.right.shape[2]):
            yield self.materialise(start, stop)

    def scaled(self, scale: ClipScale) -> OuterProductSum | None:
        """s ⊙ G_i in the same form when that is exact: a rank-1 s = r cᵀ scales left by r and right by c;
        with one-hot rows a dense s scales right_t by row x_t of s. None for a dense s on dense factors."""
        if not isinstance(scale, FactoredScale) and not self.is_index:
            return None
        right = wide(self.right)
        if isinstance(scale, FactoredScale):
            rows, cols = scale.rows.to(right), scale.cols.to(right)
            if self.is_index:
                return OuterProductSum(self.left, right * rows[self.left][:, :, None] * cols, self.rows)
            return OuterProductSum(wide(self.left) * rows, right * cols, self.rows)
        return OuterProductSum(self.left, right * scale.to(right)[self.left], self.rows)

    def without_examples(self, drop: torch.Tensor, zeroed: Zeroed | None = None) -> OuterProductSum:
        """The same sum with G_i = 0 for the examples in ``drop`` (B,), bool; ``zeroed``: the input side set to 0
        once for consecutive uses of one input (q, k and v share theirs)."""
        right = zeroed(self.right) if zeroed is not None else self.right.masked_fill(drop[:, None, None], 0.0)
        left = self.left if self.is_index else self.left.masked_fill(drop[:, None, None], 0.0)
        return OuterProductSum(left, right, self.rows)

    def project(self, direction: torch.Tensor) -> torch.Tensor:
        """⟨G_i, V⟩ = Σ_t left_tᵀ V right_t per example, V shaped like the parameter."""
        right = wide(self.right)
        v = direction.reshape(self.rows, -1).to(right)
        along = v[self.left] if self.is_index else wide(self.left) @ v
        return (along * right).sum(dim=(1, 2))

    def accumulate(
        self,
        grad: torch.Tensor | None,
        weights: torch.Tensor,
        like: torch.Tensor | Like,
        folded: Folded | None = None,
    ) -> torch.Tensor:
        """grad + Σ_i w_i G_i (grad None: a fresh tensor shaped like ``like``), as one GEMM written in place
        (one index_add for embeddings), with w folded into the smaller side, or into the right side ``folded``
        already holds scaled (uses sharing their input), at float32's accuracy or wider: the weights are clip
        factors, which bf16 would round up as often as down. bf16 factors on CUDA take three tensor-core GEMMs
        (``bf16_pieces``), the rest one GEMM of the factors widened."""
        if not self.is_index and self.left.dtype == torch.bfloat16 and on_tensor_cores(self.left, self.right):
            fresh = weighted_outer_sum_bf16x3(self.left, self.right, weights).view(like.shape).to(like.dtype)
            return fresh if grad is None else grad.add_(fresh)
        left, right = wide(self.left), wide(self.right)
        cols = right.shape[2]
        clip_weights, weights = weights, weights.to(right.dtype)
        in_place = grad is not None and grad.dtype == right.dtype
        if self.is_index:
            if grad is None:
                grad = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
                in_place = grad.dtype == right.dtype
            target = grad.view(self.rows, cols) if in_place else right.new_zeros(self.rows, cols)
            target.index_add_(0, left.reshape(-1), (right * weights[:, None, None]).reshape(-1, cols))
            return grad if in_place else grad.add_(target.view(like.shape).to(grad.dtype))
        folded = folded if folded is not None else Folded()
        if folded.holds(self.right, clip_weights) or right.shape[2] <= left.shape[2]:
            right = folded.scaled(self.right, right, clip_weights)
        else:
            left = left * weights[:, None, None]
        left, right = left.reshape(-1, left.shape[2]), right.reshape(-1, cols)
        if in_place:
            grad.view(self.rows, cols).addmm_(left.T, right)
            return grad
        fresh = (left.T @ right).view(like.shape).to(like.dtype)
        return fresh if grad is None else grad.add_(fresh)


def linear_parts(
    x: torch.Tensor, grad_out: torch.Tensor, out_features: int, bias: bool
) -> dict[str, PerExampleGradient]:
    """y = x Wᵀ + b, x and ∂y laid out (B, …, d) per example:  G_i(W) = Σ_t ∂y_t ⊗ x_t,  G_i(b) = Σ_t ∂y_t, the
    factors in the precision the layer's weight gradient multiplied them (``matmul_factors``)."""
    a, g = matmul_factors(x, grad_out)
    parts: dict[str, PerExampleGradient] = {"weight": OuterProductSum(left=g, right=a, rows=out_features)}
    if bias:
        parts["bias"] = Materialised(g.sum(dim=1, dtype=torch.promote_types(g.dtype, torch.float32)))
    return parts


class Folded:
    """The last factor side that clip weights w scaled, w_i x_{i,t}, kept for the next use of the same input x with
    the same w (q, k and v share theirs, as gate and up do): one delivery's memo, one tensor at a time."""

    def __init__(self) -> None:
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (x, w, w ⊙ x widened)

    def holds(self, side: torch.Tensor, weights: torch.Tensor) -> bool:
        """Whether ``side`` (the same view of the same memory as the last) was scaled by these ``weights``."""
        last = self._last
        return last is not None and last[1] is weights and _view(last[0]) == _view(side)

    def scaled(self, side: torch.Tensor, widened: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """w_i · side_{i,t} (``widened``: side in float32 or wider), formed once for consecutive uses of ``side``."""
        if not self.holds(side, weights):
            self._last = (side, weights, widened * weights.to(widened.dtype)[:, None, None])
        return self._last[2]


def _view(x: torch.Tensor) -> tuple:
    """What makes two tensors the same view of the same memory."""
    return x.data_ptr(), x.dtype, x.shape, x.stride()


@dataclass
class Materialised:
    """Explicit per-example gradients (B, *param.shape); used for vectors and the torch.func fallback."""

    grads: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.grads.shape[0]

    def squared_norm(self, materialise: bool = True, into: torch.Tensor | None = None) -> torch.Tensor:
        """‖G_i‖² (already explicit: ``materialise`` is accepted for the common interface; ``into``: added to it)."""
        return dots(self.grads, self.grads, into)

    def materialise(self, start: int, stop: int) -> torch.Tensor:
        return self.grads[start:stop]

    def explicit(self, shape: torch.Size) -> Materialised:
        return self

    def without_examples(self, drop: torch.Tensor, zeroed: Zeroed | None = None) -> Materialised:
        """G_i = 0 for the examples in ``drop`` (B,), bool (``zeroed`` unused: nothing shared)."""
        return Materialised(self.grads.masked_fill(drop.view(-1, *[1] * (self.grads.dim() - 1)), 0.0))

    def project(self, direction: torch.Tensor) -> torch.Tensor:
        """⟨G_i, V⟩ per example."""
        return self.grads.flatten(1) @ direction.flatten().to(self.grads)

    def scaled(self, scale: ClipScale) -> Materialised:
        return Materialised(self.grads * dense_scale(scale).to(self.grads))

    def accumulate(
        self,
        grad: torch.Tensor | None,
        weights: torch.Tensor,
        like: torch.Tensor | Like,
        folded: Folded | None = None,
    ) -> torch.Tensor:
        """grad + Σ_i w_i G_i (grad None: a fresh tensor shaped like ``like``; ``folded`` unused: one GEMM)."""
        fresh = (
            torch.tensordot(weights.to(self.grads.dtype), self.grads, dims=1).view(like.shape).to(like.dtype)
        )
        return fresh if grad is None else grad.add_(fresh)


PerExampleGradient = Union[OuterProductSum, Materialised, "RoutedOuterProductSum"]  # the last: experts.py
Weighted = tuple[float, PerExampleGradient]


@dataclass(frozen=True)
class Dropped:
    """The examples a clipped sum leaves out, their rows set to 0 before the products (0 · inf would be nan):
    ``examples`` (B,) bool, or None when there are none. Whether there are any is a host read (a device
    synchronisation), so it is decided once for a micro-batch and handed to every parameter's sum."""

    examples: torch.Tensor | None = None
    # the last input side set to 0 (the side itself, kept so that its memory is not another's; the side set to 0)
    _last: list[torch.Tensor] = field(default_factory=list, compare=False, repr=False)

    @staticmethod
    def where(drop: torch.Tensor) -> Dropped:
        """The examples marked in ``drop`` (B,), bool: one host read."""
        return Dropped(drop if bool(drop.any()) else None)

    def apply(self, part: PerExampleGradient) -> PerExampleGradient:
        """``part`` without the dropped examples (as it is when there are none)."""
        return part if self.examples is None else part.without_examples(self.examples, self.zeroed)

    def zeroed(self, side: torch.Tensor) -> torch.Tensor:
        """``side`` (B, …) with the dropped examples' rows 0, made once for consecutive uses of the same view."""
        if not (self._last and _view(self._last[0]) == _view(side)):
            drop = self.examples.view(-1, *[1] * (side.dim() - 1))
            self._last[:] = [side, side.masked_fill(drop, 0.0)]
        return self._last[1]


Zeroed = Callable[[torch.Tensor], torch.Tensor]


def clipped_total(
    param: torch.Tensor,
    weighted: Sequence[Weighted],
    factors: torch.Tensor,
    dropped: Dropped | None = None,
    folded: Folded | None = None,
) -> torch.Tensor:
    """Σ_e w_e Σ_i c_i G_i^e of one parameter as a fresh tensor, float32 or wider, without the examples whose c_i
    is 0 (0 · inf would be nan): ``dropped``, or decided here from ``factors``; ``folded``: the memo of a side
    scaled by the factors, shared by consecutive parameters (``Folded``)."""
    dropped = dropped if dropped is not None else Dropped.where(factors == 0)
    # the parameter's shape and device, its data unread (FSDP2 frees an unsharded weight's)
    like = Like(param.shape, summed_dtype(param.dtype), param.device)
    total = None
    with torch.no_grad():
        for weight, part in weighted:
            part = dropped.apply(part)
            total = part.accumulate(total, factors if weight == 1 else weight * factors, like, folded)
    return total


class Like(NamedTuple):
    """What a fresh sum is shaped like, without a tensor (a call through torch's dispatcher, a launch on a device)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def summed_dtype(dtype: torch.dtype) -> torch.dtype:
    """torch.promote_types(dtype, torch.float32) for a parameter's dtype, computed on the host: the dtype its
    clipped sum is formed in."""
    return dtype if dtype == torch.float64 or dtype.is_complex else torch.float32


def example_chunks(batch: int, floats_per_example: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK_FLOATS // max(1, floats_per_example))
    for start in range(0, batch, step):
        yield start, min(batch, start + step)


def combined_squared_norm(
    terms: Sequence[Weighted],
    scale: ClipScale | None,
    shape: torch.Size,
    materialise: bool,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """‖s ⊙ Σ_k w_k G^k_i‖² per example, exactly. One term: its own cheapest form. Several: Σ_{k,l} w_k w_l
    ⟨G^k_i, G^l_i⟩ by cross-Grams when every pair's Gram is cheaper, else from the explicit weighted sum;
    a scale s is folded into the factors first, and a dense s on dense factors needs the explicit sum.
    ``into`` (B,): the squared norm added to it in place (one buffer for all parameters) and returned."""
    if scale is not None:
        scale = unsharded(scale)
        scaled = [(weight, part.scaled(scale)) for weight, part in terms]
        if any(part is None for _, part in scaled):
            return _added(_explicit_squared_norm(terms, shape, dense_scale(scale)), into)
        terms = scaled
    if len(terms) == 1:
        weight, part = terms[0]
        if weight == 1:  # × 1 would be one more launch
            return part.squared_norm(materialise, into)
        return _added(weight * weight * part.squared_norm(materialise), into)
    return _added(_cross_squared_norm(terms, shape, materialise), into)


def _added(squared: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """``squared``, added to ``into`` when given."""
    return squared if into is None else into.add_(squared.to(into))


def _cross_squared_norm(terms: Sequence[Weighted], shape: torch.Size, materialise: bool) -> torch.Tensor:
    """‖Σ_k w_k G^k_i‖² of several terms: by cross-Grams when every pair's is cheaper, else explicitly."""
    parts = [part for _, part in terms]
    by_grams = not materialise and all(
        isinstance(a, OuterProductSum) and isinstance(b, OuterProductSum) and a.gram_is_cheaper(b)
        for k, a in enumerate(parts)
        for b in parts[k:]
    )
    if not by_grams:
        return _explicit_squared_norm(terms, shape)
    total = 0
    for k, (weight, part) in enumerate(terms):
        for n, (other_weight, other) in enumerate(terms[k:]):
            total = total + (1 if n == 0 else 2) * weight * other_weight * part.inner(other)
    return total


def _explicit_squared_norm(
    terms: Sequence[Weighted], shape: torch.Size, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """‖s ⊙ Σ_k w_k G^k_i‖² from the explicit per-example gradients, a few examples at a time."""
    norms = []
    for start, stop in example_chunks(terms[0][1].batch_size, shape.numel()):
        (weight, part), rest = terms[0], terms[1:]
        grads = weight * part.materialise(start, stop).reshape(-1, *shape)
        for weight, part in rest:
            grads.add_(part.materialise(start, stop).reshape(-1, *shape), alpha=weight)
        if scale is not None:
            grads.mul_(scale.to(grads))
        norms.append(grads.flatten(1).pow_(2).sum(dim=1))
    return torch.cat(norms)
