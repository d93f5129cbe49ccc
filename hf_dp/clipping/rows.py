"""Which example each row of a flattened tensor belongs to, carried through the forward.

Some layers see the tokens of all examples as rows of one dimension: OPT's feed-forward block reshapes (B, T, d) to
(B·T, d), an MoE block hands its router (and its shared expert) the same rows. A per-example gradient needs each
row's example, and the layout is not assumed: a ``RowTracker`` (a ``TorchFunctionMode``, on during a recorded
forward) carries a row → example map through the operations that move rows. A row-major reshape of a
(B, …) tensor maps output row r to example r·n_out/n_in (n the elements per row); indexing and ``index_select``
along rows index the map; ``cat`` along rows concatenates maps; row-wise operations (elementwise arithmetic,
``linear``, norms, activations, dropout, reductions and softmax over other dimensions) keep it. Any other
operation drops it, so a layer fed rows of unknown origin is refused, never mislabelled.

A time-major tensor (T, B, …) (Longformer's and LED's self-attention) has the batch as its dimension 1
(time_major.py); a layer's rule sees such an input and its output gradient transposed back, (B, T, …). The map
and the operations it reads are in row_maps.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from hf_dp.clipping.reads import Loose, LooseWatch, reads_values
from hf_dp.clipping.row_maps import (
    OVER_A_DIMENSION,
    RESHAPES,
    ROW_WISE,
    SPLITS,
    TRANSPOSES,
    ZEROS,
    ExampleRows,
    dim_of,
    tensor_leaves,
)
from hf_dp.clipping.shared import SharedUse
from hf_dp.clipping.shared_outputs import SharedOutputs
from hf_dp.clipping.time_major import TimeMajorRows

Tensor = torch.Tensor


class RowTracker(SharedOutputs, TimeMajorRows, TorchFunctionMode):
    """The row → example maps of the tensors one recorded forward makes (``rows_of``); ``seen`` turns true when a
    layer asked for one (the engine then keeps tracking on later steps)."""

    def __init__(self, rows: int, loose: Loose | None = None) -> None:
        super().__init__()
        self.rows = rows
        self.loose = loose  # a clipped parameter read outside its module's forward → what to read instead
        self.seen = False
        self._maps: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._shared: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor → the shared uses it was made from
        self._aliases: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a loose parameter → its alias
        self._zeros: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors of zeros not written since made

    def rows_of(self, x: Tensor) -> ExampleRows | None:
        """The map of a tensor whose rows are not the batch's own, else None."""
        found = self._maps.get(x)
        self.seen |= found is not None
        return found

    def carry(self, source: Tensor, target: Tensor) -> None:
        found = self._maps.get(source)
        if found is not None:
            self._maps[target] = found

    def _of(self, t: Tensor) -> ExampleRows | None:
        """A tracked tensor's map, or the batch's own (row i is example i) for a (B, …) one."""
        found = self._maps.get(t)
        if found is None and t.dim() > 0 and t.shape[0] == self.rows:
            found = ExampleRows(torch.arange(self.rows, device=t.device), self.rows, 1)
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.loose is not None and torch.is_grad_enabled() and reads_values(func):
            args = tuple(self._read(a) for a in args)
            kwargs = {k: self._read(v) for k, v in kwargs.items()}
        if self._shared:
            return self._with_shared(func, args, kwargs)
        out = func(*args, **kwargs)
        self._track(func, args, kwargs, out)
        return out

    def _read(self, value):
        if isinstance(value, nn.Parameter):
            alias = self.loose(value)
            if alias is None:
                return value
            self._aliases[value] = alias
            return alias
        return value

    def _track(self, func, args: tuple, kwargs: dict, out) -> None:
        if func is Tensor.__setitem__:
            self._written(*args[:3])
            return
        mapped = self._propagate(func, args, kwargs, out)
        if (
            isinstance(out, Tensor) and args and out is args[0]
        ):  # in place: no longer zeros, its map only if kept
            self._zeros.pop(out, None)
            found = self._maps.get(out)
            if mapped is None and found is not None and found.time_major:
                del self._maps[out]
        if func in ZEROS and isinstance(out, Tensor):
            self._zeros[out] = True
        if (
            mapped is not None
            and isinstance(out, Tensor)
            and not (mapped.per_example == 1 and not mapped.time_major and out.shape[0] == self.rows)
        ):
            self._maps[out] = mapped
        elif isinstance(out, tuple | list) and func in SPLITS and mapped is not None:
            for part in out:
                self._maps[part] = mapped

    def _propagate(self, func, args: tuple, kwargs: dict, out) -> ExampleRows | None:
        if not args or not isinstance(args[0], Tensor) and func is not torch.cat:
            return None
        if func in TRANSPOSES:
            return self._transposed(func, args, kwargs, out)
        inputs = [args[0]] if func is F.linear else tensor_leaves(args) + tensor_leaves(list(kwargs.values()))
        if any(self._maps.get(t) is not None and self._maps[t].time_major for t in inputs):
            return self._from_time_major(func, args, kwargs, inputs, out)
        if func in RESHAPES:
            return self._reshaped(args[0], out)
        if func is Tensor.__getitem__ or func is torch.index_select or func is Tensor.index_select:
            return self._indexed(func, args, kwargs, out)
        if func is torch.cat:
            return self._concatenated(args, kwargs, out)
        if func in ROW_WISE or func in OVER_A_DIMENSION or func in SPLITS:
            return self._row_wise(func, args, kwargs, out)
        return None

    def _reshaped(self, source: Tensor, out) -> ExampleRows | None:
        mapped = self._of(source)
        if mapped is None or not isinstance(out, Tensor) or out.dim() == 0 or source.numel() == 0:
            return None
        n_in, n_out = source.shape[0], out.shape[0]
        if n_out % n_in == 0:  # each row split into n_out / n_in rows, in order
            split = n_out // n_in
            k = None if mapped.per_example is None else mapped.per_example * split
            return ExampleRows(mapped.example.repeat_interleave(split), self.rows, k)
        if n_in % n_out == 0 and mapped.per_example is not None and mapped.per_example % (n_in // n_out) == 0:
            merged = n_in // n_out  # consecutive rows of one example merged
            return ExampleRows(mapped.example[::merged], self.rows, mapped.per_example // merged)
        return None

    def _row_wise(self, func, args: tuple, kwargs: dict, out) -> ExampleRows | None:
        if func in OVER_A_DIMENSION or func in SPLITS:
            dim, ndim = dim_of(func, args, kwargs), args[0].dim()
            dims = dim if isinstance(dim, tuple | list) else (dim,)
            if dim is None or any(
                d is None or d % ndim == 0 for d in dims if isinstance(d, int) or d is None
            ):
                return None
        inputs = tensor_leaves(args) + tensor_leaves(list(kwargs.values()))
        maps = [m for m in (self._maps.get(t) for t in inputs) if m is not None]
        if not maps or any(m is not maps[0] for m in maps[1:]):
            return None
        n = maps[0].count
        # an untracked operand with rows of the same count could be another layout: no map
        if any(
            t.dim() >= 1 and t.shape[0] == n and self._maps.get(t) is None and t.dim() == args[0].dim()
            for t in inputs
        ):
            return None
        outs = tensor_leaves(out)
        if not outs or any(o.dim() == 0 or o.shape[0] != n for o in outs):
            return None
        return maps[0]

    def _indexed(self, func, args: tuple, kwargs: dict, out) -> ExampleRows | None:
        source = args[0]
        mapped = self._maps.get(source)
        if mapped is None or not isinstance(out, Tensor):
            return None
        if func is Tensor.__getitem__:
            index = args[1]
            first = index[0] if isinstance(index, tuple) and index else index
            if not isinstance(first, Tensor | slice):
                return None
            picked = mapped.example[first]
        else:
            dim, index = kwargs.get("dim", args[1]), kwargs.get("index", args[2] if len(args) > 2 else None)
            if dim % source.dim() != 0:
                return None
            picked = mapped.example.index_select(0, index)
        if out.dim() == 0 or out.shape[0] != picked.shape[0]:
            return None
        return ExampleRows(picked, self.rows, None)

    def _concatenated(self, args: tuple, kwargs: dict, out) -> ExampleRows | None:
        tensors, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if dim != 0:
            return None
        maps = [self._maps.get(t) for t in tensors]
        if any(m is None for m in maps):
            return None
        return ExampleRows(torch.cat([m.example for m in maps]), self.rows, None)


class RowTracking:
    """Whether a model's recorded forwards carry row maps: on until the first recorded micro-batch shows that no
    trainable layer takes flattened rows and no parameter is read outside its module (a ``TorchFunctionMode``
    costs a Python call per operation); off, a ``LooseWatch`` still sees every parameter read."""

    def __init__(self) -> None:
        self.on = True
        self.tracker: RowTracker | None = None
        self._watch: LooseWatch | None = None

    @contextlib.contextmanager
    def forward(self, rows: int, loose: Loose | None = None) -> Iterator[None]:
        if not self.on:
            self._watch = LooseWatch(loose) if loose is not None else None
            if self._watch is not None:
                self._watch.__enter__()
            try:
                yield
            finally:
                self.end_watch()
            return
        self.tracker = RowTracker(rows, loose)
        try:
            with self.tracker:
                yield
        finally:
            self.on = self.tracker.seen
            self.tracker = None

    def end_watch(self) -> None:
        """The recorded forward is over: its backward needs no watch (a checkpoint's recomputation reruns what the
        forward read), unless a mode entered after it is still on (modes leave in the reverse order)."""
        watch = self._watch
        if watch is not None and torch.overrides._get_current_function_mode_stack()[-1:] == [watch]:
            self._watch = None
            watch.__exit__(None, None, None)

    def keep(self) -> None:
        """Track later forwards too: this one needed the tracker."""
        if self.tracker is not None:
            self.tracker.seen = True

    def rows_of(self, x: Tensor | None) -> ExampleRows | None:
        return None if x is None or self.tracker is None else self.tracker.rows_of(x)

    def takes_shared(self, x: Tensor | None, rows: int) -> bool:
        """A layer's input without a batch dimension and not of tracked rows, while tracking (shared.py)."""
        return (
            self.tracker is not None
            and x is not None
            and (x.dim() == 0 or x.shape[0] != rows)
            and self.tracker.rows_of(x) is None
        )

    def share(self, output: Tensor, use: SharedUse, made_from: Tensor | None = None) -> None:
        self.tracker.share(output, use, made_from)

    def carried(self, output: Tensor, replacement: Tensor) -> Tensor:
        """A hook's replacement of a module's output (a tap) keeps the output's map."""
        if self.tracker is not None:
            self.tracker.carry(output, replacement)
        return replacement
