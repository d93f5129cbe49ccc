"""Activation checkpointing's weighted pass without the model's tail.

The tail is what runs after the last checkpointed block: a causal LM's final norm and LM head, and the loss. It is
position-wise (each position's loss depends on the body only through that position's hidden state h), so
∂L_i/∂h is ∂(Σ_j L_j)/∂h restricted to unit i's rows or tokens, and the weighted pass's gradient at h is

    ∂(Σ_i c_i L_i)/∂h = spread(c) ⊙ ∂(Σ_j L_j)/∂h        (spread: c_i on each row or token of unit i).

So the norm pass keeps ∂(Σ_j L_j)/∂h (B·T·d floats) and the tail's per-example gradients G_i (explicit, or the
layer's factors when those are smaller), and the weighted pass runs the body alone: forward up to h, backward
from h with spread(c) ⊙ ∂(Σ L)/∂h, plus Σ_i c_i G_i for the tail's parameters. That drops the LM head's forward,
both of its backward GEMMs and the loss from the second pass (a third of a checkpointed Llama 8×512 step at
vocabulary 32k).

The same holds with h the input of a checkpointed layer wherever no unit's loss reads another unit's rows or tokens
(rows apart; packed records kept apart by their attention, checks.check_records_apart): the tail may reach down
over the last layers (``TailFinder.begin_backward``) while their per-example gradients fit a budget. Each layer so kept leaves the
weighted pass without its recomputation and backward: three of the seven layer-forwards a checkpointed DP step
costs, against four for the stock step. The first step checks the result against the whole weighted pass and uses
the whole pass for good if they differ (a loss term that reaches the body other than through h, e.g. a router's
auxiliary loss).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_dp.clipping.per_example import Dropped, OuterProductSum, PerExampleGradient, Weighted, clipped_total
from hf_dp.clipping.rules import parameter_at
from hf_dp.clipping.units import PrivacyUnits


@dataclass
class TailBoundary:
    """The tail's input h: the input of its first module's ``call``-th call (``at_output``: the output of the last
    checkpointed layer's call, where no clipped parameter follows it), and ∂(Σ_i L_i)/∂h from the norm pass (kept
    only if ``wanted`` by the time the backward reaches h)."""

    module: nn.Module
    call: int
    gradient: torch.Tensor | None = None
    wanted: bool = True
    at_output: bool = False

    def watch(self, hidden: torch.Tensor) -> None:
        """Keep h's gradient when the norm pass's backward reaches it."""

        def keep(gradient: torch.Tensor | None) -> None:
            if self.wanted and gradient is not None:  # None: a later backward that does not reach h (a check's)
                self.gradient = gradient.detach().clone()

        hidden.register_hook(keep)


@dataclass
class LayerCall:
    """A checkpointed layer's call in the norm pass's forward: the number of the first use inside it (taps.py), and
    its input as a candidate boundary."""

    first_use: int
    boundary: TailBoundary
    differentiable: bool  # its input requires a gradient (h, where the body's backward would start)


@dataclass
class Tail:
    """What the norm pass kept of the tail: its boundary and each use's per-example gradients."""

    boundary: TailBoundary
    parts: list[tuple[nn.Parameter, PerExampleGradient]] = field(default_factory=list)

    def hidden_gradient(
        self, factors: torch.Tensor, units: PrivacyUnits | None, some_zero: bool = True
    ) -> torch.Tensor:
        """spread(c) ⊙ ∂(Σ_i L_i)/∂h (``weighted_by_units``)."""
        return weighted_by_units(self.boundary.gradient, factors, units, some_zero)

    def take_parts(self) -> list[tuple[nn.Parameter, PerExampleGradient]]:
        """The tail's per-example gradients, handed over once: the list the norm pass filled is emptied, so nothing
        else holds them."""
        parts = list(self.parts)
        self.parts.clear()
        return parts

    def clipped_sums(
        self, factors: torch.Tensor, dropped: Dropped | None = None
    ) -> dict[nn.Parameter, torch.Tensor]:
        """Σ_i c_i G_i per tail parameter (all its tail uses), float32 or wider."""
        return clipped_sums(self.parts, factors, dropped)


class TailFinder:
    """Which uses of the norm pass's first forward form the tail, and the tail's per-example gradients as the
    backward reaches them. The tail is every use after the last checkpointed one, or (``begin_backward``) every use
    from the first inside the lowest checkpointed layer it reaches down to: on the first step over the last layers
    whose B per-example gradients fit ``floats``, on later steps over exactly the ``layers`` the first step checked.
    ``checked_by_grad``: the first step checks the tail with ``autograd.grad`` (through a framework), which a
    reentrant checkpoint refuses, so under one it reaches down over no layer. ``at_exit``: where no clipped
    parameter is used after the last checkpointed layer (a frozen final norm and head: LoRA), the tail starts at
    that layer's output.

    Driven through ``use`` (each use of the first forward), ``watching`` (the checkpointed layers' calls),
    ``begin_backward``, then ``holds`` / ``keep`` in the backward and ``tail`` after it."""

    def __init__(
        self,
        owned: dict[nn.Module, list[str]],
        count: int,
        floats: int = 0,
        layers: int | None = None,
        checked_by_grad: bool = False,
        at_exit: bool = False,
    ) -> None:
        self.owned, self.count = owned, count
        self.floats, self.layers, self.checked_by_grad, self.at_exit = (
            floats,
            layers,
            checked_by_grad,
            at_exit,
        )
        self.reached = 0  # how many checkpointed layers the tail reaches down over
        self._forward = True  # uses are numbered in the first forward only (not in recomputations)
        self._saw_reentrant = False  # a use was numbered inside a reentrant checkpoint
        self._calls, self._last_checkpointed = 0, 0
        self._calls_of: dict[nn.Module, int] = {}
        self._boundary: tuple[int, TailBoundary] | None = None  # right after the last checkpointed use
        self._layer_calls: list[LayerCall] = []
        self._deep: LayerCall | None = None  # the lowest checkpointed layer call the tail reaches down over
        # the last checkpointed layer call's output, with the number of uses before it
        self._exit: tuple[int, TailBoundary] | None = None
        self._unreachable = False  # the forward lacks the layers ``layers`` asks for: no tail
        self._deep_modules: set[nn.Module] = set()  # the modules inside the layers the tail reaches down over
        self._parts: list[tuple[nn.Parameter, PerExampleGradient]] = []

    def use(
        self, module: nn.Module, x: torch.Tensor | None, checkpointed: bool, reentrant: bool = False
    ) -> int:
        """One more use in the first forward; its number. ``x``: its input, the tail's input where it is the first
        use after the last checkpointed one (None, ``reentrant``: numbered under a reentrant checkpoint's no_grad)."""
        self._calls += 1
        self._calls_of[module] = self._calls_of.get(module, 0) + 1
        self._saw_reentrant |= reentrant
        if checkpointed:
            self._last_checkpointed = self._calls
        after_last = self._last_checkpointed and self._calls == self._last_checkpointed + 1
        if after_last and not checkpointed and x is not None and x.requires_grad:
            self._boundary = (self._calls, TailBoundary(module, self._calls_of[module]))
            self._boundary[1].watch(x)
        return self._calls

    @contextlib.contextmanager
    def watching(self, layers: Sequence[nn.Module]) -> Iterator[None]:
        """During the forward: note each call of a checkpointed layer and watch its input, a candidate for the
        tail's boundary, and (``at_exit``) the last call's output."""
        if not ((self.floats or self.layers or self.at_exit) and layers):
            yield
            return

        def enter(layer: nn.Module, args: tuple) -> None:
            if not self._forward:
                return
            calls = sum(1 for c in self._layer_calls if c.boundary.module is layer) + 1
            boundary = TailBoundary(layer, calls, wanted=False)
            hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
            differentiable = hidden is not None and hidden.requires_grad
            if differentiable:
                boundary.watch(hidden)
            self._layer_calls.append(LayerCall(self._calls + 1, boundary, differentiable))

        def leave(layer: nn.Module, args: tuple, output: object) -> None:
            if not (self._forward and self.at_exit):
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

    @property
    def saw_reentrant(self) -> bool:
        """A use was numbered inside a reentrant checkpoint (whose recomputation ``autograd.grad`` cannot see)."""
        return self._saw_reentrant

    def begin_backward(self) -> None:
        """After the forward: reach the tail down over the last checkpointed layers, each called once with a
        differentiable input, as far as ``floats`` or ``layers`` allow (a loss term on a hidden state between two
        boundaries would be exact at one and not the other)."""
        self._forward = False
        calls = self._layer_calls
        reachable = len({id(c.boundary.module) for c in calls}) == len(calls) and not (
            self.checked_by_grad and self._saw_reentrant
        )
        reached, kept = [], 0
        for call in reversed(calls if reachable else []):
            size = sum(self.explicit_floats(m) for m in call.boundary.module.modules() if m in self.owned)
            fits = len(reached) < self.layers if self.layers is not None else kept + size <= self.floats
            if not call.differentiable or not fits:
                break
            kept += size
            reached.append(call)
        if self.layers is not None and len(reached) != self.layers:
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
        its parameters. Kept as factors where those are smaller (``keep_form``), they are not counted smaller: at
        8 x 1024, T 256 that raised the peak to 1.12x the stock step's for 3% of its time
        (benchmarks/results/archive/llm_memory_ckpt_cpu_8x1024_T256_B4_factors_counted.md)."""
        return self.count * sum(parameter_at(module, name).numel() for name in self.owned[module])

    def holds(self, module: nn.Module, call: int) -> bool:
        """Whether a use belongs to the tail: by its number in the first forward, or (a reentrant checkpoint's
        recomputation, which is tapped unnumbered) by the layer it is inside."""
        if not self._last_checkpointed:
            return False
        if module in self._deep_modules:
            return True
        first = self._deep.first_use if self._deep is not None else self._last_checkpointed + 1
        return call >= first  # an unnumbered use (0) is not: every number is at least 1

    def unreachable(self) -> None:
        """A use no layer call marks (a parameter read and normalised outside its module): no tail this step."""
        self._unreachable = True

    def keep(self, param: nn.Parameter, part: PerExampleGradient) -> PerExampleGradient:
        """Keep a tail use's per-example gradients for the weighted pass, in the form its norm is computed from."""
        part = keep_form(part, param.shape)
        self._parts.append((param, part))
        return part

    def tail(self) -> Tail | None:
        """After the backward: the tail the weighted pass may skip (None: no checkpointed use, or no tail)."""
        if self._unreachable:
            return None
        if self._deep is not None:
            boundary = self._deep.boundary
            return None if boundary.gradient is None else Tail(boundary, self._parts)
        if self._exit is not None and self._exit[1].wanted:  # wanted only where no tail use follows
            boundary = self._exit[1]
            return None if boundary.gradient is None else Tail(boundary)
        if self._boundary is None or not self._parts:
            return None
        call, boundary = self._boundary
        if call != self._last_checkpointed + 1 or boundary.gradient is None:
            return None
        return Tail(boundary, self._parts)


def clipped_sums(
    parts: list[tuple[nn.Parameter, PerExampleGradient]],
    factors: torch.Tensor,
    dropped: Dropped | None = None,
) -> dict[nn.Parameter, torch.Tensor]:
    """Σ_i c_i G_i per parameter over all its kept uses, float32 or wider, without the examples whose clip factor
    is 0: ``dropped``, or decided here once for all the parameters."""
    uses: dict[nn.Parameter, list[Weighted]] = {}
    for param, part in parts:
        uses.setdefault(param, []).append((1.0, part))
    if uses and dropped is None:
        dropped = Dropped.where(factors == 0)
    return {param: clipped_total(param, weighted, factors, dropped) for param, weighted in uses.items()}


def keep_form(part: PerExampleGradient, shape: torch.Size) -> PerExampleGradient:
    """The smaller exact form of a tail use's per-example gradients: explicit (B, *shape), or the layer's factors."""
    if isinstance(part, OuterProductSum) and part.left.is_floating_point():
        factor_bytes = sum(x.numel() * x.element_size() for x in (part.left, part.right))
        explicit_dtype = torch.promote_types(part.right.dtype, torch.float32)  # explicit G_i: float32+
        explicit_bytes = part.batch_size * shape.numel() * explicit_dtype.itemsize
        if explicit_bytes <= factor_bytes:
            return part.explicit(shape)
    return part


def weighted_by_units(
    gradient: torch.Tensor, factors: torch.Tensor, units: PrivacyUnits | None, some_zero: bool = True
) -> torch.Tensor:
    """spread(c) ⊙ ∂(Σ_i L_i)/∂h, exactly 0 on the rows and tokens of units with c_i = 0 (their gradient may not be
    finite); ``some_zero`` False: no c_i is 0 (the clip's host read found none)."""
    return UnitWeights(factors, units, some_zero)(gradient)


class UnitWeights:
    """``weighted_by_units`` for several gradients of one micro-batch, spread(c) and its zeros formed once per shape.
    Where no c_i is 0 (``some_zero`` False) and each row is one unit, spread(c) has no zero and spread(c) ⊙ ∂h is the
    product alone (the same values, one operator instead of three)."""

    def __init__(self, factors: torch.Tensor, units: PrivacyUnits | None, some_zero: bool = True) -> None:
        self.factors, self.units = factors, units
        self.masked = some_zero or not (units is None or units.is_trivial)
        self._formed: dict[tuple[torch.Size, torch.dtype], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def __call__(self, gradient: torch.Tensor) -> torch.Tensor:
        key = (gradient.shape, gradient.dtype)
        if key not in self._formed:
            weights = spread(self.factors, self.units, gradient.shape).to(gradient.dtype)
            self._formed[key] = (weights, weights != 0 if self.masked else None)
        weights, nonzero = self._formed[key]
        return gradient * weights if nonzero is None else torch.where(nonzero, gradient * weights, 0.0)


def paired(hidden: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """A term whose gradient towards h is ``gradient`` (times the incoming one), as ⟨h, gradient⟩'s is: one operator
    in the backward where the product and its sum take three. Its value is 0."""
    return _Paired.apply(hidden, gradient.to(hidden.dtype))


class _Paired(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        ctx.gradient = gradient
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.gradient * grad, None


def spread(factors: torch.Tensor, units: PrivacyUnits | None, shape: torch.Size) -> torch.Tensor:
    """c per unit → c on each row (or token) of a (R, T, ...) tensor, broadcastable to ``shape``."""
    if units is None or units.is_trivial:
        per_row = factors
    elif units.per_row:
        per_row = factors[units.unit_of_row()]
    else:
        of_token = units.unit_of_token
        per_token = torch.where(of_token >= 0, factors[of_token.clamp(min=0)], 0.0)
        return per_token.reshape(*per_token.shape, *[1] * (len(shape) - 2))
    return per_row.reshape(-1, *[1] * (len(shape) - 1))


class _ReachedBoundary(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _hook_boundary(boundary: TailBoundary, swap: Callable[[torch.Tensor], torch.Tensor | None]):
    """A hook on the boundary's module that hands h (its ``call``-th input, or output) to ``swap``, which may return
    the tensor to go on with; returns the hook's handle."""
    calls = 0

    def counted() -> bool:
        nonlocal calls
        calls += 1
        return calls == boundary.call

    if boundary.at_output:

        def after(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            return swap(output) if counted() else None

        return boundary.module.register_forward_hook(after)

    def before(module: nn.Module, args: tuple) -> tuple | None:
        if not counted():
            return None
        swapped = swap(args[0])
        return None if swapped is None else (swapped, *args[1:])

    return boundary.module.register_forward_pre_hook(before)


def forward_to(boundary: TailBoundary, forward: Callable[[], object]) -> torch.Tensor:
    """Run ``forward`` until it reaches the tail's input h (``boundary``) and return h, without running the tail."""

    def stop(hidden: torch.Tensor) -> None:
        raise _ReachedBoundary(hidden)

    handle = _hook_boundary(boundary, stop)
    try:
        forward()
    except _ReachedBoundary as reached:
        return reached.hidden
    finally:
        handle.remove()
    raise RuntimeError(
        "the weighted pass never reached the tail the norm pass saw: its forward changed between passes"
    )


def forward_from_leaf(
    boundary: TailBoundary, forward: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``forward`` with the tail's input h replaced by a detached leaf copy; return its output and the leaf,
    so that a gradient towards the leaf runs through the tail alone."""
    leaf: torch.Tensor | None = None

    def cut(hidden: torch.Tensor) -> torch.Tensor:
        nonlocal leaf
        leaf = hidden.detach().requires_grad_(True)
        return leaf

    handle = _hook_boundary(boundary, cut)
    try:
        output = forward()
    finally:
        handle.remove()
    if leaf is None:
        raise RuntimeError(
            "the check's forward never reached the tail the norm pass saw: its forward changed between passes"
        )
    return output, leaf
