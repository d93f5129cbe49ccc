"""What a clipped step computes of Σ_i c_i g_i once the clip factors c_i are known: the maths, not its delivery.

Each sum pass returns a ``Sum``: per-example gradients whose clipped sum is formed directly (``parts``), and a
scalar whose gradient is the rest (``surrogate``), or sums already formed (``totals``). How they reach the gradients is delivery.py's job.

- ``FactoredSum``: book-keeping's factored per-example gradients (Bu et al. 2023), one GEMM a layer.
- ``KeptSum``: the explicit per-example gradients the norm pass kept (LoRA: one pass).
- ``GroupedSum``: group-wise clipping, whose sums the norm pass's backward formed (groups.py).
- ``WholeSum``: Σ_i c_i L_i of a second forward with the norm pass's dropout masks (the weighted pass).
- ``BodySum``: the weighted pass without the tail (tail.py): the tail's per-example gradients as parts, and the
  body's surrogate from the tail's input h, the checkpointed layers replayed (replay.py) as one chain, or one
  layer at a time (layerwise.py).

Each declares in ``keeps`` what the norm pass must keep for it beside the norms (None: book-keeping's recording).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol

import torch
from torch import nn

from hf_dp.clipping.checks import TOLERANCES
from hf_dp.clipping.layerwise import LayerByLayer
from hf_dp.clipping.norm_passes import Batch, FoundNorms, LossFn
from hf_dp.clipping.per_example import Dropped, PerExampleGradient, Weighted
from hf_dp.clipping.rng_replay import replay_rng
from hf_dp.clipping.tail import Tail, forward_to, paired
from hf_dp.clipping.taps import TapOptions

Surrogate = Callable[[], torch.Tensor]


@dataclass
class Sum:
    """Σ_i c_i g_i as computed: ``parts`` per parameter, whose Σ_e w_e Σ_i c_i G_i^e is formed directly without the
    ``drop`` examples (0 · inf would be nan), and ``surrogate`` (None: none), a scalar built when called whose
    gradient is the rest. ``lazy``: the parts stay alive anyway (book-keeping's recording, the kept gradients), so
    a framework may form each parameter's sum when its backward reaches it; otherwise the sums are formed before the
    surrogate's backward and the parts let go."""

    parts: list[tuple[nn.Parameter, list[Weighted]]]
    surrogate: Surrogate | None
    drop: Dropped
    lazy: bool = False
    totals: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)  # sums already formed (group-wise)

    def take_parts(self) -> list[tuple[nn.Parameter, list[Weighted]]]:
        """The parts, handed over once (this ``Sum`` no longer holds them)."""
        parts, self.parts = self.parts, []
        return parts


class SumPass(Protocol):
    keeps: TapOptions | None  # what the norm pass must keep for it (None: book-keeping's recording)
    # its surrogate back-propagates the model, so a parameter read the taps never saw would reach .grad uncounted:
    # the norm pass watches for one (reads.LooseWatch)
    back_propagates: ClassVar[bool]

    def __call__(self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch) -> Sum:
        """Σ_i c_i g_i as parts and a surrogate, given the masked clip ``factors`` c_i."""
        ...


def by_parameter(
    parts: list[tuple[nn.Parameter, PerExampleGradient]],
) -> list[tuple[nn.Parameter, list[Weighted]]]:
    """Kept uses grouped per parameter, each with weight 1."""
    grouped: dict[int, tuple[nn.Parameter, list[Weighted]]] = {}
    for param, part in parts:
        grouped.setdefault(id(param), (param, []))[1].append((1.0, part))
    return list(grouped.values())


@dataclass(frozen=True)
class FactoredSum:
    """Σ_e w_e Σ_i c_i G_i^e from book-keeping's factored per-example gradients."""

    keeps: None = None

    back_propagates: ClassVar[bool] = False

    def __call__(self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch) -> Sum:
        return Sum(list(found.terms.values()), None, batch.overflowed, lazy=True)


@dataclass(frozen=True)
class GroupedSum:
    """Group-wise clipping: the norm pass's backward formed each group's Σ_i c_ig G_i (groups.py)."""

    keeps: TapOptions = field(default_factory=TapOptions)

    back_propagates: ClassVar[bool] = False

    def __call__(
        self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor | None, batch: Batch
    ) -> Sum:
        return Sum([], None, Dropped(), totals=found.group_totals)


@dataclass(frozen=True)
class KeptSum:
    """Σ_i c_i G_i from the explicit G_i the norm pass kept."""

    keeps: TapOptions = TapOptions(keep_gradients=True)

    back_propagates: ClassVar[bool] = False

    def __call__(self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch) -> Sum:
        parts = [(param, [(1.0, part)]) for param, part in found.kept]
        return Sum(parts, None, batch.overflowed, lazy=True)


# How a weighted pass treats the checkpointed layers: runs them, runs them and compares each output with the norm
# pass's (the first step through a framework), or replays the norm pass's outputs (replay.py).
LayerUse = Literal["run", "compare", "replay"]


def _layers(found: FoundNorms, use: LayerUse) -> contextlib.AbstractContextManager[None]:
    replay = found.replay
    if use == "run" or not replay or not replay.complete:
        return contextlib.nullcontext()
    if use == "replay":
        return replay.replaying()
    return replay.comparing(
        TOLERANCES.tail.at(found.low_precision, [kept.output.dtype for kept in replay.kept])
    )


@dataclass(frozen=True)
class WholeSum:
    """∇(Σ_i c_i L_i) of ``module``'s forward (the bare module, or as the framework wrapped it), drawing the norm
    pass's dropout masks."""

    module: nn.Module
    layers: LayerUse = "run"
    keeps: TapOptions = field(default_factory=TapOptions)

    back_propagates: ClassVar[bool] = True

    def __call__(self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch) -> Sum:
        def surrogate() -> torch.Tensor:
            replay_rng(found.rng)
            with _layers(found, self.layers):
                losses = losses_of(self.module)
            return (factors.detach().to(losses.dtype) * losses).sum()

        return Sum([], surrogate, batch.dropped)


def _some_zero(batch: Batch) -> bool:
    """Whether a clip factor c_i of the micro-batch may be 0 (not yet decided: it may)."""
    return batch.dropped is None or batch.dropped.examples is not None


def layerwise_usable(found: FoundNorms) -> bool:
    """The norm pass kept what the layer-by-layer pass needs, for every checkpointed layer (layerwise.py)."""
    return found.points is not None and found.replay is not None and found.points.usable(found.replay.kept)


@dataclass(frozen=True)
class BodySum:
    """The tail's Σ_i c_i G_i as parts (tail.py), its per-example gradients handed over, and the body's surrogate:
    ⟨h, spread(c) ⊙ ∂(Σ_j L_j)/∂h⟩ of a forward stopped at h (``replays``: the checkpointed layers return the norm
    pass's outputs), or with ``layerwise`` one term per layer below the tail and one for the embeddings
    (layerwise.py), the norm modules' Σ_i c_i G_i as parts. Where the norm pass found no tail, or not what the
    checked layer-by-layer pass needs, the ``whole`` pass."""

    module: nn.Module
    whole: WholeSum
    keeps: TapOptions
    replays: bool = True
    layerwise: bool = False

    back_propagates: ClassVar[bool] = True

    def __call__(self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch) -> Sum:
        body = self.body(losses_of, found, factors, batch)
        return body if body is not None else self.whole(losses_of, found, factors, batch)

    def body(
        self, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch, keep: bool = False
    ) -> Sum | None:
        """The sum without the tail, or None where it cannot be formed; ``keep``: the norm pass's per-example
        gradients stay where they are (the first step's check forms the sum more than once)."""
        tail = found.tail
        if tail is None or (self.layerwise and not layerwise_usable(found)):
            return None
        parts = list(tail.parts) if keep else tail.take_parts()
        if self.layerwise:
            parts += list(found.points.norm_parts) if keep else found.points.take_norm_parts()
            surrogate = self._layer_terms(tail, losses_of, found, factors, batch)
        else:
            surrogate = self._from_hidden(tail, losses_of, found, factors, batch)
        return Sum(by_parameter(parts), surrogate, batch.dropped)

    def _from_hidden(
        self, tail: Tail, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch
    ) -> Surrogate:
        def surrogate() -> torch.Tensor:
            replay_rng(found.rng)
            replay = found.replay if self.replays else None
            with replay.replaying() if replay and replay.complete else contextlib.nullcontext():
                hidden = forward_to(tail.boundary, lambda: losses_of(self.module))
            if not hidden.requires_grad:
                return hidden.new_zeros(())
            return paired(hidden, tail.hidden_gradient(factors, batch.units, _some_zero(batch)))

        return surrogate

    def _layer_terms(
        self, tail: Tail, losses_of: LossFn, found: FoundNorms, factors: torch.Tensor, batch: Batch
    ) -> Surrogate:
        layers = LayerByLayer(found.points, found.replay.kept, factors, batch.units, _some_zero(batch))

        def surrogate() -> torch.Tensor:
            replay_rng(found.rng)
            terms = [layers.embeddings_term(lambda: losses_of(self.module))]
            terms += [layers.layer_term(k) for k in range(found.points.below(tail.boundary))]
            terms = [t.float() for t in terms if t is not None]
            return torch.stack(terms).sum() if terms else factors.new_zeros((), dtype=torch.float32)

        return surrogate
