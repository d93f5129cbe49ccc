"""Clipping strategies: how one micro-batch's clipped sum Σ_i c_i g_i reaches the gradients.

- ``Bookkeeping`` (Bu et al. 2023): one backward for output gradients only, per-example norms, and the clipped
  sum written to ``.grad`` by the engine; one process and DDP (the mechanism sums across processes).
- ``TwoPass``: a norm pass on the bare module whose gradients never reach the framework, then the weighted
  loss W·Σ_i c_i L_i back-propagated THROUGH the framework (DeepSpeed ZeRO today; activation checkpointing and
  FSDP plug in here), with both passes drawing the same dropout masks.
- ``NonPrivate``: the same code path without clipping (``disable_dp``).

Each returns a ``MicroStep``: the per-example losses (for logging) and the tensor the Trainer's own
``training_step`` must back-propagate (None when ``.grad`` already holds the micro-batch's contribution).
See docs/clipping.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine, UnsupportedModuleError
from hf_dp.clipping.evaluate import ParameterShifter, evaluate_at_points, replay_rng, rng_state
from hf_dp.clipping.loss_scale import LossScale, unscaled_gradients
from hf_dp.clipping.plan import StepPlan
from hf_dp.clipping.replay import LayerReplay
from hf_dp.clipping.sums import ClippedSums
from hf_dp.clipping.tail import Tail, forward_to
from hf_dp.clipping.taps import NormCollector
from hf_dp.clipping.units import PrivacyUnits

LossFn = Callable[[nn.Module], torch.Tensor]


def norm_pass(
    engine: ClippingEngine,
    module: nn.Module,
    losses_of: LossFn,
    batch_size: int,
    plan: StepPlan,
    probe: bool = False,
    keep_gradients: bool = False,
    units: PrivacyUnits | None = None,
    taps_only: bool = False,
    keep_tail: bool = False,
) -> tuple[NormCollector, torch.Tensor]:
    """One tapped forward and backward of Σ_i L_i: the collector holds the per-example norms, no ``.grad``
    is written (activation checkpointing; ``ClippingEngine.norms_in_backward``). ``taps_only``: differentiate
    towards the taps alone (``autograd.grad``), so that no weight gradient is even formed: FSDP2 computes with
    unsharded copies of the parameters, which freezing the sharded ones does not freeze. ``keep_tail``: keep what
    the weighted pass needs to skip the model's tail (tail.py)."""
    with engine.norms_in_backward(
        batch_size, plan.clip_scale, probe, keep_gradients, units, freeze=not taps_only, keep_tail=keep_tail
    ) as collector:
        losses = losses_of(module)
        collector.counting = False  # the backward's recomputations are not uses
        if taps_only:
            torch.autograd.grad(losses.sum(), collector.anchor)
        else:
            losses.sum().backward()
    return collector, losses


@dataclass
class MicroStep:
    losses: torch.Tensor
    backward: torch.Tensor | None


class GradientWrittenOutsideClipping(RuntimeError):
    """Something other than the clipping strategy wrote a parameter's ``.grad`` during a DP step."""


class Bookkeeping:
    """Σ_i c_i u_i into ``.grad``, u_i = Σ_e w_e ∇L_i(θ + shift_e) clipped once per example in the plan's geometry.

    It owns ``.grad`` between two releases: at a logical batch's first micro-batch every gradient must be
    None or zero, and ``check_untouched`` (before the release) and every later micro-batch find each ``.grad``
    exactly as this strategy left it (same tensor, same version), or training stops before any noise is added.
    ``fp16``: the forwards run under fp16 autocast and every backward is of S·L_i, unscaled before clipping.
    """

    def __init__(
        self,
        engine: ClippingEngine,
        module: nn.Module,
        norms_in_backward: bool = False,
        fp16: LossScale | None = None,
    ) -> None:
        self.engine, self.module = engine, module
        self.norms_in_backward = norms_in_backward  # activation checkpointing: two passes, see _two_passes
        self.skips_tail: bool | None = None  # the weighted pass skips the tail (tail.py): None until checked
        self.fp16, self.loss_scale = fp16, 1.0 if fp16 is None else fp16.scale  # S
        self.shifter = ParameterShifter()
        self._verified = False
        self._left: list | None = None  # the gradients' (identity, version) after this strategy's last write

    def _versions(self) -> list:
        return [None if p.grad is None else (id(p.grad), p.grad._version) for p in self.engine.parameters]

    def check_untouched(self, before_release: bool = True) -> None:
        if self._left is None:
            stray = [p for p in self.engine.parameters if p.grad is not None and p.grad.any()]
        else:
            stray = [] if self._versions() == self._left else [None]
        if stray:
            raise GradientWrittenOutsideClipping(
                "a gradient reached the parameters outside per-example clipping (an extra backward in a "
                "training_step or a callback?); under DP every gradient must come from the per-example loss: "
                "override compute_per_example_loss to change it"
            )
        if before_release:
            self._left = None

    def take_sums(self) -> ClippedSums:
        return self.engine.take_sums()

    def run(
        self,
        losses_of: LossFn,
        mask: torch.Tensor,
        plan: StepPlan,
        model: nn.Module,
        units: PrivacyUnits | None = None,
    ) -> MicroStep:
        """``mask`` (U,): the real units; ``units`` groups the rows or tokens (None: a unit is a row)."""
        batch_size, verify = mask.shape[0], not self._verified
        rows = batch_size if units is None else units.rows
        self.check_untouched(before_release=False)
        if not mask.any():  # nothing to add; the release still adds noise to the zero sum
            self._left = self._versions()
            return MicroStep(mask.new_zeros(batch_size), None)
        if self.fp16 is not None:
            losses_of = self.fp16.scaled(losses_of)  # S·L_i: every backward below is S-scaled
        if self.norms_in_backward:
            losses = self._two_passes(losses_of, mask, plan, verify, units)
        elif plan.single_evaluation:
            state = rng_state()
            with self.engine.record(rows, units):
                losses = losses_of(self.module)
            if self.engine.saw_checkpointing:  # the user's own torch.utils.checkpoint: switch for good
                self.norms_in_backward = True
                replay_rng(state)
                losses = self._two_passes(losses_of, mask, plan, verify, units)
            else:
                self.engine.clipped_backward(
                    losses,
                    plan.clip_norm,
                    mask,
                    verify=verify,
                    clip_scale=plan.clip_scale,
                    loss_scale=self.loss_scale,
                )
        else:
            evaluated, losses = evaluate_at_points(
                self.engine, self.module, losses_of, plan.evaluations, rows, self.shifter, verify, units
            )
            self.engine.clip_and_accumulate(
                evaluated, plan.clip_norm, mask, clip_scale=plan.clip_scale, loss_scale=self.loss_scale
            )
        self._verified = True
        self._left = self._versions()
        return MicroStep(losses.detach() / self.loss_scale, None)

    def _two_passes(
        self, losses_of: LossFn, mask: torch.Tensor, plan: StepPlan, verify: bool, units: PrivacyUnits | None
    ) -> torch.Tensor:
        """Activation checkpointing: norms inside a first backward, then Σ_i c_i L_i back-propagated into ``.grad``
        (same dropout masks); both on the bare module. The weighted pass skips the model's tail (LM head and loss)
        from the first step's check on, if that found it exact (tail.py). With few trainable weights (LoRA) the
        first backward also keeps each example's explicit gradient and the clipped sum is formed from them: one
        pass. The first step always takes two whole passes, to check the taps against autograd. With fp16 the
        losses are S·L_i: the norms are ‖S g_i‖ / S, the factors applied to the S-scaled parts c_i / S, and
        ``.grad`` is divided by S."""
        if not plan.single_evaluation:
            raise ValueError(
                "this dp_optimizer evaluates each example at two parameter points (DiSK), which activation "
                "checkpointing does not support yet: turn activation_checkpointing off or pick another dp_optimizer"
            )
        batch_size = mask.shape[0]
        one_pass = not verify and self.engine.keeps_gradients(batch_size)
        keep_tail = not one_pass and self.skips_tail is not False
        state = rng_state()
        replay = LayerReplay(self.module) if keep_tail else None
        with replay.recording() if replay else contextlib.nullcontext():
            collector, losses = norm_pass(
                self.engine,
                self.module,
                losses_of,
                batch_size,
                plan,
                verify,
                one_pass,
                units,
                keep_tail=keep_tail,
            )
        if not torch.isfinite(losses[mask.bool()]).all():
            raise FloatingPointError(
                "an example's loss overflowed in the forward; with activation checkpointing its zero clip weight "
                "cannot keep inf out of the weighted backward: train in bf16 or float32, or turn checkpointing off"
            )
        norms = collector.norms() / self.loss_scale
        factors = self.engine.clip_factors(norms, plan.clip_norm) * mask.to(torch.float32)
        if one_pass:
            overflowed = ~torch.isfinite(norms)
            with torch.no_grad():
                for param, part in collector.kept_gradients():
                    part = part.without_examples(overflowed) if overflowed.any() else part
                    self.engine.add_to_sum(param, part, factors / self.loss_scale)
            return losses
        tail = collector.tail() if keep_tail else None
        replay_rng(state)
        if tail is not None and self.skips_tail:
            self._weighted_body_backward(tail, replay, losses_of, factors, units)
            self.engine.move_to_low_precision_sums()
            return losses
        before = self._projections(collector) if verify else None
        with unscaled_gradients(self.engine.parameters, self.loss_scale):
            (factors.detach().to(losses.dtype) * losses_of(self.module)).sum().backward()
        if verify:
            self._check_projections(collector, factors / self.loss_scale, before)
            if keep_tail:
                replay_rng(state)
                self.skips_tail = tail is not None and self._tail_matches(
                    tail, replay, losses_of, factors, units, collector
                )
        self.engine.move_to_low_precision_sums()
        return losses

    def _forward_to_tail(self, tail: Tail, replay: LayerReplay | None, losses_of: LossFn) -> torch.Tensor:
        """The weighted pass's forward up to the tail's input h, the checkpointed layers replayed (replay.py)."""
        with replay.replaying() if replay and replay.complete else contextlib.nullcontext():
            return forward_to(tail.boundary, lambda: losses_of(self.module))

    def _weighted_body_backward(
        self,
        tail: Tail,
        replay: LayerReplay | None,
        losses_of: LossFn,
        factors: torch.Tensor,
        units: PrivacyUnits | None,
    ) -> None:
        """Σ_i c_i g_i into ``.grad`` without the tail: the body's backward from the tail's input h, then the tail's
        own Σ_i c_i G_i."""
        hidden = self._forward_to_tail(tail, replay, losses_of)
        if hidden.requires_grad:
            with unscaled_gradients(self.engine.parameters, self.loss_scale):
                hidden.backward(tail.hidden_gradient(factors, units))
        with torch.no_grad():
            for param, part in tail.clipped_parts(factors):
                self.engine.add_to_sum(param, part, factors / self.loss_scale)

    def _tail_matches(
        self,
        tail: Tail,
        replay: LayerReplay | None,
        losses_of: LossFn,
        factors: torch.Tensor,
        units: PrivacyUnits | None,
        collector: NormCollector,
    ) -> bool:
        """The first step: the clipped sum without the tail equals the whole weighted pass's, now in ``.grad``
        (same tolerance as the taps' check), for every clipped parameter."""
        params = self.engine.parameters
        set_aside = [
            p.grad for p in params
        ]  # the whole pass's; reentrant checkpointing allows backward() only
        for param in params:
            param.grad = None
        hidden = self._forward_to_tail(tail, replay, losses_of)
        if hidden.requires_grad:
            with unscaled_gradients(params, self.loss_scale):
                hidden.backward(tail.hidden_gradient(factors, units))
        sums = {id(p): None if p.grad is None else p.grad.float() for p in params}
        for param, grad in zip(params, set_aside, strict=True):
            param.grad = grad
        with torch.no_grad():
            for param, part in tail.clipped_parts(factors):
                sums[id(param)] = part.accumulate(sums[id(param)], factors / self.loss_scale, param.float())
        tolerance = 5e-2 if collector.low_precision else 1e-3
        largest = max((float(p.grad.norm()) for p in params if p.grad is not None), default=0.0)
        for param in params:
            whole = torch.zeros_like(param, dtype=torch.float32) if param.grad is None else param.grad.float()
            ours = sums[id(param)]
            ours = torch.zeros_like(whole) if ours is None else ours
            if float((ours - whole).norm()) > tolerance * max(float(whole.norm()), 1e-3 * largest, 1e-12):
                return False
        return True

    def _projections(self, collector: NormCollector) -> dict[int, float]:
        return {
            id(p): 0.0 if p.grad is None else float((p.grad.double() * collector.direction(p).double()).sum())
            for p in self.engine.parameters
        }

    def _check_projections(
        self, collector: NormCollector, factors: torch.Tensor, before: dict[int, float]
    ) -> None:
        """⟨Σ_i c_i g_i, V_p⟩ from autograd must equal Σ_i c_i ⟨G_i, V_p⟩ from the norm pass for every parameter p:
        otherwise some use of p escaped the taps and its norm would be too small. The error is measured against
        ‖Σ_i c_i g_i‖ too (the typical size of a projection on V_p ~ N(0, I), which may land near 0 by chance)."""
        after = self._projections(collector)
        # the two passes round bf16 differently: measured up to 1.5% of a parameter's gradient (Llama 8×512, T 512)
        tolerance = 5e-2 if collector.low_precision else 1e-3
        for param in self.engine.parameters:
            pid = id(param)
            projection = collector.projections.get(pid)
            ours = 0.0 if projection is None else float((factors.double() * projection.double()).sum())
            scale = 0.0 if projection is None else float((factors.double() * projection.double()).abs().sum())
            theirs = after[pid] - before[pid]
            # ‖Σ_i c_i g_i‖: the gradient was None or 0 before this first micro-batch (check_untouched)
            gradient = 0.0 if param.grad is None else float(param.grad.double().norm())
            if abs(ours - theirs) > tolerance * max(scale, abs(theirs), gradient, 1e-6):
                raise UnsupportedModuleError(
                    f"parameter {self.engine.parameter_name(param)} gets gradient from outside the forward of the "
                    f"module that owns it (norm pass {ours:.4g} vs autograd {theirs:.4g} along a probe), so its "
                    "per-example norm would be wrong: freeze it or call it through its module"
                )


class TwoPass:
    """Norm pass on the bare module (no ``.grad`` touched), then W·Σ_i c_i L_i through the wrapped model.

    DeepSpeed averages gradients over the W processes, so the factor W leaves this rank's partition of the
    plain sum Σ_i c_i g_i for the mechanism. Every process runs both passes even with no real example, so the
    framework's collectives match. With activation checkpointing the norms come from inside the norm pass's
    backward (``ClippingEngine.norms_in_backward``), else by book-keeping.
    """

    def __init__(
        self,
        engine: ClippingEngine,
        module: nn.Module,
        world_size: int,
        norms_in_backward: bool = False,
        sharded_parameters: bool = False,
    ) -> None:
        self.engine, self.module, self.world_size = engine, module, world_size
        self.norms_in_backward = norms_in_backward
        self.sharded_parameters = (
            sharded_parameters  # FSDP2: the norm pass differentiates towards its taps only
        )

    def check_untouched(self) -> None:
        """The framework writes ``.grad`` in its own backward: nothing to check here."""

    def take_sums(self) -> ClippedSums:
        return ClippedSums()

    def run(
        self,
        losses_of: LossFn,
        mask: torch.Tensor,
        plan: StepPlan,
        model: nn.Module,
        units: PrivacyUnits | None = None,
    ) -> MicroStep:
        if not plan.single_evaluation:
            raise ValueError("evaluations away from θ (DiSK) need the book-keeping clipping strategy")
        batch_size = mask.shape[0]
        state = rng_state()
        if self.norms_in_backward:
            collector, losses = norm_pass(
                self.engine,
                self.module,
                losses_of,
                batch_size,
                plan,
                units=units,
                taps_only=self.sharded_parameters,
            )
            norms = collector.norms()
        else:
            with self.engine.record(batch_size if units is None else units.rows, units):
                losses = losses_of(self.module)
            gradients = self.engine.per_example_gradients(losses)
            norms = self.engine.per_example_norms([(gradients, 1.0)], clip_scale=plan.clip_scale)
        factors = self.engine.clip_factors(norms, plan.clip_norm) * mask
        replay_rng(state)
        losses = losses_of(model)
        weighted = (factors.detach().to(losses.dtype) * losses).sum() * self.world_size
        return MicroStep(losses.detach(), weighted)


class NonPrivate:
    """Σ_i L_i of the real examples, back-propagated by the Trainer (×W through DeepSpeed's mean, as above)."""

    def __init__(self, module: nn.Module | None, scale: float = 1.0) -> None:
        self.module, self.scale = module, scale  # module None: run the wrapped model (DeepSpeed)
        self.norms_in_backward = False

    def check_untouched(self) -> None:
        """Without DP the Trainer's own backward writes ``.grad``."""

    def take_sums(self) -> ClippedSums:
        return ClippedSums()

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


def clipping_strategy(
    engine: ClippingEngine | None, module: nn.Module, backend: Backend
) -> Bookkeeping | TwoPass | NonPrivate:
    """What the run needs: no engine means no DP; DeepSpeed and FSDP own the gradients, so they get the two passes
    (FSDP's norm pass always computes its norms inside the backward: with the parameters frozen, nothing reaches
    its reduce-scatter); activation checkpointing gets its norms inside a backward. fp16 (one process or DDP
    only: refused with DeepSpeed and FSDP): fp16 autocast with the fixed loss scale S."""
    owned = backend.framework_owns_gradients
    if engine is None:
        return NonPrivate(None, backend.world_size) if owned else NonPrivate(module)
    if owned:
        return TwoPass(
            engine,
            module,
            backend.world_size,
            norms_in_backward=backend.checkpointing or backend.fsdp,
            sharded_parameters=backend.fsdp,
        )
    fp16 = (
        None if backend.fp16_loss_scale is None else LossScale(backend.fp16_loss_scale, backend.device_type)
    )
    return Bookkeeping(engine, module, norms_in_backward=backend.checkpointing, fp16=fp16)
