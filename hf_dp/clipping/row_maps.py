"""A tensor's rows → examples map (``ExampleRows``) and the operations the row tracker (rows.py) reads: which keep
rows (row-wise, over a dimension, splits), which move them (reshapes, transposes) and which make zeros."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass(frozen=True)
class ExampleRows:
    """``example[r]``: the example of row r; ``per_example``: k when row r belongs to example r // k (a reshape of
    the batch), None when rows were picked (routing) and an example may own any number of them."""

    example: torch.Tensor
    rows: int  # B
    per_example: int | None
    time_major: bool = False  # a (T, B, …) tensor: example i's rows are [:, i] (``example``: arange(B))

    @property
    def count(self) -> int:
        return self.example.shape[0]

    def as_examples(self, *tensors: Tensor) -> list[Tensor]:
        """Each (N, …) tensor as (B, n, …) with example i's rows in its slice (zero rows where an example owns fewer
        than n): every layer rule sums over the middle dimension, to which zero rows add nothing. A time-major
        (T, B, …) tensor as (B, T, …)."""
        if self.time_major:
            return [t.transpose(0, 1) for t in tensors]
        if self.per_example is not None:
            return [t.reshape(self.rows, self.per_example, *t.shape[1:]) for t in tensors]
        owned = torch.bincount(self.example, minlength=self.rows)
        slot = torch.arange(self.count, device=self.example.device)
        order = torch.argsort(self.example, stable=True)
        starts = torch.cumsum(owned, 0) - owned
        position = torch.empty_like(slot)
        position[order] = slot - starts[self.example[order]]
        width = int(owned.max()) if self.count else 0
        laid_out = []
        for t in tensors:
            dense = t.new_zeros((self.rows, width, *t.shape[1:]))
            dense[self.example, position] = t
            laid_out.append(dense)
        return laid_out

    def holds(self, x: Tensor) -> bool:
        """Whether ``x`` has this map's layout (a checkpoint's recomputation of the input it was tracked on)."""
        if self.time_major:
            return x.dim() > 1 and x.shape[1] == self.rows
        return x.dim() > 0 and x.shape[0] == self.count

    def sum_per_example(self, per_row: Tensor) -> Tensor:
        """(N, …) per-row values summed into (B, …) per example."""
        return per_row.new_zeros((self.rows, *per_row.shape[1:])).index_add_(0, self.example, per_row)


# fmt: off
RESHAPES = {Tensor.reshape, Tensor.view, torch.reshape, Tensor.flatten, torch.flatten, Tensor.view_as}
ROW_WISE = {
    F.linear, F.layer_norm, F.rms_norm, F.dropout, F.gelu, F.relu, F.silu, F.mish, F.tanh, F.sigmoid,
    F.softplus, torch.add, torch.sub, torch.mul, torch.div, torch.tanh, torch.sigmoid, torch.rsqrt, torch.exp,
    torch.where, torch.pow, torch.clamp, torch.erf, Tensor.__add__, Tensor.__radd__, Tensor.__iadd__,
    Tensor.__sub__, Tensor.__rsub__, Tensor.__isub__, Tensor.__mul__, Tensor.__rmul__, Tensor.__imul__,
    Tensor.__truediv__, Tensor.__itruediv__, Tensor.__neg__, Tensor.__pow__, Tensor.add, Tensor.add_,
    Tensor.sub, Tensor.mul, Tensor.mul_, Tensor.div, Tensor.div_, Tensor.pow, Tensor.rsqrt, Tensor.sqrt,
    Tensor.exp, Tensor.tanh, Tensor.sigmoid, Tensor.clamp, Tensor.to, Tensor.float, Tensor.half,
    Tensor.bfloat16, Tensor.double, Tensor.type, Tensor.type_as, Tensor.contiguous, Tensor.clone,
    Tensor.masked_fill, Tensor.float_power,
}
OVER_A_DIMENSION = {  # row-wise when the dimension they reduce or normalise over is not the rows'
    torch.softmax, F.softmax, F.log_softmax, Tensor.softmax, Tensor.log_softmax, torch.mean, torch.sum,
    Tensor.mean, Tensor.sum, Tensor.amax, Tensor.norm, Tensor.var,
}
SPLITS = {torch.split, torch.chunk, Tensor.split, Tensor.chunk}
TRANSPOSES = {
    Tensor.transpose, torch.transpose, Tensor.swapaxes, torch.swapaxes, Tensor.swapdims, torch.swapdims,
    Tensor.permute, torch.permute,
}
ZEROS = {Tensor.new_zeros, torch.zeros, torch.zeros_like}
# fmt: on


def dim_of(func, args: tuple, kwargs: dict) -> object:
    dim = kwargs.get("dim", args[1] if len(args) > 1 and func not in SPLITS else None)
    if func in SPLITS:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    return dim


def tensor_leaves(value) -> list[Tensor]:
    """The tensors in ``value``, nested in lists and tuples."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensor_leaves(v)]
    return []


def index_pair(index) -> bool:
    """``index`` is two integer index tensors of one length: advanced indexing of dimensions 0 and 1."""
    return (
        isinstance(index, tuple)
        and len(index) == 2
        and all(
            isinstance(i, Tensor) and i.dim() == 1 and not i.is_floating_point() and i.dtype != torch.bool
            for i in index
        )
        and index[0].shape == index[1].shape
    )
