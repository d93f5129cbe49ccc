"""A clipped step as a pipeline: norms → clip factors → clipped sum, with each half chosen from one table.

    norms = found.norms / S,    c_i = clip(norms_i, C) · mask_i,    Σ_i c_i g_i written by the sum pass

(Abadi et al. 2016; book-keeping, Bu et al. 2023). How the norms are obtained is a ``NormPass``
(norm_passes.py), how the sum is written a ``SumPass`` (sum_passes.py); ``TABLE`` picks both from the backend's
gradient owner, whether the norms come from inside a backward (activation checkpointing, FSDP2) and what this
step needs. A step whose book-keeping forward meets the user's own ``torch.utils.checkpoint`` re-selects with
the norms inside the backward, for good. ``LossScale`` (fp16's S, identity otherwise) is applied here only.
``NonPrivate`` is the same call without clipping (``disable_dp``). See docs/clipping.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.checks import GradientGuard
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.evaluate import ParameterShifter
from hf_dp.clipping.loss_scale import LossScale
from hf_dp.clipping.norm_passes import (
    OVERFLOWED_LOSS,
    Batch,
    EvaluatedNorms,
    NormPass,
    RecordedNorms,
    TappedNorms,
)
from hf_dp.clipping.plan import StepPlan
from hf_dp.clipping.sum_passes import (
    BodySum,
    BodyThroughFramework,
    FactoredSum,
    KeptSum,
    MicroStep,
    PartsThroughFramework,
    SumPass,
    TailCheck,
    WeightedBackward,
    WeightedThroughFramework,
)
from hf_dp.clipping.sums import ClippedSums
from hf_dp.clipping.taps import TapOptions
from hf_dp.clipping.units import PrivacyUnits

__all__ = ["Batch", "ClippedStep", "MicroStep", "NonPrivate", "clipped_step", "several_evaluations_refused"]

LossFn = Callable[[nn.Module], torch.Tensor]

# With the norms inside a backward, explicit per-example gradients replace the weighted pass when all B of them
# take at most this share of the model's parameter count (LoRA adapters: ~1%; full fine-tuning never qualifies).
KEPT_GRADIENTS_SHARE = 0.05
# The weighted pass's tail reaches down over the last checkpointed layers while their B per-example gradients take
# at most this share of the clipped weights (tail.py): the norm pass holds them where the stock backward holds the
# weights' gradients, and the weighted pass adds them to ``.grad`` before its own backward allocates the rest.
DEEP_TAIL_SHARE = 0.5

# Who writes the gradients: the bare module (one process, DDP), the framework (DeepSpeed), or the framework with
# sharded parameters (FSDP2, whose norm pass differentiates towards its taps only).
Owner = Literal["module", "framework", "sharded"]
# What the step needs beyond that: several evaluations (DiSK), one pass (ZeRO-0/1/2: the norm pass's per-example
# gradients give the sum), the first step's checks, or (later steps with the norms inside a backward) one pass
# from kept gradients, the body without the tail, or the whole weighted pass.
Need = Literal["evaluations", "one pass", "first step", "kept gradients", "body", "whole"]


def several_evaluations_refused(rule: str = "this dp_optimizer") -> ValueError:
    """The one refusal of a plan with several evaluations (DiSK) where only book-keeping's norms can combine them."""
    return ValueError(
        f"{rule} evaluates each example at two parameter points (DiSK), which activation checkpointing, DeepSpeed "
        "and FSDP do not support yet: turn activation_checkpointing off, train on one process or with DDP, or pick "
        "another dp_optimizer"
    )


def _tail_floats(engine: ClippingEngine) -> int:
    """How many floats of per-example gradients the tail may keep to reach down over checkpointed layers."""
    return int(max(DEEP_TAIL_SHARE * engine.clipped_numel, KEPT_GRADIENTS_SHARE * engine.model_numel))


def kept_gradients_fit(engine: ClippingEngine, count: int) -> bool:
    """B explicit per-example gradients cost at most KEPT_GRADIENTS_SHARE of the model's weights (LoRA)."""
    return count * engine.clipped_numel <= KEPT_GRADIENTS_SHARE * engine.model_numel


class ClippedStep:
    """Σ_i c_i g_i of each micro-batch into the gradients (or handed to the framework), u_i = Σ_e w_e ∇L_i(θ +
    shift_e) clipped once per example in the plan's geometry. Where the module writes ``.grad`` the step owns it
    between two releases (``check_untouched``, checks.GradientGuard)."""

    def __init__(self, engine: ClippingEngine, module: nn.Module, backend: Backend) -> None:
        if backend.framework_owns_gradients and backend.fp16_loss_scale is not None:
            raise ValueError("fp16 under DP runs on one process or with DDP, not with DeepSpeed or FSDP")
        self.engine, self.module, self.backend = engine, module, backend
        self.owner: Owner = "sharded" if backend.fsdp else "framework" if backend.deepspeed else "module"
        self.scale = LossScale.of(backend)
        self.norms_in_backward = backend.checkpointing or backend.fsdp
        self.skips_tail: bool | None = None  # the weighted pass skips the tail (tail.py): None until checked
        self.tail_layers = 0  # how many checkpointed layers the checked tail reaches down over (tail.py)
        self.layerwise = False  # the weighted pass runs the layers below the tail one by one (layerwise.py)
        # through a framework, the weighted pass replays the checkpointed layers (replay.py): None until checked
        self.replays: bool | None = None
        self.shifter = ParameterShifter()
        self.first_step = True  # the first step runs the checks (checks.py)
        self._guard = None if backend.framework_owns_gradients else GradientGuard(lambda: engine.parameters)

    def check_untouched(self) -> None:
        """Before the release: ``.grad`` is exactly as the step left it (a no-op where the framework owns it)."""
        if self._guard is not None:
            self._guard.check_untouched()

    def take_sums(self) -> ClippedSums:
        """The logical batch's clipped sums for the mechanism (where the framework owns the gradients: ``.grad``)."""
        return ClippedSums() if self._guard is None else self.engine.take_sums()

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
        norm_pass, sum_pass = self._select(plan, batch, model)
        found = norm_pass(losses_of, batch, plan)
        if (
            found is None
        ):  # the user's own torch.utils.checkpoint: the norms come from inside a backward for good
            self.norms_in_backward = True
            norm_pass, sum_pass = self._select(plan, batch, model)
            found = norm_pass(losses_of, batch, plan)
        norms = self.scale.unscale(found.norms)
        clipped = self.engine.clip(
            norms, plan.clip_norm, batch.mask, found.losses if found.finite_losses else None
        )
        if clipped.bad_losses:
            raise FloatingPointError(OVERFLOWED_LOSS)
        factors = clipped.factors
        batch = replace(batch, overflowed=clipped.overflowed, dropped=clipped.dropped)
        step = sum_pass(losses_of, found, norms, factors, batch)
        if found.tail_exact is not None:
            self.skips_tail = found.tail_exact
            self.tail_layers = found.collector.reached
            self.layerwise = bool(found.layerwise_exact)
        if found.replay_exact is not None:
            self.replays = found.replay_exact
            # through a framework the layer-by-layer pass was checked against the chain its layers' replay checks
            self.layerwise = self.layerwise and self.replays
        self.first_step = False
        if self._guard is not None:
            self._guard.written()
        return step if step is not None else MicroStep(self.scale.unscale(found.losses.detach()), None)

    @property
    def framework_has_whole_parameters(self) -> bool:
        """DeepSpeed ZeRO-0/1/2: every process holds every parameter whole, so a term linear in p can be formed."""
        return self.owner == "framework" and (self.backend.zero_stage or 0) <= 2

    @property
    def framework_may_replay(self) -> bool:
        """Through ZeRO-1/2 and FSDP2 the weighted pass may replay the checkpointed layers once the first step
        compared them. Not through ZeRO-3: a replayed layer's recomputation gathers its weights once more than
        checkpointing's does (measured 1.04–1.16x slower, docs/results.md)."""
        return self.owner == "sharded" or self.framework_has_whole_parameters

    @property
    def framework_may_skip_tail(self) -> bool:
        """The tail skip through a framework needs the norms from a backward and a way to hand the framework the
        tail's Σ_i c_i G_i (sum_passes.BodyThroughFramework): as terms linear in each whole parameter under ZeRO-1/2,
        in the unsharded parameters' gradients under FSDP2. Not ZeRO-3, which reduces only gradients its own
        backward hooks see, of weights it gathers only inside each module."""
        return (self.framework_has_whole_parameters or self.owner == "sharded") and self.norms_in_backward

    def _need(self, plan: StepPlan, batch: Batch) -> Need:
        if not plan.single_evaluation:
            return "evaluations"
        if self.framework_has_whole_parameters and (
            not self.norms_in_backward or kept_gradients_fit(self.engine, batch.size)
        ):
            return "one pass"  # the norm pass's per-example gradients give the sum
        if self.owner != "module" and not (self.norms_in_backward and self.framework_may_replay):
            return "whole"
        if self.first_step:
            return "first step"
        if self.owner == "module" and self.norms_in_backward and kept_gradients_fit(self.engine, batch.size):
            return "kept gradients"
        return "body" if self.norms_in_backward and self.skips_tail else "whole"

    def _select(self, plan: StepPlan, batch: Batch, model: nn.Module) -> tuple[NormPass, SumPass]:
        key = (self.owner, self.norms_in_backward, self._need(plan, batch))
        if key not in TABLE:
            raise several_evaluations_refused()
        return TABLE[key](self, model)


Parts = Callable[[ClippedStep, nn.Module], tuple[NormPass, SumPass]]


def _tapped(step: ClippedStep, **options: bool) -> TappedNorms:
    return TappedNorms(step.engine, step.module, TapOptions(**options))


def _whole(step: ClippedStep, check: bool = False) -> WeightedBackward:
    return WeightedBackward(step.engine, step.module, step.scale, check)


def _framework(step: ClippedStep, model: nn.Module) -> WeightedThroughFramework:
    """The whole weighted pass through the framework, replaying the layers where the first step found it exact."""
    return WeightedThroughFramework(
        model, step.backend.world_size, layers="replay" if step.replays else "run"
    )


def _tail_options(step: ClippedStep, **options: bool) -> TapOptions:
    """The norm pass keeps the tail: on the first step reaching down over as many layers as the budget allows,
    on later steps over exactly those the first step checked. In one process and DDP a tail without clipped
    parameters (LoRA's frozen head) starts at the last checkpointed layer's output. In one process, DDP and
    ZeRO-1/2 the norm pass keeps what the layer-by-layer weighted pass needs (layerwise.py) on the first step,
    which checks it, and on later steps if it was exact."""
    module = step.owner == "module"
    layerwise = (module or step.framework_has_whole_parameters) and (step.first_step or step.layerwise)
    if step.first_step:
        return TapOptions(
            keep_tail=True,
            tail_floats=_tail_floats(step.engine),
            tail_at_exit=module,
            layerwise=layerwise,
            **options,
        )
    return TapOptions(
        keep_tail=True, tail_layers=step.tail_layers, tail_at_exit=module, layerwise=layerwise, **options
    )


def _framework_tail(step: ClippedStep) -> TapOptions:
    """Through ZeRO-1/2 and FSDP2 the norm pass keeps the tail as in one process; the first step checks it with
    ``autograd.grad``."""
    if not step.framework_may_skip_tail:
        return TapOptions()
    return _tail_options(step, tail_checked_by_grad=True)


# (owner, norms inside a backward, need) → (how the norms are obtained, how the clipped sum is written)
TABLE: dict[tuple[Owner, bool, Need], Parts] = {
    ("module", False, "evaluations"): lambda s, m: (
        EvaluatedNorms(s.engine, s.module, s.shifter, verify=s.first_step),
        FactoredSum(s.engine, s.scale),
    ),
    ("module", False, "first step"): lambda s, m: (
        RecordedNorms(s.engine, s.module, verify=True),
        FactoredSum(s.engine, s.scale),
    ),
    ("module", False, "whole"): lambda s, m: (
        RecordedNorms(s.engine, s.module),
        FactoredSum(s.engine, s.scale),
    ),
    ("module", True, "first step"): lambda s, m: (
        TappedNorms(s.engine, s.module, _tail_options(s, probe=True)),
        _whole(s, check=True),
    ),
    ("module", True, "kept gradients"): lambda s, m: (
        _tapped(s, keep_gradients=True),
        KeptSum(s.engine, s.scale),
    ),
    ("module", True, "body"): lambda s, m: (
        TappedNorms(s.engine, s.module, _tail_options(s)),
        BodySum(s.engine, s.module, s.scale, _whole(s), s.layerwise),
    ),
    ("module", True, "whole"): lambda s, m: (_tapped(s), _whole(s)),
    ("framework", False, "one pass"): lambda s, m: (
        RecordedNorms(s.engine, s.module),
        PartsThroughFramework(s.backend.world_size),
    ),
    ("framework", True, "one pass"): lambda s, m: (
        TappedNorms(s.engine, s.module, TapOptions(keep_gradients=True), finite_losses=False),
        PartsThroughFramework(s.backend.world_size),
    ),
    ("framework", False, "whole"): lambda s, m: (RecordedNorms(s.engine, s.module), _framework(s, m)),
    ("framework", True, "first step"): lambda s, m: (
        TappedNorms(
            s.engine,
            s.module,
            _framework_tail(s),
            finite_losses=False,
            record_layers=True,
        ),
        WeightedThroughFramework(
            m,
            s.backend.world_size,
            TailCheck(s.engine, s.module) if s.framework_may_skip_tail else None,
            "compare",
        ),
    ),
    ("framework", True, "body"): lambda s, m: (
        TappedNorms(s.engine, s.module, _framework_tail(s), finite_losses=False),
        BodyThroughFramework(
            m, s.backend.world_size, bool(s.replays), _framework(s, m), layerwise=s.layerwise
        ),
    ),
    ("framework", True, "whole"): lambda s, m: (
        TappedNorms(s.engine, s.module, finite_losses=False, record_layers=bool(s.replays)),
        _framework(s, m),
    ),
    ("sharded", True, "first step"): lambda s, m: (
        TappedNorms(
            s.engine, s.module, _framework_tail(s), taps_only=True, finite_losses=False, record_layers=True
        ),
        WeightedThroughFramework(m, s.backend.world_size, TailCheck(s.engine, s.module), "compare"),
    ),
    ("sharded", True, "body"): lambda s, m: (
        TappedNorms(s.engine, s.module, _framework_tail(s), taps_only=True, finite_losses=False),
        BodyThroughFramework(m, s.backend.world_size, bool(s.replays), _framework(s, m), tail_into_grad=True),
    ),
    ("sharded", True, "whole"): lambda s, m: (
        TappedNorms(s.engine, s.module, taps_only=True, finite_losses=False, record_layers=bool(s.replays)),
        _framework(s, m),
    ),
}


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
