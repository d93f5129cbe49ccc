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
from hf_dp.clipping.groups import GroupSums
from hf_dp.clipping.hooks import (
    Layers,
    UnsupportedModuleError,
    in_reentrant_checkpoint,
    is_checkpointing,
    tap,
)
from hf_dp.clipping.layerwise import LayerPoints
from hf_dp.clipping.per_example import (
    Materialised,
    OuterProductSum,
    PerExampleGradient,
    combined_squared_norm,
)
from hf_dp.clipping.row_maps import ExampleRows
from hf_dp.clipping.rows import RowTracking
from hf_dp.clipping.rules import parameter_at
from hf_dp.clipping.tail import Tail, TailFinder, keep_form
from hf_dp.clipping.tap_uses import OtherUses
from hf_dp.clipping.units import PrivacyUnits, regroup_for_rule
from hf_dp.clipping.wide_gemm import LOW_PRECISION, gram


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


def _tail_finder(owned: dict[nn.Module, list[str]], count: int, options: TapOptions) -> TailFinder | None:
    """What the weighted pass needs to skip the model's tail (tail.py), where ``options.keep_tail``."""
    if not options.keep_tail:
        return None
    return TailFinder(
        owned,
        count,
        options.tail_floats,
        options.tail_layers,
        options.tail_checked_by_grad,
        options.tail_at_exit,
    )


class UseSites:
    """A clipped parameter's clip scale and group by the qualified names of its uses (a tied one has several): FSDP2
    swaps a module's sharded parameter for an unsharded one (another object) during the forward and backward, so
    the backward's ids are not the ids the step was given, while a use's module and name are stable."""

    def __init__(self, layers: Layers, scales: dict[int, ClipScale], group_of: dict[int, int]) -> None:
        self.module_names = layers.module_names
        named = list(layers.model.named_parameters(remove_duplicate=False))
        self.scales = {name: scales[id(p)] for name, p in named if id(p) in scales}
        self.groups = {name: group_of[id(p)] for name, p in named if id(p) in group_of}

    def name(self, module: nn.Module, name: str) -> str:
        """The qualified name of ``module``'s parameter ``name`` (its own, or a nested one a fallback covers)."""
        prefix = self.module_names.get(module, "")
        return f"{prefix}.{name}" if prefix else name


class NormCollector:
    """Σ over parameters of ‖s ⊙ G_i‖², filled by the taps during one backward of Σ_i L_i.

    ``probe`` (the first step): also ⟨G_i, V_p⟩ for a random V_p per parameter (``direction``, regenerated from
    its seed when needed, never stored), so the strategy can check that the norm pass saw every use of every
    parameter against autograd's gradient. ``keep_tail``: also keep what the weighted pass needs to skip the
    tail (``tail_finder``, tail.TailFinder). Driven through ``forward`` (the first forward), ``begin_backward``,
    then ``norms`` once the backward is done.
    """

    def __init__(
        self,
        layers: Layers,
        count: int,
        units: PrivacyUnits | None,
        scales: dict[int, ClipScale],
        materialise: bool,
        options: TapOptions,
        tracking: RowTracking,
        group_sums: GroupSums | None = None,
    ) -> None:
        self.layers, self.scales, self.materialise = layers, scales, materialise
        self.tracking = tracking
        self.others = OtherUses(self)  # flattened rows, shared inputs, loose reads, modules without a rule
        self.group_sums = group_sums  # group-wise clipping: each group's clipped sum formed in the backward
        self.owned = layers.owned
        params = layers.parameters
        device = params[0].device if params else torch.device("cpu")
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        self.sites = UseSites(layers, scales, group_sums.group_of if group_sums is not None else {})
        self._group_of: dict[int, int] = {}  # each parameter's group by the backward's ids
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
        self.tail_finder = _tail_finder(
            self.owned, count, options
        )  # what the weighted pass needs to skip the tail
        self.layer_points: LayerPoints | None = None  # ``layerwise``: set by the norm pass

    def direction(self, param: nn.Parameter) -> torch.Tensor:
        """The probe V_p of a parameter: N(0, I), the same values at every call (one seed; each parameter is checked
        on its own)."""
        generator = torch.Generator(device=param.device).manual_seed(0)
        return torch.randn(param.shape, generator=generator, dtype=self.squared.dtype, device=param.device)

    def admits(self, module: nn.Module) -> bool:
        """Reentrant checkpointing runs the first forward under no_grad: counted here, tapped when recomputed."""
        if self.others.suspended:
            return False
        if self.counting and not torch.is_grad_enabled() and in_reentrant_checkpoint():
            self.count(module, None, checkpointed=True, reentrant=True)
        return True

    def receive(
        self, module: nn.Module, x: torch.Tensor | None, args: tuple, kwargs: dict, output
    ) -> torch.Tensor:
        others = self.others
        if not others.flattened(module) and self.tracking.takes_shared(x, self.rows):
            return others.shared_use(module, x, output)
        rows = others.rows_at(module, x)
        if self.layers.rules[module] is None:
            return others.fallback(module, x, args, kwargs, output, rows)
        if x is None or not isinstance(output, torch.Tensor):
            raise UnsupportedModuleError(
                f"{self.layers.where(module)} must take a tensor first and return one tensor for its norm to be "
                "computed inside the backward (activation checkpointing): register a rule for a module that does, "
                "or turn checkpointing off"
            )
        return self.tracking.carried(output, self.tap(module, x, output, rows))

    def loose_use(self, module: nn.Module, name: str, param: nn.Parameter) -> torch.Tensor:
        return self.others.loose_use(module, name, param)

    def joins(self, module: nn.Module, name: str) -> None:
        self.others.joins(module, name)

    def count(
        self, module: nn.Module, x: torch.Tensor | None, checkpointed: bool = False, reentrant: bool = False
    ) -> int:
        """One more use of the module's parameters in the forward (not in a recomputation); its number in the tail
        finder (0 without one)."""
        for name in self.owned[module]:
            pid = id(parameter_at(module, name))
            self.uses[pid] = self.uses.get(pid, 0) + 1
        return 0 if self.tail_finder is None else self.tail_finder.use(module, x, checkpointed, reentrant)

    def tap(
        self, module: nn.Module, x: torch.Tensor, output: torch.Tensor, rows: ExampleRows | None = None
    ) -> torch.Tensor:
        self.low_precision |= output.dtype in LOW_PRECISION
        receive = functools.partial(self.add, rows=rows)
        if self.counting:
            call = self.count(module, x, is_checkpointing())
            if isinstance(module, nn.Embedding):
                pid = id(module.weight)
                ids = x if rows is None else rows.as_examples(x)[0]
                ids = ids if self.units is None else self.units.regroup(ids)
                self._ids[pid] = None if pid in self._ids else ids.reshape(ids.shape[0], -1)
            if self.tail_finder is not None:  # its number tells whether it is in the tail
                receive = functools.partial(self.add, call=call, rows=rows)
        return tap(output, self.anchor, receive, module, x)

    @contextlib.contextmanager
    def forward(self, layers: Sequence[nn.Module], points: LayerPoints | None) -> Iterator[None]:
        """The norm pass's first forward: its uses counted, the checkpointed ``layers`` watched for the tail
        (tail.TailFinder) and, with ``points``, for the layer-by-layer pass (layerwise.py)."""
        self.layer_points = points
        with (
            self.tail_finder.watching(layers) if self.tail_finder else contextlib.nullcontext(),
            points.watching(lambda: self.counting) if points else contextlib.nullcontext(),
        ):
            yield

    def begin_backward(self) -> None:
        """Between the forward and the backward: recomputations are not uses, and the tail reaches down."""
        self.counting = False
        if self.tail_finder is not None:
            self.tail_finder.begin_backward()

    def tail(self) -> Tail | None:
        """After the backward: the tail the weighted pass may skip (tail.TailFinder.tail), or None."""
        return None if self.tail_finder is None else self.tail_finder.tail()

    @property
    def reached(self) -> int:
        """How many checkpointed layers the tail reaches down over."""
        return 0 if self.tail_finder is None else self.tail_finder.reached

    def add(
        self,
        module: nn.Module,
        x: torch.Tensor,
        grad_output: torch.Tensor,
        call: int = 0,
        rows: ExampleRows | None = None,
    ) -> None:
        self.add_found(module, self.rule(module, x, grad_output, rows), call)

    def rule(
        self, module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor, rows: ExampleRows | None
    ) -> dict[str, PerExampleGradient]:
        x, grad_output = regroup_for_rule(self.units, x, grad_output, self.layers.where(module), rows)
        return self.layers.rules[module](module, x, grad_output)

    def add_found(
        self, module: nn.Module, found: dict[str, PerExampleGradient], call: int, names: Sequence[str] = ()
    ) -> None:
        """The module's per-example gradients of one use, into the norms (or kept, or in the tail); ``names``: its
        own and the nested ones a fallback covers (default: its own)."""
        in_tail = self.tail_finder is not None and self.tail_finder.holds(module, call)
        for name in names or self.owned[module]:
            if name not in found:  # a parameter read directly (shared.py): that one alone
                continue
            param = module.get_parameter(name)
            pid, part = id(param), found[name]
            if in_tail:  # kept for the weighted pass, in the form its norm is also computed from
                part = self.tail_finder.keep(param, part)
            elif self.layer_points is not None and self.layer_points.holds_norm(module):
                part = keep_form(part, param.shape)
                self.layer_points.keep_norm_part(param, part)
            site = self.sites.name(module, name)
            if site in self.sites.scales:
                self.scales[pid] = self.sites.scales[site]
            if site in self.sites.groups:
                self._group_of[pid] = self.sites.groups[site]
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
                # ‖G_head + G_emb‖² = ‖G_head‖² + ‖G_emb‖² + 2⟨G_head, G_emb⟩
                head = self._tied_heads.pop(pid)
                self.squared += (part.squared_norm(False) + 2 * head.inner(part)).to(self.squared)
                continue
            if self._is_tied_head(pid, part):
                self._tied_heads[pid] = _AgainstIds(part, self._ids[pid])
                part.squared_norm(False, into=self.squared)
                continue
            _, parts = self._waiting.setdefault(pid, (param, []))
            parts.append(part)
            if len(parts) == self.uses[pid]:
                self._add_norm(*self._waiting.pop(pid))

    def _is_tied_head(self, pid: int, part: PerExampleGradient) -> bool:
        """The first of exactly two uses, dense, and the other one an embedding whose ids the forward showed."""
        return (
            self.uses[pid] == 2
            and self.group_sums is None  # a group's sum needs the head's per-example gradients whole
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
        scale = self.scales.get(id(param))
        if self.group_sums is not None:
            self.group_sums.add(self._group_of[id(param)], param, terms, scale, shape, self.materialise)
        else:
            combined_squared_norm(terms, scale, shape, self.materialise, into=self.squared)

    def norms(self) -> torch.Tensor:
        """‖s ⊙ g_i‖, shape (B,), or per group (B, G), once the backward is done (call once); a use whose output
        got no gradient simply contributed nothing."""
        for module, found, call in self.others.shared_parts():
            self.add_found(module, found, call)
        for param, parts in self._waiting.values():
            self._add_norm(param, parts)
        self._waiting.clear()
        self._tied_heads.clear()  # its embedding use got no gradient: ‖G_head‖² is already in
        for param, grads in (self.kept or {}).values():
            self._add_norm(param, [Materialised(grads)])
        if self.group_sums is not None:
            return self.group_sums.finish()
        return self.squared.clamp(min=0).sqrt()

    def kept_gradients(self) -> list[tuple[nn.Parameter, Materialised]]:
        """The explicit per-example gradients (``keep_gradients``), to be summed with the clip factors."""
        return [(param, Materialised(grads)) for param, grads in (self.kept or {}).values()]
