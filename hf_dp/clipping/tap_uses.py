"""The norm pass's uses that are not a module's rule on its own batch-major input (taps.NormCollector's): a layer
fed flattened rows (rows.py, their map kept for a checkpoint's recomputation), a layer on an input shared by all
examples and a clipped parameter read outside its module (shared.py), and a module without a rule (fallback.py),
with the submodules' parameters its forward reads."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_dp.clipping.fallback import ModuleCall, tap_call
from hf_dp.clipping.hooks import UnsupportedModuleError, batch_rows, check_shared_use, is_checkpointing
from hf_dp.clipping.per_example import PerExampleGradient
from hf_dp.clipping.row_maps import ExampleRows
from hf_dp.clipping.rules import per_call_grads
from hf_dp.clipping.shared import SharedUse, anchored

if TYPE_CHECKING:
    from hf_dp.clipping.taps import NormCollector


class OtherUses:
    """What ``collector`` hands on for the uses its taps do not cover directly."""

    def __init__(self, collector: NormCollector) -> None:
        self.collector = collector
        self._flattened: dict[nn.Module, ExampleRows] = {}  # the row maps of the first forward (rows.py)
        self._joined: dict[
            nn.Module, set[str]
        ] = {}  # per fallback module, the submodules' parameters it reads
        self._fallback_calls: set[nn.Module] = set()  # modules without a rule tapped in the first forward
        self.suspended = False  # a fallback is re-running a module in the backward
        self.read_in_checkpoints: list[str] = []  # parameters read outside their module inside a checkpoint
        self._shared: list[
            tuple[SharedUse, int]
        ] = []  # layers on an input shared by all examples, their call

    def flattened(self, module: nn.Module) -> bool:
        """Whether the module took flattened rows in the first forward."""
        return module in self._flattened

    def shared_parts(self) -> Iterator[tuple[nn.Module, dict[str, PerExampleGradient], int]]:
        """After the backward: each shared use's per-example gradients and its call number, handed over once."""
        shared, self._shared = self._shared, []
        for use, call in shared:
            found = use.per_example(functools.partial(self.collector.rule, rows=None))
            if found is not None:
                yield use.module, found, call

    def shared_use(self, module: nn.Module, x: torch.Tensor, output) -> torch.Tensor:
        """A layer applied to an input without a batch dimension (shared.py): its per-example gradients are formed
        once the backward has brought each example's gradient back to it (``shared_parts``)."""
        check_shared_use(self.collector.layers, module, output, self.collector.units)
        if isinstance(
            x, nn.Parameter
        ):  # a norm of a parameter read outside its module (DeBERTa-v3's relative
            # embeddings): no layer call marks it, so neither the tail nor the layer-by-layer pass can follow it
            if self.collector.tail_finder is not None:
                self.collector.tail_finder.unreachable()
            if self.collector.layer_points is not None:
                self.collector.layer_points.complete = False
        shared = anchored(output, self.collector.anchor)
        if (
            not self.collector.counting
        ):  # a checkpoint's recomputation: the first forward's use holds the gradients
            if not any(use.module is module for use, _ in self._shared):
                raise UnsupportedModuleError(
                    f"{self.collector.layers.where(module)} takes an input shared by all examples inside a reentrant "
                    "checkpoint, whose untracked first forward cannot follow it to the batch: use non-reentrant "
                    "checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False}), or freeze it"
                )
            return shared
        use = SharedUse(module, x, shared, self.collector.rows)
        self.collector.tracking.share(shared, use, x)
        self._shared.append((use, self.collector.count(module, x)))
        return shared

    def loose_use(self, module: nn.Module, name: str, param: nn.Parameter) -> torch.Tensor:
        check_shared_use(self.collector.layers, module, param, self.collector.units)
        if (
            is_checkpointing()
        ):  # recomputed, it reads the parameter itself: named if the recomputation differs
            self.read_in_checkpoints.append(f"{self.collector.layers.where(module)}.{name}")
        # a checkpoint's recomputation reads the parameter itself: it must require grad there as the alias does
        # here, or the two forwards save different tensors (its .grad is set aside and put back: engine.frozen)
        param.requires_grad_(True)
        alias = anchored(param, self.collector.anchor)
        use = SharedUse(module, None, alias, self.collector.rows, parameter=name)
        self.collector.tracking.share(alias, use)
        self._shared.append((use, self.collector.count(module, None) if self.collector.counting else 0))
        return alias

    def joins(self, module: nn.Module, name: str) -> None:
        self._joined.setdefault(module, set()).add(name)

    def fallback(
        self,
        module: nn.Module,
        x: torch.Tensor | None,
        args: tuple,
        kwargs: dict,
        output,
        rows: ExampleRows | None,
    ) -> object:
        """A module without a rule: its call tapped whole (fallback.py), its per-example gradients by torch.func
        when its outputs' gradients arrive; the submodules' parameters its forward reads (``joins``) with them."""
        units = self.collector.units
        count = self.collector.rows if units is None else units.count
        if units is not None:  # each row's unit: the call's per-unit gradients
            rows = units.rows_of_call(rows, self.collector.layers.where(module))
        if (
            not self.collector.counting
        ):  # a checkpoint's recomputation: the first forward's tap receives the gradients
            if module not in self._fallback_calls:
                raise UnsupportedModuleError(
                    f"{self.collector.layers.where(module)} has no per-example rule and runs inside a reentrant checkpoint, "
                    "whose untracked first forward the torch.func fallback cannot follow: use non-reentrant "
                    "checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False}), or freeze it"
                )
            return tap_call(self.collector.anchor, args, kwargs, output, lambda *_: None)
        names = [*self.collector.owned[module], *sorted(self._joined.pop(module, ()))]
        if len(names) > len(self.collector.owned[module]) and self.collector.layer_points is not None:
            self.collector.layer_points.complete = (
                False  # reads no module call marks: the layer-by-layer pass would miss them
            )
        for name in names[
            len(self.collector.owned[module]) :
        ]:  # each joined read is one more use of that parameter
            pid = id(module.get_parameter(name))
            self.collector.uses[pid] = self.collector.uses.get(pid, 0) + 1
        call = self.collector.count(module, x, is_checkpointing())
        self._fallback_calls.add(module)

        def receive(call_args: tuple, call_kwargs: dict, grads: list[torch.Tensor | None]) -> None:
            self.suspended = True  # the fallback re-runs the module (and its submodules): nothing to record
            try:
                with torch.enable_grad():
                    found = per_call_grads(
                        ModuleCall(module, call_args, call_kwargs, grads, count, rows), names
                    )
            finally:
                self.suspended = False
            self.collector.add_found(module, found, call, names)

        return tap_call(self.collector.anchor, args, kwargs, output, receive)

    def rows_at(self, module: nn.Module, x: torch.Tensor | None) -> ExampleRows | None:
        """The example of each row of a flattened input (rows.py): tracked in the first forward, and the same in a
        checkpoint's recomputation (the backward runs untracked), where the module's single use recomputes it."""
        if not self.collector.counting and module in self._flattened:
            found = self._flattened[module]
            if x is not None and found.holds(x):
                return found
        rows = batch_rows(self.collector.layers, module, x, self.collector.rows, self.collector.tracking)
        if rows is not None and self.collector.counting:
            if module in self._flattened:
                raise UnsupportedModuleError(
                    f"{self.collector.layers.where(module)} takes flattened rows in more than one call, which a checkpoint's "
                    "recomputation cannot tell apart: turn checkpointing off, or freeze it"
                )
            self._flattened[module] = rows
        return rows
