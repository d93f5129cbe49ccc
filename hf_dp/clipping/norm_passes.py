"""How a clipped step obtains its per-example norms ‖s ⊙ u_i‖ (the first half of pipeline.py's step).

- ``RecordedNorms``: book-keeping (Bu et al. 2023) during the forward, one backward for the output gradients.
- ``EvaluatedNorms``: the same at each of the plan's parameter points, same dropout masks, the weighted
  combination u_i = Σ_e w_e g_i^e (DiSK, Zhang et al.).
- ``TappedNorms``: inside a first backward of Σ_i L_i that writes no ``.grad`` (activation checkpointing,
  FSDP2; taps.py).

Each returns what it found for the sum pass: the norms of the losses it was given (S·L_i under fp16), the losses,
the random state it started from (the weighted pass replays it) and its per-example gradients or collector.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.errors import UnsupportedModuleError
from hf_dp.clipping.geometry import clip_factors
from hf_dp.clipping.groups import GroupSums
from hf_dp.clipping.layerwise import LayerPoints
from hf_dp.clipping.per_example import Dropped, LossFn, Materialised
from hf_dp.clipping.plan import StepPlan
from hf_dp.clipping.replay import LayerReplay
from hf_dp.clipping.rng_replay import RngState, replay_rng, rng_state
from hf_dp.clipping.shifts import ParameterShifter
from hf_dp.clipping.sums import Terms
from hf_dp.clipping.tail import Tail
from hf_dp.clipping.taps import NormCollector, TapOptions
from hf_dp.clipping.units import PrivacyUnits


@dataclass(frozen=True)
class Batch:
    """One micro-batch as clipping sees it: ``mask`` (U,) marks its real privacy units, ``units`` groups its rows
    or tokens into them (None: a unit is a row)."""

    mask: torch.Tensor
    units: PrivacyUnits | None = None
    # what the sums leave out, decided with the clip factors (pipeline.py; None: not decided, a sum pass decides)
    overflowed: Dropped | None = None  # examples whose norm is not finite
    dropped: Dropped | None = None  # examples whose clip factor is 0

    @property
    def size(self) -> int:
        """U, the number of privacy units (norms, factors and losses are per unit)."""
        return self.mask.shape[0]

    @property
    def rows(self) -> int:
        return self.size if self.units is None else self.units.rows


@dataclass
class FoundNorms:
    """A norm pass's result: ``norms`` of the losses it was given, which are ``losses``; ``rng`` the random
    state it started from; ``terms`` book-keeping's per-example gradients, or ``collector`` the taps'."""

    norms: torch.Tensor
    losses: torch.Tensor
    rng: RngState
    terms: Terms | None = None
    collector: NormCollector | None = None  # the taps' (its probes: the first step's check)
    kept: list[tuple[nn.Parameter, Materialised]] = field(
        default_factory=list
    )  # explicit G_i (``keep_gradients``)
    tail: Tail | None = None  # what the weighted pass needs to skip the tail (tail.py)
    reached: int = 0  # how many checkpointed layers the tail reaches down over
    low_precision: bool = False  # a tapped output was bf16/fp16 (the checks' tolerances)
    replay: LayerReplay | None = None  # the checkpointed layers' outputs (tail kept, or recorded)
    points: LayerPoints | None = None  # what the layer-by-layer weighted pass needs (layerwise.py)
    # the real units' losses must be finite (checked with the clip factors, pipeline.py: OVERFLOWED_LOSS)
    finite_losses: bool = False
    # group-wise clipping: the clipped sums the backward formed (groups.py), and ``norms`` is (U, G)
    group_totals: dict[nn.Parameter, torch.Tensor] | None = None


OVERFLOWED_LOSS = (
    "an example's loss overflowed in the forward; with activation checkpointing its zero clip weight "
    "cannot keep inf out of the weighted backward: train in bf16 or float32, or turn checkpointing off"
)


class NormPass(Protocol):
    def __call__(self, losses_of: LossFn, batch: Batch, plan: StepPlan) -> FoundNorms | None:
        """The norms of one micro-batch; None when the pass found it cannot run (pipeline.py re-selects)."""
        ...


@dataclass(frozen=True)
class RecordedNorms:
    """Book-keeping's norms; ``verify`` (the first step) checks its unclipped sum against autograd."""

    engine: ClippingEngine
    module: nn.Module
    verify: bool = False
    watch: bool = False  # the sum pass back-propagates the model (engine.record)

    def __call__(self, losses_of: LossFn, batch: Batch, plan: StepPlan) -> FoundNorms | None:
        """None when the user's own ``torch.utils.checkpoint`` ran in the forward (the random state is replayed)."""
        state = rng_state()
        with self.engine.record(batch.rows, batch.units, self.watch) as recording:
            losses = losses_of(self.module)
        if recording.saw_checkpointing:
            replay_rng(state)
            return None
        gradients = self.engine.per_example_gradients(losses, verify=self.verify)
        norms, terms = self.engine.norms_and_terms([(gradients, 1.0)], plan.clip_scale)
        return FoundNorms(norms, losses, state, terms=terms)


@dataclass(frozen=True)
class EvaluatedNorms:
    """Book-keeping at every evaluation of the plan (θ + shift_e, same dropout masks), combined with weights w_e."""

    engine: ClippingEngine
    module: nn.Module
    shifter: ParameterShifter
    verify: bool = False

    def __call__(self, losses_of: LossFn, batch: Batch, plan: StepPlan) -> FoundNorms:
        state = rng_state()
        evaluated = []
        for k, evaluation in enumerate(plan.evaluations):
            if k:
                replay_rng(state)
            with self.shifter(evaluation.shift), self.engine.record(batch.rows, batch.units):
                losses = losses_of(self.module)
                evaluated.append(
                    (self.engine.per_example_gradients(losses, verify=self.verify), evaluation.weight)
                )
        norms, terms = self.engine.norms_and_terms(evaluated, plan.clip_scale)
        return FoundNorms(norms, losses, state, terms=terms)


@dataclass(frozen=True)
class TappedNorms:
    """One tapped forward and backward of Σ_i L_i: the collector holds the norms, no ``.grad`` is written.
    ``taps_only``: differentiate towards the taps alone (``autograd.grad``), so that no weight gradient is even
    formed: FSDP2 computes with unsharded copies of the parameters, which freezing the sharded ones does not
    freeze. ``finite_losses``: refuse a loss that overflowed in the forward, which a zero clip weight cannot keep
    out of a later weighted backward of the bare module (checked with the clip factors, in one host read)."""

    engine: ClippingEngine
    module: nn.Module
    options: TapOptions = TapOptions()
    taps_only: bool = False
    finite_losses: bool = True
    grouped: bool = False  # group-wise clipping: each group's clipped sum formed in the backward (groups.py)
    loss_scale: float = 1.0  # fp16's S, which scales the losses given (group-wise clipping unscales by it)
    watch: bool = False  # the sum pass back-propagates the model (engine.record)

    def __call__(self, losses_of: LossFn, batch: Batch, plan: StepPlan) -> FoundNorms:
        state = rng_state()
        options = self.options
        group_sums = self._group_sums(batch, plan) if self.grouped else None
        replay = LayerReplay(self.module) if options.keep_tail or options.record_layers else None
        points = (
            LayerPoints(replay.layers, self.engine.layers.owned) if replay and options.layerwise else None
        )
        with (
            replay.recording(keep_calls=points is not None) if replay else contextlib.nullcontext(),
            self.engine.norms_in_backward(
                batch.size, plan.clip_scale, batch.units, options, not self.taps_only, group_sums, self.watch
            ) as collector,
            collector.forward(replay.layers if replay else [], points),
        ):
            losses = losses_of(self.module)
            self.engine.row_tracking.end_watch()
            collector.begin_backward()
            with recomputations_named(collector.others.read_in_checkpoints):
                if self.taps_only:
                    torch.autograd.grad(losses.sum(), collector.anchor, allow_unused=True)
                else:
                    losses.sum().backward()
        return FoundNorms(
            collector.norms(),
            losses,
            state,
            collector=collector,
            kept=collector.kept_gradients(),
            tail=collector.tail(),
            reached=collector.reached,
            low_precision=collector.low_precision,
            replay=replay,
            points=points,
            finite_losses=self.finite_losses,
            group_totals=None if group_sums is None else group_sums.totals,
        )

    def _group_sums(self, batch: Batch, plan: StepPlan) -> GroupSums:
        params = self.engine.parameters
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        clip = functools.partial(clip_factors, fn=self.engine.sums.clipping_fn)
        names = self.engine.layers.parameter_names()
        group_of = self.engine.groups.index({id(p): names.get(id(p), "?") for p in params})
        return GroupSums(
            self.engine.groups, group_of, plan.clip_norm, clip, batch.mask, dtype, self.loss_scale
        )


@contextlib.contextmanager
def recomputations_named(read_in_checkpoints: list[str]) -> Iterator[None]:
    """A checkpoint whose recomputation saves other tensors than its first forward did (a parameter read outside its
    module there is broadcast to the batch in the first forward only: peft's IA3, VeRA, LoKr), refused in one line
    naming those reads, not torch's CheckpointError."""
    try:
        yield
    except CheckpointError as error:
        reads = ", ".join(read_in_checkpoints) or "none found"
        raise UnsupportedModuleError(
            "an activation checkpoint recomputed other tensors than its forward saved, where trainable parameters "
            f"are read outside the forward of the module that owns them ({reads}): turn gradient checkpointing off, "
            "or freeze them"
        ) from error
