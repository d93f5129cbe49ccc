"""Activation checkpointing's weighted pass one layer at a time, each segment from its own kept gradient.

Inside a pre-norm block the residual stream passes through points: the input of each of its norms and the block's
output. A parameter used between two points reaches the loss only through the later one (Llama: q, k, v and o
through h_mid = h + attn(norm₁(h)); gate, up and down through the output h_mid + mlp(norm₂(h_mid))); one used
in several segments goes with its last (the backward from there runs through the earlier points). Where no
unit's loss reads another unit's rows or tokens (as for the tail, tail.py), the weighted pass's gradient at a
point r is spread(c) ⊙ ∂(Σ_j L_j)/∂r, which the norm pass's backward computes anyway. So the norm pass keeps
∂(Σ_j L_j)/∂r at every point that follows a clipped parameter (B·T·d floats each) and the norm modules'
per-example gradients G_i (B·d each), and the weighted pass recomputes each layer from its kept input
(replay.py) and back-propagates each segment from its point's spread(c) ⊙ gradient towards the segment's own
parameters only. Nothing runs back from a layer into the one below it, so the linear layers that read a norm's
output (q, k, v, gate, up) skip their input-gradient GEMMs: a fifth of a Llama layer's backward. The norm
modules' part is Σ_i c_i G_i, as the tail's; the parameters used before the first layer (embeddings) get theirs
from a forward that stops at the first layer's input and a backward from its kept gradient.

A norm module this does not recognise, or one narrower than the stream (a per-head q_norm, whose weight then goes
with its segment), only merges two segments, which stays exact (the later point's backward runs through it). A
block whose parameters also reach the loss around its next point is not exact: the first step checks the result
against the whole weighted pass and uses the layer-by-layer pass only if they agree.

The norm pass's side is ``LayerPoints`` (what to keep, watched during the norm pass); the weighted pass's is
``LayerByLayer``: each layer a term of the loss, zero in the forward, whose backward recomputes the layer and gives
its parameters their gradients (``layer_term``), so that a framework whose backward must write the gradients
(DeepSpeed ZeRO-1/2) reduces them as it accumulates them; through a framework the first step checks the pass
against the chained one without writing gradients (``matches_chain``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hf_dp.clipping.checks import sums_match, tensors_match
from hf_dp.clipping.per_example import PerExampleGradient
from hf_dp.clipping.replay import Kept
from hf_dp.clipping.rules import is_rms_norm, parameter_at
from hf_dp.clipping.tail import TailBoundary, UnitWeights, clipped_sums, forward_to, paired, weighted_by_units
from hf_dp.clipping.units import PrivacyUnits


def is_norm(module: nn.Module) -> bool:
    """LayerNorm and the RMSNorms: where one normalises the residual stream, its input is a point."""
    return isinstance(module, nn.LayerNorm) or is_rms_norm(module)


def _width(norm: nn.Module) -> int:
    """How many features a norm normalises together."""
    shape = getattr(norm, "normalized_shape", None)
    return shape[-1] if shape else norm.weight.shape[-1]


def _stream_norms(layer: nn.Module) -> set[nn.Module]:
    """A layer's norms of the residual stream: the widest. Narrower ones normalise an attention head (Qwen 3's
    and Gemma 3's q_norm and k_norm); their input is no point, and their weights go with their segment."""
    norms = [m for m in layer.modules() if is_norm(m)]
    widest = max((_width(m) for m in norms), default=0)
    return {m for m in norms if _width(m) == widest}


class LayerPoints:
    """What the norm pass keeps for the layer-by-layer weighted pass: ∂(Σ_j L_j)/∂r at each point of each
    checkpointed layer (a norm's input, or ``None``: the layer's output) that follows a clipped parameter, at the
    first layer's input, and the per-example gradients of the layers' norm modules."""

    def __init__(self, layers: Sequence[nn.Module], owned: dict[nn.Module, list[str]]) -> None:
        self.layers = list(layers)
        self.owned = owned
        self._layer_of = {m: layer for layer in self.layers for m in layer.modules()}
        self.stream_norms = set().union(
            *(_stream_norms(layer) for layer in self.layers)
        )  # the layers' points
        self.gradients: dict[tuple[nn.Module, nn.Module | None], torch.Tensor] = {}
        # the first layer's input, where the embeddings' part of the weighted pass starts
        self.first_input: TailBoundary | None = None
        self.norm_parts: list[tuple[nn.Parameter, PerExampleGradient]] = []
        self.order: list[nn.Module] = []  # the layers in the order of their calls
        self._used_before = False  # a clipped parameter was used before the first layer
        self.complete = True  # every layer was called once

    def holds_norm(self, module: nn.Module) -> bool:
        """Whether a clipped use is a norm of the residual stream inside a checkpointed layer (its G_i is kept)."""
        return module in self.stream_norms

    def keep_norm_part(self, param: nn.Parameter, part: PerExampleGradient) -> None:
        self.norm_parts.append((param, part))

    def take_norm_parts(self) -> list[tuple[nn.Parameter, PerExampleGradient]]:
        """The norm modules' per-example gradients, handed over once (the points no longer hold them)."""
        parts = list(self.norm_parts)
        self.norm_parts.clear()
        return parts

    def _keep(self, key: tuple[nn.Module, nn.Module | None], point: torch.Tensor) -> None:
        def keep(gradient: torch.Tensor) -> None:
            self.gradients[key] = gradient.detach().clone()

        point.register_hook(keep)

    @contextlib.contextmanager
    def watching(self, counting: Callable[[], bool]) -> Iterator[None]:
        """During the norm pass (forward and backward): watch each point that follows a clipped use in its layer,
        as the first forward (``counting``) found them. A point's gradient arrives through the first forward's
        tensors (non-reentrant checkpointing) or through the recomputation's (reentrant checkpointing, whose first
        forward runs without a graph); a Hugging Face layer runs its own hooks outside the checkpoint."""
        since_point: dict[nn.Module, bool] = {}  # per layer: a clipped use since its last point
        rows: dict[nn.Module, torch.Size] = {}  # per layer: its input's rows
        # the points that follow a clipped use: norms (their input), layers (their output)
        wanted: set[nn.Module] = set()

        def watch(layer: nn.Module, norm: nn.Module | None, hidden: object) -> None:
            point_wanted = (norm if norm is not None else layer) in wanted
            if point_wanted and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                self._keep((layer, norm), hidden)

        def enter(layer: nn.Module, args: tuple) -> None:
            if not counting():
                return
            if layer in self.order:
                self.complete = False
            self.order.append(layer)
            since_point[layer] = False
            hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if hidden is not None:
                rows[layer] = hidden.shape[:1]
            if len(self.order) == 1 and self._used_before and hidden is not None and hidden.requires_grad:
                self.first_input = TailBoundary(layer, 1)
                self.first_input.watch(hidden)

        def used(module: nn.Module, args: tuple) -> None:
            if not counting():
                return
            if module in self._layer_of:
                since_point[self._layer_of[module]] = True
            elif not self.order:
                self._used_before = True

        def point(module: nn.Module, args: tuple) -> None:
            layer = self._layer_of[module]
            if counting():
                hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
                if hidden is not None and hidden.shape[:1] != rows.get(layer, hidden.shape[:1]):
                    self.complete = False  # a norm of flattened rows (OPT): spread(c) has no rows to weight
                if since_point.get(layer):
                    wanted.add(module)
                since_point[layer] = False
            watch(layer, module, args[0] if args else None)

        def leave(layer: nn.Module, args: tuple, output: object) -> None:
            if counting():
                if not isinstance(output, torch.Tensor):
                    self.complete = False
                if since_point.get(layer):
                    wanted.add(layer)
            watch(layer, None, output)

        handles = [layer.register_forward_pre_hook(enter) for layer in self.layers]
        handles += [layer.register_forward_hook(leave) for layer in self.layers]
        for module, layer in self._layer_of.items():
            if module in self.stream_norms:
                handles.append(module.register_forward_pre_hook(point))
            elif module in self.owned and module is not layer:
                handles.append(module.register_forward_pre_hook(used))
        handles += [m.register_forward_pre_hook(used) for m in self.owned if m not in self._layer_of]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def usable(self, kept: Sequence[Kept]) -> bool:
        """Every checkpointed layer was called once, returned one tensor, and its call was kept."""
        return self.complete and len(self.order) == len(kept) and all(k.function is not None for k in kept)

    def below(self, boundary: TailBoundary) -> int:
        """How many layers lie below the tail's input (tail.py): those the tail does not reach down over."""
        if not boundary.at_output and boundary.module in self.order:
            return self.order.index(boundary.module)
        return len(self.order)


@dataclass(frozen=True)
class LayerByLayer:
    """The weighted pass below the tail one layer at a time, from what the norm pass kept (``points``, and the
    layers' calls ``kept``, replay.py) and the clip factors: a term per layer whose backward recomputes it and
    gives its segments' parameters their part (``layer_term``), the embeddings' term (``embeddings_term``), and the
    first step's check against the chained pass (``matches_chain``)."""

    points: LayerPoints
    kept: Sequence[Kept]
    factors: torch.Tensor
    units: PrivacyUnits | None
    some_zero: bool = True  # whether some c_i may be 0 (tail.UnitWeights)

    def layer_term(self, index: int) -> torch.Tensor | None:
        """A zero whose gradient gives the ``index``-th layer's parameters their layer-by-layer part
        when a framework's backward reaches it, so that the framework reduces them as it accumulates them (DeepSpeed
        ZeRO-1/2); None if the layer has no clipped parameter to give."""
        layer = self.points.order[index]
        params = [p for p in self._segment_parameters(layer) if p.requires_grad]
        if not params:
            return None
        return _LayerGradients.apply(
            lambda scale: self._segment_gradients(
                self._recomputed(layer, self.kept[index]), self.factors * scale
            ),
            *params,
        )

    def embeddings_term(self, forward: Callable[[], object]) -> torch.Tensor | None:
        """⟨h₀, spread(c) ⊙ ∂(Σ_j L_j)/∂h₀⟩ at the first layer's input h₀ (``forward`` stopped there), whose gradient is
        the embeddings' part; None where no clipped parameter precedes the first layer."""
        boundary = self.points.first_input
        if boundary is None or boundary.gradient is None:
            return None
        hidden = forward_to(boundary, forward)
        gradient, boundary.gradient = boundary.gradient, None
        if not hidden.requires_grad:
            return None
        return paired(hidden, weighted_by_units(gradient, self.factors, self.units, self.some_zero))

    def matches_chain(self, below: int, top: torch.Tensor, low_precision: bool) -> bool:
        """Whether the layer-by-layer pass equals the chained one, checked without writing ``.grad`` (a framework's
        backward runs once). ``top``: the chained pass's weighted gradient at the top layer's output (the tail's
        input). From the top, each layer is recomputed from its kept input, made a leaf, and back-propagated whole
        from the chain's gradient at its output: its parameters must get what its segments give them (its norm
        modules' Σ_i c_i G_i for theirs), and the gradient at its input is the chain's at the layer below. At the
        bottom the first layer's input must get spread(c) ⊙ its kept gradient (the embeddings' part)."""
        chain = top
        for layer, entry in reversed(list(zip(self.points.order[:below], self.kept[:below], strict=True))):
            kept_top = self.points.gradients.get((layer, None))
            if kept_top is not None and not tensors_match(
                weighted_by_units(kept_top, self.factors, self.units), chain, low_precision
            ):
                return False
            run = self._recomputed(layer, entry, leaf_input=True)
            if run.leaf is None or run.points[-1][1].shape != chain.shape:
                return False  # not a chain (an encoder's output is not the decoder's first input)
            norms = [p for p in self._norm_parameters(layer) if p.requires_grad]
            params = [p for segment in run.segments for p in segment] + norms
            found = torch.autograd.grad(
                run.points[-1][1], [run.leaf, *params], chain, retain_graph=True, allow_unused=True
            )
            chained = {id(p): g for p, g in zip(params, found[1:], strict=True)}
            ours = self._segment_gradients(run, self.factors)
            norm_parts = [(p, part) for p, part in self.points.norm_parts if any(p is q for q in norms)]
            ours.update({id(p): total for p, total in clipped_sums(norm_parts, self.factors).items()})
            if not sums_match(params, ours, chained, low_precision):
                return False
            chain = found[0] if found[0] is not None else torch.zeros_like(run.leaf)
        boundary = self.points.first_input
        if boundary is None or boundary.gradient is None:
            return True
        return tensors_match(
            weighted_by_units(boundary.gradient, self.factors, self.units), chain, low_precision
        )

    def _segment_parameters(self, layer: nn.Module) -> list[nn.Parameter]:
        """The clipped parameters a layer's segments may hold, each once: those of its modules but its norms."""
        found = {
            id(param): param
            for module in layer.modules()
            if module in self.points.owned and module is not layer and module not in self.points.stream_norms
            for param in (parameter_at(module, name) for name in self.points.owned[module])
        }
        return list(found.values())

    def _norm_parameters(self, layer: nn.Module) -> list[nn.Parameter]:
        return [
            parameter_at(m, name)
            for m in layer.modules()
            if m in self.points.stream_norms and m in self.points.owned
            for name in self.points.owned[m]
        ]

    def _recomputed(self, layer: nn.Module, entry: Kept, leaf_input: bool = False) -> _Recomputed:
        """The layer recomputed from its kept call (``_Recomputed``); with ``leaf_input``, its first input made a
        leaf that a backward reaches too."""
        segments: list[list[nn.Parameter]] = [[]]
        points: list[tuple[nn.Module | None, torch.Tensor]] = []

        def used(module: nn.Module, args: tuple) -> None:
            for name in self.points.owned[module]:
                param = parameter_at(module, name)
                if param.requires_grad:
                    for segment in segments:
                        segment[:] = [p for p in segment if p is not param]
                    segments[-1].append(param)

        def point(module: nn.Module, args: tuple) -> None:
            points.append((module, args[0]))
            segments.append([])

        args, leaf = list(entry.args), None
        if leaf_input and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            leaf = args[0] = args[0].detach().requires_grad_(True)
        handles = []
        for module in layer.modules():
            if module in self.points.stream_norms:
                handles.append(module.register_forward_pre_hook(point))
            elif module in self.points.owned and module is not layer:
                handles.append(module.register_forward_pre_hook(used))
        try:
            output = entry.rerun(entry.function, args)
        finally:
            for handle in handles:
                handle.remove()
        points.append((None, output))
        return _Recomputed(layer, points, segments, leaf)

    def _weighted_points(
        self, run: _Recomputed, factors: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[nn.Parameter]]]:
        """Segment k (the parameters last used before point k and after point k - 1) reaches the loss through point
        k: its point, spread(c) ⊙ the point's kept gradient, and its parameters, from the top, each kept gradient
        let go. A backward from a point towards its segment also runs through the earlier points its earlier uses
        feed."""
        weighted = UnitWeights(factors, self.units, self.some_zero)
        for (module, tensor), params in reversed(list(zip(run.points, run.segments, strict=True))):
            gradient = self.points.gradients.pop((run.layer, module), None)
            if params and gradient is not None and tensor.requires_grad:
                yield tensor, weighted(gradient), params

    def _segment_gradients(self, run: _Recomputed, factors: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each segment's gradient from its point, per parameter id, written nowhere."""
        sums: dict[int, torch.Tensor] = {}
        for tensor, gradient, params in self._weighted_points(run, factors):
            found = torch.autograd.grad(tensor, params, gradient, retain_graph=True, allow_unused=True)
            sums.update({id(p): g for p, g in zip(params, found, strict=True) if g is not None})
        return sums


@dataclass
class _Recomputed:
    """A layer recomputed from its kept call: its points (each norm's input, then the layer's output), the
    parameters of the segment below each (a parameter goes with the segment of its last use), and its first input
    as a leaf where asked (None if not, or if that is not a tensor)."""

    layer: nn.Module
    points: list[tuple[nn.Module | None, torch.Tensor]]
    segments: list[list[nn.Parameter]]
    leaf: torch.Tensor | None


class _LayerGradients(torch.autograd.Function):
    """A zero whose backward gives each parameter (the inputs after ``gradients_of``) its gradient from
    ``gradients_of(s)`` (per parameter id), s the incoming gradient (folded into the clip factors): one layer's at a
    time."""

    @staticmethod
    def forward(
        ctx, gradients_of: Callable[[torch.Tensor], dict[int, torch.Tensor]], *params: nn.Parameter
    ) -> torch.Tensor:
        ctx.gradients_of, ctx.params = gradients_of, params
        return params[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        found = ctx.gradients_of(grad)
        # a zero, not None, where no segment reached a parameter: a framework may count on each one's hook firing
        return None, *[found[id(p)] if id(p) in found else torch.zeros_like(p) for p in ctx.params]
