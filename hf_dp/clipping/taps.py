"""Per-example norms computed INSIDE the backward, for models with activation checkpointing.

Book-keeping keeps every layer's input until one backward has produced all output gradients, which is what
activation checkpointing exists to avoid. Here each parameter-owning module's output passes through an
identity ``tap`` that saves the module's input through autograd (so checkpointing drops and recomputes
it like any other saved activation) and, when the output gradient arrives, turns (input, output gradient)
into this module's contribution to ‖s ⊙ g_i‖² with the layer's rule, then lets both go. A parameter used
several times in one forward (tied embeddings, a shared layer) keeps its parts until its last use arrives
and gets the norm of the sum, cross terms included.

Recomputation runs the forward hooks again; uses are counted in the first forward only and norms are added
only in backward, where each tap fires exactly once (non-reentrant checkpointing runs the ORIGINAL graph's
nodes; reentrant checkpointing runs the forward under no_grad, untapped, and taps its recomputation).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hf_dp.clipping.geometry import ClipScale
from hf_dp.clipping.hooks import (
    Layers,
    UnsupportedModuleError,
    check_batch_dimension,
    in_reentrant_checkpoint,
    is_checkpointing,
    tap,
)
from hf_dp.clipping.layerwise import LayerPoints
from hf_dp.clipping.per_example import (
    LOW_PRECISION,
    Materialised,
    OuterProductSum,
    PerExampleGradient,
    combined_squared_norm,
    gram,
)
from hf_dp.clipping.tail import LayerCall, Tail, TailBoundary, keep_form
from hf_dp.clipping.units import PrivacyUnits, regroup_for_rule


@dataclass(frozen=True)
class TapOptions:
    """What the norm pass keeps beside the norms: ``probe`` the first step's projections (``direction``),
    ``keep_gradients`` each example's explicit gradient (few trainable weights: LoRA), ``keep_tail`` what the
    weighted pass needs to skip the model's tail (tail.py), reaching down over the last checkpointed layers while
    their B per-example gradients take at most ``tail_floats`` floats (the first step), or over exactly the
    ``tail_layers`` the first step checked (later steps). ``tail_checked_by_grad``: the first step checks
    the tail with ``autograd.grad`` (through a framework, checks.tail_separable), which a reentrant checkpoint
    refuses, so under one the tail reaches down over no layer. ``tail_at_exit``: where no clipped parameter is used
    after the last checkpointed layer (a frozen final norm and head: LoRA), the tail starts at that layer's output.
    ``layerwise``: also what the weighted pass needs to run the layers below the tail one by one (layerwise.py).
    ``record_layers``: keep the checkpointed layers' outputs for the weighted pass (replay.py), as ``keep_tail``
    does."""

    probe: bool = False
    keep_gradients: bool = False
    keep_tail: bool = False
    tail_floats: int = 0
    tail_layers: int | None = None
    tail_checked_by_grad: bool = False
    tail_at_exit: bool = False
    layerwise: bool = False
    record_layers: bool = False


class _AgainstIds:
    """A dense use G = Σ_t left_t ⊗ right_t kept only as ⟨left_t, onehot(ids_s)⟩ (B, T, S) and right: all the
    cross term with a later embedding use of those ids needs (a tied LM head: B·T·S floats instead of B·T·V)."""

    def __init__(self, part: OuterProductSum, ids: torch.Tensor) -> None:
        self.gram = part.left_gram(OuterProductSum(ids, part.right, part.rows))
        self.right = part.right

    def inner(self, embedding: OuterProductSum) -> torch.Tensor:
        return (self.gram * gram(self.right, embedding.right)).sum(dim=(1, 2))


class NormCollector:
    """Σ over parameters of ‖s ⊙ G_i‖², filled by the taps during one backward of Σ_i L_i.

    ``probe`` (the first step): also ⟨G_i, V_p⟩ for a random V_p per parameter (``direction``, regenerated from
    its seed when needed, never stored), so the strategy can check that the norm pass saw every use of every
    parameter against autograd's gradient. ``keep_tail``: also keep what the weighted pass needs to skip the
    uses after the last checkpointed one (``tail``, see tail.py).
    """

    def __init__(
        self,
        layers: Layers,
        count: int,
        units: PrivacyUnits | None,
        scales: dict[int, ClipScale],
        materialise: bool,
        options: TapOptions,
    ) -> None:
        self.layers, self.scales, self.materialise = layers, scales, materialise
        self.owned = layers.owned
        params = layers.parameters
        device = params[0].device if params else torch.device("cpu")
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        # each scale by where its parameter is used: FSDP2 swaps the module's sharded parameter for an unsharded
        # one (another object) during the forward and backward, so the backward's ids are not the scales' keys
        self._site_scales = {
            (module, name): scales[id(getattr(module, name))]
            for module, names in self.owned.items()
            for name in names
            if id(getattr(module, name)) in scales
        }
        self.units = None if units is None or units.is_trivial else units  # norms per privacy unit (units.py)
        self.rows = count if units is None else units.rows
        self.on = True  # a Receiver (hooks.py) for the whole pass
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.squared = torch.zeros(count, dtype=dtype, device=device)
        self.uses: dict[int, int] = {}  # per parameter, in the first forward
        self.counting = True
        self.low_precision = False  # a tapped output was bf16/fp16 (autocast or low-precision weights)
        self._waiting: dict[int, tuple[nn.Parameter, list[PerExampleGradient]]] = {}
        self._ids: dict[int, torch.Tensor | None] = {}  # an embedding's ids, per parameter used once as one
        self._tied_heads: dict[int, _AgainstIds] = {}
        self.options = options
        self.projections: dict[int, torch.Tensor] = {}
        # few trainable weights (LoRA): keep each example's explicit gradient, so no second pass is needed
        self.kept: dict[int, tuple[nn.Parameter, torch.Tensor]] | None = (
            {} if options.keep_gradients else None
        )
        # the first forward's uses in order: the tail is every use after the last checkpointed one, or (``deepen``)
        # every use from the first inside the lowest checkpointed layer it reaches down to
        self.saw_reentrant = False  # a use was counted inside a reentrant checkpoint
        self._calls, self._last_checkpointed = 0, 0
        self._calls_of: dict[nn.Module, int] = {}
        self._boundary: tuple[int, TailBoundary] | None = None  # (its use's number, the boundary)
        self._layer_calls: list[LayerCall] = []
        self._deep: LayerCall | None = None
        # the last checkpointed layer call's output, with the number of uses before it: the boundary where no clipped
        # parameter is used after it (a frozen head and final norm, LoRA)
        self._exit: tuple[int, TailBoundary] | None = None
        self.reached = 0  # how many checkpointed layers the tail reaches down over
        self._unreachable = False  # the forward lacks the layers ``tail_layers`` asks for: no tail
        self._deep_modules: set[nn.Module] = set()  # the modules inside the layers the tail reaches down over
        self._tail_parts: list[tuple[nn.Parameter, PerExampleGradient]] = []
        self.layer_points: LayerPoints | None = None  # ``layerwise``: set by the norm pass

    def direction(self, param: nn.Parameter) -> torch.Tensor:
        """The probe V_p of a parameter: N(0, I), the same values at every call (one seed; each parameter is checked
        on its own)."""
        generator = torch.Generator(device=param.device).manual_seed(0)
        return torch.randn(param.shape, generator=generator, dtype=self.squared.dtype, device=param.device)

    def admits(self, module: nn.Module) -> bool:
        """Reentrant checkpointing runs the first forward under no_grad: counted here, tapped when recomputed."""
        if self.counting and not torch.is_grad_enabled() and in_reentrant_checkpoint():
            self.count(module, checkpointed=True)
            self.saw_reentrant = True
        return True

    def receive(
        self, module: nn.Module, x: torch.Tensor | None, args: tuple, kwargs: dict, output
    ) -> torch.Tensor:
        check_batch_dimension(self.layers, module, x, self.rows)
        if x is None or not isinstance(output, torch.Tensor):
            raise UnsupportedModuleError(
                f"{self.layers.where(module)} must take a tensor first and return one tensor for its norm to be "
                "computed inside the backward (activation checkpointing): register a rule for a module that does, "
                "or turn checkpointing off"
            )
        return self.tap(module, x, output)

    def count(self, module: nn.Module, checkpointed: bool = False) -> int:
        """One more use of the module's parameters in the forward (not in a recomputation); its number."""
        for name in self.owned[module]:
            pid = id(getattr(module, name))
            self.uses[pid] = self.uses.get(pid, 0) + 1
        self._calls += 1
        self._calls_of[module] = self._calls_of.get(module, 0) + 1
        if checkpointed:
            self._last_checkpointed = self._calls
        return self._calls

    def tap(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        self.low_precision |= output.dtype in LOW_PRECISION
        receive = self.add
        if self.counting:
            checkpointed = is_checkpointing()
            call = self.count(module, checkpointed)
            if isinstance(module, nn.Embedding):
                pid = id(module.weight)
                ids = x if self.units is None else self.units.regroup(x)
                self._ids[pid] = None if pid in self._ids else ids.reshape(ids.shape[0], -1)
            if self.options.keep_tail:
                receive = functools.partial(self.add, call=call)  # its number tells whether it is in the tail
                after_last = self._last_checkpointed and call == self._last_checkpointed + 1
                if after_last and not checkpointed and x.requires_grad:
                    self._boundary = (call, TailBoundary(module, self._calls_of[module]))
                    self._boundary[1].watch(x)
        return tap(output, self.anchor, receive, module, x)

    @contextlib.contextmanager
    def watching(self, layers: Sequence[nn.Module]) -> Iterator[None]:
        """During the forward (``tail_floats`` > 0, or ``tail_at_exit``): note each call of a checkpointed layer and
        watch its input, a candidate for the tail's boundary, and (``tail_at_exit``) the last call's output."""
        options = self.options
        if not (
            options.keep_tail
            and (options.tail_floats or options.tail_layers or options.tail_at_exit)
            and layers
        ):
            yield
            return

        def enter(layer: nn.Module, args: tuple) -> None:
            if not self.counting:
                return
            calls = sum(1 for c in self._layer_calls if c.boundary.module is layer) + 1
            boundary = TailBoundary(layer, calls, wanted=False)
            hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
            differentiable = hidden is not None and hidden.requires_grad
            if differentiable:
                boundary.watch(hidden)
            self._layer_calls.append(LayerCall(self._calls + 1, boundary, differentiable))

        def leave(layer: nn.Module, args: tuple, output: object) -> None:
            if not (self.counting and options.tail_at_exit):
                return
            self._exit = None
            if isinstance(output, torch.Tensor) and output.requires_grad:
                call = self._layer_calls[-1].boundary.call  # this call's number, counted by ``enter``
                boundary = TailBoundary(layer, call, wanted=False, at_output=True)
                boundary.watch(output)
                self._exit = (self._calls, boundary)

        handles = [layer.register_forward_pre_hook(enter) for layer in layers]
        handles += [layer.register_forward_hook(leave) for layer in layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def deepen(self) -> None:
        """After the forward, before the backward: reach the tail down over the last checkpointed layers, each called
        once with a differentiable input: the first step over those whose B per-example gradients
        (``explicit_floats``) fit ``tail_floats``, later steps over the ``tail_layers`` it checked (a loss term on a hidden state between
        two boundaries would be exact at one and not the other)."""
        calls = self._layer_calls
        reachable = len({id(c.boundary.module) for c in calls}) == len(calls) and not (
            self.options.tail_checked_by_grad and self.saw_reentrant
        )
        reached, kept = [], 0
        for call in reversed(calls if reachable else []):
            size = sum(self.explicit_floats(m) for m in call.boundary.module.modules() if m in self.owned)
            if self.options.tail_layers is not None:
                fits = len(reached) < self.options.tail_layers
            else:
                fits = kept + size <= self.options.tail_floats
            if not call.differentiable or not fits:
                break
            kept += size
            reached.append(call)
        if self.options.tail_layers is not None and len(reached) != self.options.tail_layers:
            self._unreachable = True
            return
        self.reached = len(reached)
        if not reached:
            if self._boundary is None and self._exit is not None and self._exit[0] == self._calls:
                self._exit[1].wanted = True  # no clipped parameter after the last layer: h is its output
            return
        self._deep = reached[-1]
        self._deep.boundary.wanted = True
        self._deep_modules = {m for call in reached for m in call.boundary.module.modules()}
        if self._boundary is not None:
            self._boundary[1].wanted = False

    def explicit_floats(self, module: nn.Module) -> int:
        """The budget's measure of what a tail keeps of a module's per-example gradients: B explicit gradients of
        its parameters. Kept as factors where those are smaller (tail.keep_form), they are not counted smaller: at
        8 x 1024, T 256 that raised the peak to 1.12x the stock step's for 3% of its time
        (benchmarks/results/archive/llm_memory_ckpt_cpu_8x1024_T256_B4_factors_counted.md)."""
        return self.squared.shape[0] * sum(getattr(module, name).numel() for name in self.owned[module])

    def in_tail(self, module: nn.Module, call: int) -> bool:
        """Whether a use belongs to the tail: by its number in the first forward, or (a reentrant checkpoint's
        recomputation, which is tapped unnumbered) by the layer it is inside."""
        if not self._last_checkpointed:
            return False
        if module in self._deep_modules:
            return True
        first = self._deep.first_use if self._deep is not None else self._last_checkpointed + 1
        return call >= first  # an unnumbered use (0) is not: every number is at least 1

    def tail(self) -> Tail | None:
        """After the backward: the tail the weighted pass may skip (None: no checkpointed use, or no tail)."""
        if self._unreachable:
            return None
        if self._deep is not None:
            boundary = self._deep.boundary
            return None if boundary.gradient is None else Tail(boundary, self._tail_parts)
        if self._exit is not None and self._exit[1].wanted:  # wanted only where no tail use follows (deepen)
            boundary = self._exit[1]
            return None if boundary.gradient is None else Tail(boundary)
        if self._boundary is None or not self._tail_parts:
            return None
        call, boundary = self._boundary
        if call != self._last_checkpointed + 1 or boundary.gradient is None:
            return None
        return Tail(boundary, self._tail_parts)

    def add(self, module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor, call: int = 0) -> None:
        x, grad_output = regroup_for_rule(self.units, x, grad_output, self.layers.where(module))
        found = self.layers.rules[module](module, x, grad_output)
        in_tail = self.options.keep_tail and self.in_tail(module, call)
        for name in self.owned[module]:
            param = getattr(module, name)
            pid, part = id(param), found[name]
            if in_tail:  # kept for the weighted pass, in the form its norm is also computed from
                part = keep_form(part, param.shape)
                self._tail_parts.append((param, part))
            elif self.layer_points is not None and self.layer_points.holds_norm(module):
                part = keep_form(part, param.shape)
                self.layer_points.keep_norm_part(param, part)
            if (module, name) in self._site_scales:
                self.scales[pid] = self._site_scales[module, name]
            if self.options.probe:
                projection = part.project(self.direction(param))
                self.projections[pid] = self.projections.get(pid, 0) + projection
            if self.kept is not None:
                grads = part.explicit(param.shape).grads
                if pid in self.kept:
                    self.kept[pid][1].add_(grads)  # another use: the per-example gradient is the sum
                else:
                    self.kept[pid] = (param, grads)
                continue
            if self.uses.get(pid, 1) <= 1:
                self._add_norm(param, [part])
                continue
            if pid in self._tied_heads and isinstance(part, OuterProductSum) and part.is_index:
                head = self._tied_heads.pop(
                    pid
                )  # ‖G_head + G_emb‖² = ‖G_head‖² + ‖G_emb‖² + 2⟨G_head, G_emb⟩
                self.squared += (part.squared_norm(False) + 2 * head.inner(part)).to(self.squared)
                continue
            if self._is_tied_head(pid, part):
                self._tied_heads[pid] = _AgainstIds(part, self._ids[pid])
                self.squared += part.squared_norm(False).to(self.squared)
                continue
            _, parts = self._waiting.setdefault(pid, (param, []))
            parts.append(part)
            if len(parts) == self.uses[pid]:
                self._add_norm(*self._waiting.pop(pid))

    def _is_tied_head(self, pid: int, part: PerExampleGradient) -> bool:
        """The first of exactly two uses, dense, and the other one an embedding whose ids the forward showed."""
        return (
            self.uses[pid] == 2
            and pid not in self._waiting
            and self._ids.get(pid) is not None
            and pid not in self.scales
            and not self.materialise
            and isinstance(part, OuterProductSum)
            and not part.is_index
        )

    def _add_norm(self, param: nn.Parameter, parts: list[PerExampleGradient]) -> None:
        shape = getattr(param, "ds_shape", param.shape)  # DeepSpeed ZeRO-3 partitions to shape (0,)
        terms = [(1.0, part) for part in parts]
        self.squared += combined_squared_norm(terms, self.scales.get(id(param)), shape, self.materialise).to(
            self.squared
        )

    def norms(self) -> torch.Tensor:
        """‖s ⊙ g_i‖, shape (B,), once the backward is done (call once); a use whose output got no gradient
        simply contributed nothing."""
        for param, parts in self._waiting.values():
            self._add_norm(param, parts)
        self._waiting.clear()
        self._tied_heads.clear()  # its embedding use got no gradient: ‖G_head‖² is already in
        for param, grads in (self.kept or {}).values():
            self._add_norm(param, [Materialised(grads)])
        return self.squared.clamp(min=0).sqrt()

    def kept_gradients(self) -> list[tuple[nn.Parameter, Materialised]]:
        """The explicit per-example gradients (``keep_gradients``), to be summed with the clip factors."""
        return [(param, Materialised(grads)) for param, grads in (self.kept or {}).values()]
