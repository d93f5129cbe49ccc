"""A clipped step as a pipeline: norms → clip factors → clipped sum → its delivery, each part chosen by ``select``.

    norms = found.norms / S,    c_i = clip(norms_i, C) · mask_i,    Σ_i c_i g_i computed by the sum pass

(Abadi et al. 2016; book-keeping, Bu et al. 2023). How the norms are obtained is a ``NormPass`` (norm_passes.py),
what the sum is a ``SumPass`` (sum_passes.py), how it reaches the gradients a ``Delivery`` (delivery.py): ``TABLE``
picks the norm and sum passes from whether the norms come from inside a backward (activation checkpointing, FSDP2)
and what this step needs; the delivery follows from who owns the gradients. The first step also runs the checks
that fix the run's ``Calibration`` (calibration.py). A step whose book-keeping forward meets the user's own
``torch.utils.checkpoint`` re-selects with the norms inside the backward, for good. ``LossScale`` (fp16's S,
identity otherwise) is applied here only. ``NonPrivate`` is the same call without clipping (``disable_dp``). See
docs/clipping.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Literal

import torch
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.calibration import (
    Calibration,
    CheckedGroups,
    CheckedInGradients,
    CheckedThroughFramework,
    FirstStepCheck,
)
from hf_dp.clipping.checks import GradientGuard
from hf_dp.clipping.delivery import AsLinearTerms, Delivery, IntoGradients, IntoUnshardedGradients, MicroStep
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.loss_scale import LossScale
from hf_dp.clipping.norm_passes import (
    OVERFLOWED_LOSS,
    Batch,
    EvaluatedNorms,
    NormPass,
    RecordedNorms,
    TappedNorms,
)
from hf_dp.clipping.per_example import LossFn
from hf_dp.clipping.plan import StepPlan
from hf_dp.clipping.shifts import ParameterShifter
from hf_dp.clipping.sum_passes import BodySum, FactoredSum, GroupedSum, KeptSum, SumPass, WholeSum
from hf_dp.clipping.sums import ClippedSums
from hf_dp.clipping.taps import TapOptions
from hf_dp.clipping.units import PrivacyUnits

__all__ = ["Batch", "Calibration", "ClippedStep", "MicroStep", "NonPrivate", "clipped_step"]

# With the norms inside a backward, explicit per-example gradients replace the weighted pass when all B of them
# take at most this share of the model's parameter count, so the step holds at most half the weights again
# (LoRA r 8-16 on every linear layer: 1-4% of the model per example; full fine-tuning never qualifies).
KEPT_GRADIENTS_SHARE = 0.5
# The weighted pass's tail reaches down over the last checkpointed layers while their B per-example gradients take
# at most this share of the clipped weights (tail.py): the norm pass holds them where the stock backward holds the
# weights' gradients, and the weighted pass adds them to ``.grad`` before its own backward allocates the rest.
DEEP_TAIL_SHARE = 0.5

# Who writes the gradients: the bare module (one process, DDP), the framework (DeepSpeed), or the framework with
# sharded parameters (FSDP2, whose norm pass differentiates towards its taps only).
Owner = Literal["module", "framework", "sharded"]


class Need(Enum):
    """What a micro-batch needs of the table."""

    EVALUATIONS = "several evaluations"  # DiSK: u_i combines evaluations at several parameter points
    ONE_PASS = "one pass"  # the norm pass's per-example gradients give the sum
    FIRST_STEP = "first step"  # the whole weighted pass and the checks that fix the Calibration
    BODY = "body"  # the weighted pass without the tail (the first step found it exact)
    WHOLE = "whole"  # the whole weighted pass
    GROUPS = "groups"  # group-wise clipping: every group clipped and summed in the norm pass's backward


NormKind = Literal["recorded", "evaluated", "tapped"]
SumKind = Literal["factored", "kept", "body", "whole", "grouped"]

# (norms inside a backward, need) → (how the norms are obtained, what the clipped sum is); ``select`` adds the
# delivery by the gradients' owner. Several evaluations need book-keeping's norms (refused before training
# elsewhere: run.PrivateRun.bind_optimizer, distributed.py).
TABLE: dict[tuple[bool, Need], tuple[NormKind, SumKind]] = {
    (False, Need.EVALUATIONS): ("evaluated", "factored"),
    (False, Need.ONE_PASS): ("recorded", "factored"),
    (False, Need.WHOLE): ("recorded", "whole"),
    (True, Need.ONE_PASS): ("tapped", "kept"),
    (True, Need.FIRST_STEP): ("tapped", "whole"),
    (True, Need.BODY): ("tapped", "body"),
    (True, Need.WHOLE): ("tapped", "whole"),
    (True, Need.GROUPS): ("tapped", "grouped"),
}


def _tail_floats(engine: ClippingEngine) -> int:
    """How many floats of per-example gradients the tail may keep to reach down over checkpointed layers."""
    return int(max(DEEP_TAIL_SHARE * engine.clipped_numel, KEPT_GRADIENTS_SHARE * engine.model_numel))


def kept_gradients_fit(engine: ClippingEngine, count: int) -> bool:
    """B explicit per-example gradients cost at most KEPT_GRADIENTS_SHARE of the model's weights (LoRA)."""
    return count * engine.clipped_numel <= KEPT_GRADIENTS_SHARE * engine.model_numel


@dataclass(frozen=True)
class Passes:
    """One step's choice: its norm pass, sum pass and delivery, and on the first step the check around it."""

    norms: NormPass
    sum: SumPass
    delivery: Delivery
    need: Need
    check: FirstStepCheck | None = None


class ClippedStep:
    """Σ_i c_i g_i of each micro-batch into the gradients (or handed to the framework), u_i = Σ_e w_e ∇L_i(θ +
    shift_e) clipped once per example in the plan's geometry. Where the module writes ``.grad`` the step owns it
    between two releases (``check_untouched``, checks.GradientGuard). ``calibration``: what the first step found
    (None before it); ``force`` overrides it (benchmarks and tests that compare passes)."""

    def __init__(self, engine: ClippingEngine, module: nn.Module, backend: Backend) -> None:
        if backend.framework_owns_gradients and backend.fp16_loss_scale is not None:
            raise ValueError("fp16 under DP runs on one process or with DDP, not with DeepSpeed or FSDP")
        self.engine, self.module, self.backend = engine, module, backend
        self.owner: Owner = "sharded" if backend.fsdp else "framework" if backend.deepspeed else "module"
        self.scale = LossScale.of(backend)
        # group-wise clipping forms its sums in the norm pass's backward (groups.py)
        self.norms_in_backward = backend.checkpointing or backend.fsdp or engine.groups is not None
        self.calibration: Calibration | None = None
        self.last_need: Need | None = None  # what the last micro-batch took of the table (logs, tests)
        self.shifter = ParameterShifter()
        self._forced: dict[str, Any] = {}
        self._guard = None if backend.framework_owns_gradients else GradientGuard(lambda: engine.parameters)

    def force(self, **fields: Any) -> None:
        """Later steps take these ``Calibration`` fields whatever the first step finds (its checks still run)."""
        self._forced = {**self._forced, **fields}
        if self.calibration is not None:
            self.calibration = replace(self.calibration, **fields)

    def check_untouched(self) -> None:
        """Before the release: ``.grad`` is exactly as the step left it (a no-op where the framework owns it)."""
        if self._guard is not None:
            self._guard.check_untouched()

    def take_sums(self) -> ClippedSums:
        """The logical batch's clipped sums for the mechanism (where the framework owns the gradients: ``.grad``)."""
        return ClippedSums() if self._guard is None else self.engine.sums.take()

    def run(
        self,
        losses_of: LossFn,
        mask: torch.Tensor,
        plan: StepPlan,
        model: nn.Module,
        units: PrivacyUnits | None = None,
    ) -> MicroStep:
        """``mask`` (U,): the real units; ``units`` groups the rows or tokens (None: a unit is a row); ``model``: as
        the framework wrapped it. Every process runs both passes under a framework, so its collectives match."""
        batch = Batch(mask, units)
        if self._guard is not None:
            self._guard.check_untouched(before_release=False)
            # nothing to add; the release still adds noise to the zero sum. The loader's empty micro-batch is its
            # one placeholder unit (data.MaskingCollator), so a larger one is not read on the host: were all its
            # units placeholders, their zero clip factors would add exactly nothing.
            if batch.size == 1 and not mask.any():
                self._guard.written()
                return MicroStep(mask.new_zeros(batch.size), None)
        losses_of = self.scale.wrap(losses_of)
        passes = select(self, plan, batch, model)
        found = passes.norms(losses_of, batch, plan)
        if (
            found is None
        ):  # the user's own torch.utils.checkpoint: the norms come from inside a backward for good
            self.norms_in_backward = True
            passes = select(self, plan, batch, model)
            found = passes.norms(losses_of, batch, plan)
        self.last_need = passes.need
        losses = found.losses if found.finite_losses else None
        if found.group_totals is not None:  # group-wise: clipped and summed in the norm pass's backward
            factors = None
            if self.engine.sums.read_groups(found.norms, batch.mask, losses):
                raise FloatingPointError(OVERFLOWED_LOSS)
        else:
            clipped = self.engine.sums.clip(
                self.scale.unscale(found.norms), plan.clip_norm, batch.mask, losses
            )
            if clipped.bad_losses:
                raise FloatingPointError(OVERFLOWED_LOSS)
            factors = clipped.factors
            batch = replace(batch, overflowed=clipped.overflowed, dropped=clipped.dropped)
        computed = passes.sum(losses_of, found, factors, batch)
        deliver = lambda: passes.delivery(computed, factors, found.losses)  # noqa: E731
        if passes.check is not None:
            step, found_calibration = passes.check(deliver, losses_of, found, factors, batch)
        else:
            step, found_calibration = deliver(), Calibration()
        if self.calibration is None:
            self.calibration = replace(found_calibration, **self._forced)
        if self._guard is not None:
            self.engine.sums.move_from_gradients(
                self.engine.parameters
            )  # after the checks, which read what the backward wrote
            self._guard.written()
        return step

    @property
    def framework_has_whole_parameters(self) -> bool:
        """DeepSpeed ZeRO-0/1/2: every process holds every parameter whole, so a term linear in p can be formed."""
        return self.owner == "framework" and (self.backend.zero_stage or 0) <= 2

    @property
    def framework_may_replay(self) -> bool:
        """Through ZeRO-1/2 and FSDP2 the weighted pass may replay the checkpointed layers and skip the tail once the
        first step checked them. Not through ZeRO-3: a replayed layer's recomputation gathers its weights once more
        than checkpointing's does (measured 1.04–1.16x slower, docs/results.md), and ZeRO-3 reduces only gradients
        its own backward hooks see, of weights it gathers only inside each module."""
        return self.owner == "sharded" or self.framework_has_whole_parameters

    def need(self, plan: StepPlan, batch: Batch) -> Need:
        """What this micro-batch needs of the table."""
        if not plan.single_evaluation:
            return Need.EVALUATIONS
        if self.engine.groups is not None:
            return Need.GROUPS
        if not self.norms_in_backward:
            return (
                Need.ONE_PASS if self.owner == "module" or self.framework_has_whole_parameters else Need.WHOLE
            )
        first = self.calibration is None
        if (
            kept_gradients_fit(self.engine, batch.size)
            and (self.framework_has_whole_parameters or self.owner == "module")
            and not first
        ):
            return Need.ONE_PASS  # the norm pass's explicit per-example gradients give the sum
        if self.owner != "module" and not self.framework_may_replay:
            return Need.WHOLE
        if first:
            return Need.FIRST_STEP
        return Need.BODY if self.calibration.skips_tail else Need.WHOLE


def _tail_keeps(step: ClippedStep, first: bool, calibration: Calibration) -> TapOptions:
    """What the norm pass keeps of the tail: on the first step reaching down over as many layers as the budget
    allows, on later steps over exactly those the first step checked. On the bare module a tail without clipped
    parameters (LoRA's frozen head) starts at the last checkpointed layer's output, and the tail is checked with
    ``backward()``; through a framework with ``autograd.grad`` (its backward runs once). On the bare module and
    through ZeRO-1/2 the norm pass keeps what the layer-by-layer weighted pass needs (layerwise.py) on the first
    step, which checks it, and on later steps if it was exact."""
    module = step.owner == "module"
    layerwise = (module or step.framework_has_whole_parameters) and (first or calibration.layerwise)
    reach = {"tail_floats": _tail_floats(step.engine)} if first else {"tail_layers": calibration.tail_layers}
    return TapOptions(
        keep_tail=True,
        tail_at_exit=module,
        tail_checked_by_grad=not module,
        layerwise=layerwise,
        probe=first and (module or step.framework_has_whole_parameters),
        record_layers=first and not module,
        **reach,
    )


def _sum_pass(
    step: ClippedStep, kind: SumKind, need: Need, model: nn.Module, calibration: Calibration
) -> SumPass:
    """The sum pass of a table row; its weighted pass runs on the bare module, or as the framework wrapped it."""
    if kind == "factored":
        return FactoredSum()
    if kind == "kept":
        return KeptSum()
    if kind == "grouped":  # on the first step (bare module, ZeRO-0/1/2), the taps' probes for CheckedGroups
        checked = step.owner == "module" or step.framework_has_whole_parameters
        return GroupedSum(TapOptions(probe=step.calibration is None and checked))
    module = step.owner == "module"
    runs_on = step.module if module else model
    if (
        need is Need.FIRST_STEP
    ):  # the whole pass, checked (calibration.py); through a framework, its layers compared
        return WholeSum(runs_on, "run" if module else "compare", _tail_keeps(step, True, calibration))
    replays = not module and calibration.replays
    whole = WholeSum(runs_on, "replay" if replays else "run", TapOptions(record_layers=replays))
    if kind == "whole":
        return whole
    keeps = _tail_keeps(step, False, calibration)
    return BodySum(
        runs_on, whole, keeps, replays=module or calibration.replays, layerwise=calibration.layerwise
    )


def _norm_pass(
    step: ClippedStep, kind: NormKind, keeps: TapOptions | None, first: bool, watch: bool
) -> NormPass:
    """The norm pass of a table row; on the first step, book-keeping's sum is verified against ``autograd.grad`` on
    the bare module where every process holds every parameter whole (not ZeRO-3's partitions nor FSDP2's);
    ``watch``: its sum pass back-propagates the model, so a loose read after the first step is refused."""
    module = step.owner == "module"
    verifiable = module or step.framework_has_whole_parameters
    if kind == "recorded":
        return RecordedNorms(step.engine, step.module, verify=first and verifiable, watch=watch)
    if kind == "evaluated":
        return EvaluatedNorms(step.engine, step.module, step.shifter, verify=first and verifiable)
    return TappedNorms(
        step.engine,
        step.module,
        keeps or TapOptions(),
        taps_only=step.owner == "sharded",
        finite_losses=module,
        grouped=step.engine.groups is not None,
        loss_scale=step.scale.scale,
        watch=watch,
    )


def _delivery(step: ClippedStep, model: nn.Module) -> Delivery:
    if step.owner == "module":
        return IntoGradients(step.engine, step.scale)
    if step.owner == "framework":
        return AsLinearTerms(step.backend.world_size)
    return IntoUnshardedGradients(model, step.backend.world_size)


def select(step: ClippedStep, plan: StepPlan, batch: Batch, model: nn.Module) -> Passes:
    """The norm pass, sum pass and delivery of this micro-batch (``TABLE``), with the first step's check where it
    has one; a combination the table lacks is an internal error that names it."""
    need = step.need(plan, batch)
    key = (step.norms_in_backward, need)
    if key not in TABLE:
        raise RuntimeError(
            f"hf_dp internal error: no clipped step for owner {step.owner!r}, norms in backward {key[0]}, need {need.value!r}"
        )
    norm_kind, sum_kind = TABLE[key]
    calibration = step.calibration or Calibration()
    sum_pass = _sum_pass(step, sum_kind, need, model, calibration)
    check = None
    if need is Need.FIRST_STEP and step.owner == "module":
        check = CheckedInGradients(step.engine, step.scale, BodySum(step.module, sum_pass, sum_pass.keeps))
    elif need is Need.FIRST_STEP:
        check = CheckedThroughFramework(step.engine, step.module, step.framework_has_whole_parameters)
    elif need is Need.GROUPS and step.calibration is None and step.owner == "module":
        check = CheckedGroups(step.engine, step.module)
    elif need is Need.GROUPS and step.calibration is None and step.framework_has_whole_parameters:
        check = CheckedGroups(step.engine, step.module, by_grad=True)
    first = step.calibration is None
    norm_pass = _norm_pass(step, norm_kind, sum_pass.keeps, first, watch=sum_pass.back_propagates)
    return Passes(norm_pass, sum_pass, _delivery(step, model), need, check)


@dataclass
class NonPrivate:
    """Σ_i L_i of the real examples, back-propagated by the Trainer (×W through a framework's mean, as above).
    ``module`` None: the passes run on the framework-wrapped model."""

    module: nn.Module | None
    scale: float = 1.0
    norms_in_backward: bool = False

    def run(
        self,
        losses_of: LossFn,
        mask: torch.Tensor,
        plan: StepPlan,
        model: nn.Module,
        units: PrivacyUnits | None = None,
    ) -> MicroStep:
        if self.module is not None and not mask.any():
            return MicroStep(mask.new_zeros(mask.shape[0]), None)
        losses = losses_of(self.module if self.module is not None else model)
        return MicroStep(losses.detach(), (losses * mask.to(losses.dtype)).sum() * self.scale)

    def check_untouched(self) -> None:
        """Nothing to check: without DP the Trainer's own backward writes the gradients."""

    def take_sums(self) -> ClippedSums:
        return ClippedSums()


def clipped_step(
    engine: ClippingEngine | None, module: nn.Module, backend: Backend
) -> ClippedStep | NonPrivate:
    """The run's step: no engine means no DP; otherwise the pipeline, its parts chosen per step from ``TABLE``."""
    if engine is None:
        if backend.framework_owns_gradients:
            return NonPrivate(None, backend.world_size)
        return NonPrivate(module)
    return ClippedStep(engine, module, backend)
