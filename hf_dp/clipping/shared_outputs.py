"""Where a tensor made from a layer's output shared by all examples (shared.py) meets the batch, for the row tracker
(rows.py): such an operation gets the shared tensor broadcast to the batch explicitly, so the gradient there is per
example; ``F.linear`` with a shared weight and ``repeat`` to one copy per example are rewritten to take it."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from hf_dp.clipping.errors import UnsupportedModuleError
from hf_dp.clipping.row_maps import tensor_leaves
from hf_dp.clipping.shared import SharedUse, broadcast

Tensor = torch.Tensor


class SharedOutputs:
    """The row tracker's shared outputs (a mixin: ``rows``, ``seen``, ``_shared``, ``_aliases`` and ``_track`` are
    the tracker's)."""

    rows: int
    seen: bool
    _shared: WeakIdKeyDictionary
    _aliases: WeakIdKeyDictionary
    _track: Callable[[object, tuple, dict, object], None]

    def share(self, output: Tensor, use: SharedUse, made_from: Tensor | None = None) -> None:
        """``output`` of a layer applied to an input without a batch dimension (shared.py); made from the uses of
        that input too, when it was itself made from a shared output (DeBERTa's projections of its relative
        embeddings)."""
        self.seen = True
        if made_from is not None and made_from in self._aliases:  # a module given a loose parameter itself
            made_from = self._aliases[made_from]
        upstream = [] if made_from is None else self._shared.get(made_from, [])
        self._shared[output] = [use, *upstream]

    def _with_shared(self, func, args: tuple, kwargs: dict):
        """An operation on tensors made from a shared output: where one meets the batch (its result has the batch's
        rows, another input does too, or it expands to them), it gets the shared tensor broadcast to the batch
        explicitly (shared.broadcast); otherwise its result is made from the same shared uses."""
        leaves = tensor_leaves(args) + tensor_leaves(list(kwargs.values()))
        uses = [use for t in leaves for use in self._shared.get(t, [])]
        if not uses:
            out = func(*args, **kwargs)
            self._track(func, args, kwargs, out)
            return out
        if func is F.linear:
            linear = self._shared_linear(args, kwargs)
            if linear is not None:
                return linear
        if func is F.embedding:
            gathered = self._shared_embedding(args, kwargs)
            if gathered is not None:
                return gathered
        if func is Tensor.repeat and args[0] in self._shared:
            repeated = self._repeated(args)
            if repeated is not None:
                return repeated
        rank = self._meets_batch(func, args, leaves)
        if rank is None:
            out = func(*args, **kwargs)
            for t in tensor_leaves(out):
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

    def _shared_embedding(self, args: tuple, kwargs: dict) -> Tensor | None:
        """``F.embedding(ids, W)`` with W shared (peft's LoRA on an embedding reads its A so) and ids of the batch's
        rows, as W broadcast to the batch and indexed per example; a row at ``padding_idx`` gets no gradient, as
        F.embedding leaves it. ``max_norm`` (W renormalised in place), ``scale_grad_by_freq`` (a gradient scaled by
        the batch's counts) and ``sparse`` are refused."""
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
        values = dict(zip(names, args, strict=False)) | kwargs
        ids, weight = values["input"], values["weight"]
        if weight not in self._shared or ids in self._shared or ids.dim() < 1 or ids.shape[0] != self.rows:
            return None
        if values.get("max_norm") is not None or values.get("scale_grad_by_freq") or values.get("sparse"):
            raise UnsupportedModuleError(
                "an embedding of a shared table with max_norm, scale_grad_by_freq or sparse gradients (the first "
                "renormalises the table in place, the second scales it by the batch's counts): turn them off, or "
                "freeze it"
            )
        table = broadcast(weight, self.rows, weight.dim() + 1, self._shared[weight])
        examples = torch.arange(self.rows, device=ids.device).view(-1, *[1] * (ids.dim() - 1))
        out = table[examples, ids]
        padding = values.get("padding_idx")
        if padding is None:
            return out
        padding = padding + weight.shape[0] if padding < 0 else padding
        return torch.where((ids == padding).unsqueeze(-1), out.detach(), out)

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
