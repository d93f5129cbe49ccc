"""Time-major (T, B, …) tensors for the row tracker (rows.py): Longformer's and LED's self-attention project
``hidden_states.transpose(0, 1)``, whose batch is dimension 1. A transpose or permute that moves a batch-major
tensor's dimension 0 to 1 makes one, a reshape that keeps dimensions 0 and 1 and a row-wise operation over the others
keep it, and one that moves dimension 1 back to 0 gives the batch's own rows. Indexing it with a pair of index
tensors gives rows of the examples the second one names; writing such rows into a tensor of zeros (``new_zeros``) at
positions whose second index is each row's own example makes another (Longformer's global query, the batch's global
tokens padded to the most any example has: zero rows)."""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hf_dp.clipping.row_maps import (
    OVER_A_DIMENSION,
    RESHAPES,
    ROW_WISE,
    SPLITS,
    ExampleRows,
    dim_of,
    index_pair,
    tensor_leaves,
)

Tensor = torch.Tensor


class TimeMajorRows:
    """The row tracker's time-major maps (a mixin: ``rows``, ``_maps`` and ``_zeros`` are the tracker's)."""

    rows: int
    _maps: WeakIdKeyDictionary
    _zeros: WeakIdKeyDictionary

    def _time_major_rows(self, like: Tensor) -> ExampleRows:
        return ExampleRows(torch.arange(self.rows, device=like.device), self.rows, None, time_major=True)

    def _transposed(self, func, args: tuple, kwargs: dict, out) -> ExampleRows | None:
        """A batch-major tensor's dimension 0 moved to 1 (time-major), or a time-major one's 1 moved back to 0."""
        source = args[0]
        if not isinstance(out, Tensor) or source.dim() < 2:
            return None
        found = self._maps.get(source)
        if found is None and source.shape[0] == self.rows:
            batch = 0  # the batch's own rows
        elif found is not None and found.time_major:
            batch = 1
        else:
            return None
        n = source.dim()
        if func in (Tensor.permute, torch.permute):
            dims = kwargs.get("dims", args[1] if len(args) == 2 else args[1:])
            order = [int(d) % n for d in (dims if isinstance(dims, tuple | list | torch.Size) else (dims,))]
        else:
            first = kwargs.get("dim0", args[1] if len(args) > 1 else None)
            second = kwargs.get("dim1", args[2] if len(args) > 2 else None)
            if not isinstance(first, int) or not isinstance(second, int):
                return None
            order = list(range(n))
            order[first % n], order[second % n] = order[second % n], order[first % n]
        if sorted(order) != list(range(n)) or out.dim() != n:
            return None
        moved = order.index(batch)
        if moved == 0:
            return ExampleRows(torch.arange(self.rows, device=out.device), self.rows, 1)
        return self._time_major_rows(out) if moved == 1 else None

    def _from_time_major(
        self, func, args: tuple, kwargs: dict, inputs: list[Tensor], out
    ) -> ExampleRows | None:
        """An operation on a time-major tensor: kept time-major by a reshape that keeps dimensions 0 and 1 and by
        a row-wise operation whose other operands are time-major or do not reach dimension 1; indexed by a pair of
        index tensors, rows of the examples the second names. Anything else: no map."""
        source = args[0]
        if func in RESHAPES:
            keeps = isinstance(out, Tensor) and out.dim() >= 2 and out.shape[:2] == source.shape[:2]
            return self._time_major_rows(out) if keeps and self._is_time_major(source) else None
        if func is Tensor.__getitem__:
            index = args[1]
            if (
                self._is_time_major(source)
                and isinstance(out, Tensor)
                and index_pair(index)
                and out.dim() > 0
                and out.shape[0] == index[1].shape[0]
            ):
                return ExampleRows(index[1] % self.rows, self.rows, None)
            return None
        if func not in ROW_WISE and func not in OVER_A_DIMENSION and func not in SPLITS:
            return None
        outs = tensor_leaves(out)
        if not outs or any(o.dim() < 2 or o.shape[:2] != outs[0].shape[:2] for o in outs):
            return None
        if func in OVER_A_DIMENSION or func in SPLITS:
            dim, ndim = dim_of(func, args, kwargs), source.dim()
            dims = dim if isinstance(dim, tuple | list) else (dim,)
            if dim is None or any(not isinstance(d, int) or d % ndim in (0, 1) for d in dims):
                return None
        for t in inputs:
            if self._is_time_major(t):
                if t.dim() != outs[0].dim() or t.shape[:2] != outs[0].shape[:2]:
                    return None
                continue
            reach = t.dim() - outs[0].dim() + 1  # the operand's dimension broadcast against dimension 1
            if self._maps.get(t) is not None or (reach >= 0 and t.shape[reach] != 1):
                return None
        return self._time_major_rows(outs[0])

    def _is_time_major(self, t: Tensor) -> bool:
        found = self._maps.get(t)
        return found is not None and found.time_major

    def _written(self, target, index, value) -> None:
        """``target[index] = value``: a tensor of zeros, or a time-major one, stays time-major (or becomes it) when
        each written row goes to its own example's position along dimension 1; otherwise a time-major map is
        dropped."""
        if not isinstance(target, Tensor):
            return
        zeros = self._zeros.pop(target, None) is not None
        if not (zeros or self._is_time_major(target)):
            return
        found = self._maps.get(value) if isinstance(value, Tensor) else None
        if (
            found is not None
            and not found.time_major
            and target.dim() >= 2
            and target.shape[1] == self.rows
            and index_pair(index)
            and value.dim() > 0
            and value.shape[0] == found.count == index[1].shape[0]
            and torch.equal(found.example, index[1] % self.rows)
        ):
            self._maps[target] = self._time_major_rows(target)
        else:
            self._maps.pop(target, None)
