"""Which example each row of a flattened tensor belongs to, carried through the forward.

Some layers see the tokens of all examples as rows of one dimension: OPT's feed-forward block reshapes (B, T, d) to
(B·T, d), an MoE block hands its router (and its shared expert) the same rows. A per-example gradient needs each
row's example, and the layout is not assumed: a ``RowTracker`` (a ``TorchFunctionMode``, on during a recorded
forward) carries a row → example map through the operations that move rows. A row-major reshape of a
(B, …) tensor maps output row r to example r·n_out/n_in (n the elements per row); indexing and ``index_select``
along rows index the map; ``cat`` along rows concatenates maps; row-wise operations (elementwise arithmetic,
``linear``, norms, activations, dropout, reductions and softmax over other dimensions) keep it. Any other
operation drops it, so a layer fed rows of unknown origin is refused, never mislabelled.

A time-major tensor (T, B, …) (Longformer's and LED's self-attention project ``hidden_states.transpose(0, 1)``)
has the batch as its dimension 1: a transpose or permute that moves a batch-major tensor's dimension 0 to 1 makes
one, a reshape that keeps dimensions 0 and 1 and a row-wise operation over the others keep it, and one that moves
dimension 1 back to 0 gives the batch's own rows. Indexing it with a pair of index tensors gives rows of the
examples the second one names; writing such rows into a tensor of zeros (``new_zeros``) at positions whose second
index is each row's own example makes another time-major tensor (Longformer's global query, the batch's global
tokens padded to the most any example has: zero rows). A layer's rule sees such an input and its output gradient
transposed back, (B, T, …), so it sums over T as over a batch-major input's tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from hf_dp.clipping.errors import UnsupportedModuleError
from hf_dp.clipping.reads import Loose, LooseWatch, reads_values
from hf_dp.clipping.shared import SharedUse, broadcast

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
_RESHAPES = {Tensor.reshape, Tensor.view, torch.reshape, Tensor.flatten, torch.flatten, Tensor.view_as}
_ROW_WISE = {
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
_OVER_A_DIMENSION = {  # row-wise when the dimension they reduce or normalise over is not the rows'
    torch.softmax, F.softmax, F.log_softmax, Tensor.softmax, Tensor.log_softmax, torch.mean, torch.sum,
    Tensor.mean, Tensor.sum, Tensor.amax, Tensor.norm, Tensor.var,
}
_SPLITS = {torch.split, torch.chunk, Tensor.split, Tensor.chunk}
_TRANSPOSES = {
    Tensor.transpose, torch.transpose, Tensor.swapaxes, torch.swapaxes, Tensor.swapdims, torch.swapdims,
    Tensor.permute, torch.permute,
}
_ZEROS = {Tensor.new_zeros, torch.zeros, torch.zeros_like}
# fmt: on


def _dim_of(func, args: tuple, kwargs: dict) -> object:
    dim = kwargs.get("dim", args[1] if len(args) > 1 and func not in _SPLITS else None)
    if func in _SPLITS:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    return dim


def _leaves(value) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _leaves(v)]
    return []


class RowTracker(TorchFunctionMode):
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

    def share(self, output: Tensor, use: SharedUse, made_from: Tensor | None = None) -> None:
        """``output`` of a layer applied to an input without a batch dimension (shared.py); made from the uses of
        that input too, when it was itself made from a shared output (DeBERTa's projections of its relative
        embeddings)."""
        self.seen = True
        if made_from is not None and made_from in self._aliases:  # a module given a loose parameter itself
            made_from = self._aliases[made_from]
        upstream = [] if made_from is None else self._shared.get(made_from, [])
        self._shared[output] = [use, *upstream]

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

    def _with_shared(self, func, args: tuple, kwargs: dict):
        """An operation on tensors made from a shared output: where one meets the batch (its result has the batch's
        rows, another input does too, or it expands to them), it gets the shared tensor broadcast to the batch
        explicitly (shared.broadcast); otherwise its result is made from the same shared uses."""
        leaves = _leaves(args) + _leaves(list(kwargs.values()))
        uses = [use for t in leaves for use in self._shared.get(t, [])]
        if not uses:
            out = func(*args, **kwargs)
            self._track(func, args, kwargs, out)
            return out
        if func is F.linear:
            linear = self._shared_linear(args, kwargs)
            if linear is not None:
                return linear
        if func is Tensor.repeat and args[0] in self._shared:
            repeated = self._repeated(args)
            if repeated is not None:
                return repeated
        rank = self._meets_batch(func, args, leaves)
        if rank is None:
            out = func(*args, **kwargs)
            for t in _leaves(out):
                self._shared[t] = list(dict.fromkeys(uses))
            return out

        def batched(value):
            found = self._shared.get(value) if isinstance(value, Tensor) else None
            return value if found is None else broadcast(value, self.rows, rank, found)

        try:
            return func(*[batched(a) for a in args], **{k: batched(v) for k, v in kwargs.items()})
        except (RuntimeError, TypeError, ValueError) as error:
            name = getattr(func, "__name__", repr(func))
            raise UnsupportedModuleError(
                f"{name} meets the batch with a tensor made from a parameter read outside its module or a layer's "
                f"output shared by all examples, and does not take that tensor broadcast to the batch ({error}); "
                "call the parameter through its module, or freeze it"
            ) from error

    def _shared_linear(self, args: tuple, kwargs: dict) -> Tensor | None:
        """``F.linear(x, W, b)`` with W or b shared and x of the batch's rows, as x @ Wᵀ + b with W and b broadcast
        to the batch (``linear`` takes no batched weight)."""
        x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if x in self._shared or x.dim() < 2 or x.shape[0] != self.rows:
            return None

        def batched(t: Tensor) -> Tensor:
            found = self._shared.get(t)
            return t if found is None else broadcast(t, self.rows, x.dim(), found)

        out = torch.matmul(x, batched(weight).transpose(-1, -2))
        return out if bias is None else out + batched(bias)

    def _repeated(self, args: tuple) -> Tensor | None:
        """``made.repeat(B, …)`` (DeBERTa's positions, one copy per example): copy b is example b's, so the copies
        are made by broadcasting (same values, each copy's gradient that example's)."""
        made = args[0]
        sizes = (
            tuple(args[1]) if len(args) == 2 and isinstance(args[1], tuple | list | torch.Size) else args[1:]
        )
        if len(sizes) != made.dim() or made.dim() == 0 or sizes[0] != self.rows:
            return None
        copies = broadcast(made, self.rows, made.dim() + 1, self._shared[made])
        repeated = copies.reshape(self.rows * made.shape[0], *made.shape[1:])
        return repeated if all(k == 1 for k in sizes[1:]) else repeated.repeat(1, *sizes[1:])

    def _meets_batch(self, func, args: tuple, leaves: list[Tensor]) -> int | None:
        """The rank of the (B, …) tensor a shared input is broadcast to, if this operation meets the batch."""
        if func in (Tensor.expand, Tensor.expand_as) and len(args) > 1:
            target = args[1] if func is Tensor.expand_as else args[1:]
            sizes = (
                target.shape
                if isinstance(target, Tensor)
                else tuple(
                    target[0]
                    if len(target) == 1 and isinstance(target[0], tuple | list | torch.Size)
                    else target
                )
            )
            if sizes and sizes[0] == self.rows and args[0].dim() == len(sizes) and args[0].shape[0] == 1:
                return len(sizes)
            return None
        batched = [t for t in leaves if t not in self._shared and t.dim() > 0 and t.shape[0] == self.rows]
        if not batched:
            return None
        like = max(batched, key=Tensor.dim)
        shared = [t for t in leaves if t in self._shared]
        if all(t.dim() < like.dim() or (t.dim() == like.dim() and t.shape[0] == 1) for t in shared):
            return like.dim()
        return None

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
        if func in _ZEROS and isinstance(out, Tensor):
            self._zeros[out] = True
        if (
            mapped is not None
            and isinstance(out, Tensor)
            and not (mapped.per_example == 1 and not mapped.time_major and out.shape[0] == self.rows)
        ):
            self._maps[out] = mapped
        elif isinstance(out, tuple | list) and func in _SPLITS and mapped is not None:
            for part in out:
                self._maps[part] = mapped

    def _propagate(self, func, args: tuple, kwargs: dict, out) -> ExampleRows | None:
        if not args or not isinstance(args[0], Tensor) and func is not torch.cat:
            return None
        if func in _TRANSPOSES:
            return self._transposed(func, args, kwargs, out)
        inputs = [args[0]] if func is F.linear else _leaves(args) + _leaves(list(kwargs.values()))
        if any(self._maps.get(t) is not None and self._maps[t].time_major for t in inputs):
            return self._from_time_major(func, args, kwargs, inputs, out)
        if func in _RESHAPES:
            return self._reshaped(args[0], out)
        if func is Tensor.__getitem__ or func is torch.index_select or func is Tensor.index_select:
            return self._indexed(func, args, kwargs, out)
        if func is torch.cat:
            return self._concatenated(args, kwargs, out)
        if func in _ROW_WISE or func in _OVER_A_DIMENSION or func in _SPLITS:
            return self._row_wise(func, args, kwargs, out)
        return None

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
        if func in _RESHAPES:
            keeps = isinstance(out, Tensor) and out.dim() >= 2 and out.shape[:2] == source.shape[:2]
            return self._time_major_rows(out) if keeps and self._is_time_major(source) else None
        if func is Tensor.__getitem__:
            index = args[1]
            if (
                self._is_time_major(source)
                and isinstance(out, Tensor)
                and _index_pair(index)
                and out.dim() > 0
                and out.shape[0] == index[1].shape[0]
            ):
                return ExampleRows(index[1] % self.rows, self.rows, None)
            return None
        if func not in _ROW_WISE and func not in _OVER_A_DIMENSION and func not in _SPLITS:
            return None
        outs = _leaves(out)
        if not outs or any(o.dim() < 2 or o.shape[:2] != outs[0].shape[:2] for o in outs):
            return None
        if func in _OVER_A_DIMENSION or func in _SPLITS:
            dim, ndim = _dim_of(func, args, kwargs), source.dim()
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
            and _index_pair(index)
            and value.dim() > 0
            and value.shape[0] == found.count == index[1].shape[0]
            and torch.equal(found.example, index[1] % self.rows)
        ):
            self._maps[target] = self._time_major_rows(target)
        else:
            self._maps.pop(target, None)

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
        if func in _OVER_A_DIMENSION or func in _SPLITS:
            dim, ndim = _dim_of(func, args, kwargs), args[0].dim()
            dims = dim if isinstance(dim, tuple | list) else (dim,)
            if dim is None or any(
                d is None or d % ndim == 0 for d in dims if isinstance(d, int) or d is None
            ):
                return None
        inputs = _leaves(args) + _leaves(list(kwargs.values()))
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
        outs = _leaves(out)
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


def _index_pair(index) -> bool:
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
