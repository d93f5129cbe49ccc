"""Per-example gradients of one parameter use, kept in the cheapest exact form.

A layer's per-example weight gradient is a sum over positions of outer products,
G_i = Σ_t u_{i,t} ⊗ v_{i,t} (Linear: u = output gradient, v = input). Its squared norm is
Σ_{t,t'} ⟨u_t, u_t'⟩⟨v_t, v_t'⟩ (the "ghost" Gram form of Goodfellow 2015 and Li et al. 2022),
or ‖G_i‖² from the materialised G_i when that is cheaper (Bu et al. 2023, book-keeping).
The clipped sum Σ_i c_i G_i is one GEMM over (example, position) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Materialised per-example gradients are built this many floats at a time (about 256 MB).
_CHUNK_FLOATS = 64 * 1024 * 1024


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
            return (self.left[:, :, None] == other.left[:, None, :]).to(self.right.dtype)
        if self.is_index:
            return other.left_gram(self).transpose(1, 2)
        if other.is_index:
            index = other.left[:, None, :].expand(-1, self.left.shape[1], -1)
            return torch.gather(self.left, 2, index)
        return torch.bmm(self.left, other.left.transpose(1, 2))

    def inner(self, other: OuterProductSum) -> torch.Tensor:
        """⟨G_i, G'_i⟩ per example, by the Gram identity."""
        right_gram = torch.bmm(self.right, other.right.transpose(1, 2))
        return (self.left_gram(other) * right_gram).sum(dim=(1, 2))

    def gram_is_cheaper(self) -> bool:
        """Gram costs T²(rows + cols) per example, the materialised gradient T·rows·cols."""
        if self.is_index:
            return True
        steps, rows, cols = self.left.shape[1], self.left.shape[2], self.right.shape[2]
        return steps * (rows + cols) <= rows * cols

    def squared_norm(self, materialise: bool) -> torch.Tensor:
        if materialise or not self.gram_is_cheaper():
            return torch.cat([g.pow(2).sum(dim=(1, 2)) for g in self.materialise_chunks()])
        return self.inner(self)

    def materialise_chunks(self):
        """Yield the explicit per-example gradients (b, rows, cols) a few examples at a time."""
        batch, rows, cols = self.batch_size, self.rows, self.right.shape[2]
        step = max(1, _CHUNK_FLOATS // max(1, rows * cols))
        for start in range(0, batch, step):
            stop = min(batch, start + step)
            if self.is_index:
                grads = self.right.new_zeros(stop - start, rows, cols)
                grads.scatter_add_(
                    1, self.left[start:stop, :, None].expand(-1, -1, cols), self.right[start:stop]
                )
            else:
                grads = torch.bmm(self.left[start:stop].transpose(1, 2), self.right[start:stop])
            yield grads

    def accumulate(
        self, grad: torch.Tensor | None, weights: torch.Tensor, like: torch.Tensor
    ) -> torch.Tensor:
        """grad + Σ_i w_i G_i (grad None: a fresh tensor shaped like ``like``), as one GEMM written in place
        (one index_add for embeddings), with w folded into the smaller side."""
        cols = self.right.shape[2]
        weights = weights.to(self.right.dtype)
        in_place = grad is not None and grad.dtype == self.right.dtype
        if self.is_index:
            if grad is None:
                grad = torch.zeros_like(like)
                in_place = grad.dtype == self.right.dtype
            target = grad.view(self.rows, cols) if in_place else self.right.new_zeros(self.rows, cols)
            target.index_add_(
                0, self.left.reshape(-1), (self.right * weights[:, None, None]).reshape(-1, cols)
            )
            return grad if in_place else grad.add_(target.view(like.shape).to(grad.dtype))
        left, right = self.left, self.right
        if left.shape[2] <= right.shape[2]:
            left = left * weights[:, None, None]
        else:
            right = right * weights[:, None, None]
        left, right = left.reshape(-1, left.shape[2]), right.reshape(-1, cols)
        if in_place:
            grad.view(self.rows, cols).addmm_(left.T, right)
            return grad
        fresh = (left.T @ right).view(like.shape).to(like.dtype)
        return fresh if grad is None else grad.add_(fresh)


@dataclass
class Materialised:
    """Explicit per-example gradients (B, *param.shape); used for vectors and the torch.func fallback."""

    grads: torch.Tensor

    def squared_norm(self, materialise: bool = True) -> torch.Tensor:
        return self.grads.flatten(1).pow(2).sum(dim=1)

    def accumulate(
        self, grad: torch.Tensor | None, weights: torch.Tensor, like: torch.Tensor
    ) -> torch.Tensor:
        """grad + Σ_i w_i G_i (grad None: a fresh tensor shaped like ``like``)."""
        fresh = (
            torch.tensordot(weights.to(self.grads.dtype), self.grads, dims=1).view(like.shape).to(like.dtype)
        )
        return fresh if grad is None else grad.add_(fresh)


PerExampleGradient = OuterProductSum | Materialised


def as_materialised(part: PerExampleGradient, shape: torch.Size) -> torch.Tensor:
    """Explicit (B, *shape) per-example gradients of any part, for cross terms with a materialised part."""
    if isinstance(part, Materialised):
        return part.grads.reshape(part.grads.shape[0], *shape)
    return torch.cat(list(part.materialise_chunks())).reshape(-1, *shape)


def cross_inner(a: PerExampleGradient, b: PerExampleGradient, shape: torch.Size) -> torch.Tensor:
    """⟨G^a_i, G^b_i⟩ per example for two uses of one (tied) parameter."""
    if isinstance(a, OuterProductSum) and isinstance(b, OuterProductSum):
        return a.inner(b)
    return (as_materialised(a, shape).flatten(1) * as_materialised(b, shape).flatten(1)).sum(dim=1)
