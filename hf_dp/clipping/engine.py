"""The clipping engine of one model: its hooks, and the two ways to a micro-batch's per-example norms.

``record`` + ``per_example_gradients``: book-keeping (Bu et al. 2023, bookkeeping.py), one backward for the
output gradients, then the factored per-example gradients. ``norms_in_backward``: the norms inside a backward
of Σ_i L_i, for activation checkpointing and FSDP2 (taps.py). Either way c_i = clip factor of ‖s ⊙ u_i‖ and
Σ_i c_i G_i is written by the engine's ``SumWriter`` (sums.py). A step may evaluate each example at several
parameter points and clip the weighted combination u_i = Σ_e w_e g_i^e once (DiSK), in a scaled geometry
‖s ⊙ u_i‖ ≤ C (scale-then-privatize, DP²): ``per_example_gradients`` once per evaluation, then
``clip_and_accumulate`` once. Which passes a step takes is the pipeline's choice (pipeline.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from hf_dp.clipping.bookkeeping import EvaluationGradients, Recording, combined_terms, norms_of
from hf_dp.clipping.geometry import ClippingFn, ClippingMode, ClipScales, scales_by_id
from hf_dp.clipping.hooks import ForwardHooks, Layers, UnsupportedModuleError, assign_parameters
from hf_dp.clipping.per_example import Dropped, PerExampleGradient
from hf_dp.clipping.quantized import check_quantized_base
from hf_dp.clipping.sums import Clipped, ClippedSums, SumWriter, Terms
from hf_dp.clipping.taps import NormCollector, TapOptions
from hf_dp.clipping.units import PrivacyUnits

__all__ = ["ClippingEngine", "EvaluationGradients", "UnsupportedModuleError"]

NO_OPTIONS = TapOptions()


@contextlib.contextmanager
def frozen(params: list[nn.Parameter]) -> Iterator[None]:
    """The norm pass computes no weight gradient and writes no ``.grad``: the clipped parameters are frozen, and
    their gradients set aside and put back, so that a parameter the forward itself unfreezes (peft's
    ``disable_adapter`` sets ``requires_grad`` on the adapters when it exits) cannot leave an unclipped gradient."""
    flags, grads = [p.requires_grad for p in params], [p.grad for p in params]
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    try:
        yield
    finally:
        for p, flag, grad in zip(params, flags, grads, strict=True):
            p.requires_grad_(flag)
            p.grad = grad


class ClippingEngine:
    """Hooks a model so that ``clipped_backward(per_example_losses)`` adds Σ_i c_i ∇L_i to each ``.grad``."""

    def __init__(
        self,
        model: nn.Module,
        clipping_fn: ClippingFn = "abadi",
        mode: ClippingMode = "ghost",
        allow_functorch_fallback: bool = True,
    ) -> None:
        self.model = model
        self.low_precision_base = check_quantized_base(model)  # a quantised layer computes in bf16/fp16
        self.materialise = mode == "per_sample"
        self.layers = Layers(model, assign_parameters(model, allow_functorch_fallback))
        self.sums = SumWriter(clipping_fn)
        self.clipped_numel = sum(p.numel() for p in self.parameters)
        self.model_numel = sum(p.numel() for p in model.parameters())
        self.saw_checkpointing = False  # a recorded forward ran under torch.utils.checkpoint
        self._recording: Recording | None = None  # the last micro-batch's book-keeping forward
        self._hooks = ForwardHooks(list(self.layers.owned))

    @property
    def parameters(self) -> list[nn.Parameter]:
        """What this engine clips, each once, as its modules hold them now (FSDP2 swaps in sharded ones)."""
        return self.layers.parameters

    @property
    def nonfinite_examples(self) -> int:
        """Examples clipped to zero because their gradient overflowed."""
        return self.sums.nonfinite_examples

    @property
    def low_precision_sums(self) -> dict[nn.Parameter, torch.Tensor]:
        """The float32 clipped sums of bf16/fp16 parameters, which the mechanism noises and casts."""
        return self.sums.low_precision

    def parameter_name(self, param: nn.Parameter) -> str:
        """The parameter's name in the model, as the modules hold it now."""
        return self.layers.parameter_names().get(id(param), "?")

    def remove_hooks(self) -> None:
        """Leave the user's model as it was (the trainer calls this when training ends)."""
        self._hooks.remove()

    def __enter__(self) -> ClippingEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove_hooks()

    # ---- the norms ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def record(self, batch_size: int, units: PrivacyUnits | None = None) -> Iterator[Recording]:
        """Record the forward passes of one micro-batch of ``batch_size`` rows; ``units`` groups its rows or tokens
        into privacy units (None: one unit per row), and the per-example losses and norms are then per unit."""
        recording = self._recording = Recording(self.layers, self.materialise, batch_size, units)
        self._hooks.receiver = recording
        try:
            yield recording
        finally:
            self._hooks.receiver = None
            self.saw_checkpointing |= recording.saw_checkpointing

    def per_example_gradients(
        self, per_example_loss: torch.Tensor, verify: bool = False
    ) -> EvaluationGradients:
        """The per-example gradients of the forward recorded by the last ``record(B)``, in factored form.

        Call it while the parameters are still those of the forward (the rules read the recorded inputs only, but
        the torch.func fallback and ``verify`` use the current parameters). ``verify`` also runs autograd's own
        gradient of Σ_i L_i and raises if the unclipped engine sum disagrees, which catches a parameter used
        outside the forward of the module that owns it.
        """
        if self._recording is None:
            raise RuntimeError("per_example_gradients needs a forward recorded by ClippingEngine.record")
        return self._recording.gradients(per_example_loss, verify)

    def norms_and_terms(
        self, evaluations: Sequence[tuple[EvaluationGradients, float]], clip_scale: ClipScales | None = None
    ) -> tuple[torch.Tensor, Terms]:
        """‖s ⊙ u_i‖ with u_i = Σ_e w_e g_i^e (s = 1 for a parameter without a scale), shape (B,), and the
        weighted parts per parameter; no ``.grad``."""
        terms, count = combined_terms(evaluations)
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        with torch.no_grad():
            norms = norms_of(
                terms, count, scales_by_id(clip_scale, self.parameters), self.materialise, device
            )
        return norms, terms

    def per_example_norms(
        self,
        evaluations: Sequence[tuple[EvaluationGradients, float]],
        *,
        clip_scale: ClipScales | None = None,
    ) -> torch.Tensor:
        """‖s ⊙ u_i‖ with u_i = Σ_e w_e g_i^e, shape (B,); no ``.grad``."""
        return self.norms_and_terms(evaluations, clip_scale)[0]

    @contextlib.contextmanager
    def norms_in_backward(
        self,
        batch_size: int,
        clip_scale: ClipScales | None = None,
        units: PrivacyUnits | None = None,
        options: TapOptions = NO_OPTIONS,
        freeze: bool = True,
    ) -> Iterator[NormCollector]:
        """Tap the forward of one micro-batch; ``backward()`` of Σ_i L_i then fills ``collector.norms()`` without
        keeping any layer input alive and without touching ``.grad`` (the clipped parameters are frozen).
        ``batch_size`` counts the privacy units ``units`` groups the rows into (None: one a row). ``freeze=False``
        when the backward differentiates towards ``collector.anchor`` only (FSDP2, which decides from
        ``requires_grad`` in a forward which gradients it will reduce: frozen there, they never would be)."""
        missing = [
            self.layers.module_names.get(m, "?") for m, rule in self.layers.rules.items() if rule is None
        ]
        if missing:
            raise UnsupportedModuleError(
                f"{missing[0]} has no per-example rule, which activation checkpointing needs (the torch.func "
                "fallback re-runs the module outside the checkpoint): register one with "
                "hf_dp.clipping.rules.register_rule, freeze it, or turn checkpointing off"
            )
        scales = scales_by_id(clip_scale, self.parameters)
        collector = NormCollector(self.layers, batch_size, units, scales, self.materialise, options)
        collector.low_precision = self.low_precision_base
        self._hooks.receiver = collector
        try:
            with frozen(self.parameters if freeze else []):
                yield collector
        finally:
            self._hooks.receiver = None

    # ---- the clipped sum ------------------------------------------------------------------------------

    def clip_factors(self, norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
        """c_i at ``clip_norm`` with this engine's clipping function (0 for a non-finite norm, counted)."""
        return self.sums.clip_factors(norms, clip_norm)

    def clip(
        self, norms: torch.Tensor, clip_norm: float, mask: torch.Tensor, losses: torch.Tensor | None = None
    ) -> Clipped:
        """c_i · mask_i and what the sums leave out, from one host read for the micro-batch (``SumWriter.clip``)."""
        return self.sums.clip(norms, clip_norm, mask, losses)

    def add_to_sum(self, param: nn.Parameter, part: PerExampleGradient, weights: torch.Tensor) -> None:
        """The clipped sum += Σ_i w_i G_i: in ``.grad``, or for a bf16/fp16 parameter in its float32 sum."""
        self.sums.add(param, part, weights)

    def add_terms(self, terms: Terms, weights: torch.Tensor, overflowed: torch.Tensor | Dropped) -> None:
        """The clipped sum += Σ_e w_e Σ_i weights_i G_i^e, without the ``overflowed`` examples."""
        with torch.no_grad():
            self.sums.add_terms(terms, weights, overflowed)

    def move_to_low_precision_sums(self) -> None:
        """After autograd wrote a micro-batch's clipped sum into a bf16/fp16 ``.grad``: add it to the float32 sum."""
        self.sums.move_from_gradients(self.parameters)

    def take_sums(self) -> ClippedSums:
        """The logical batch's clipped sums for the release; the engine's float32 sums start empty again."""
        return self.sums.take()

    def clipped_backward(
        self,
        per_example_loss: torch.Tensor,
        clip_norm: float,
        example_mask: torch.Tensor | None = None,
        *,
        verify: bool = False,
        clip_scale: ClipScales | None = None,
    ) -> torch.Tensor:
        """Add Σ_i c_i ∇L_i to every clipped parameter's ``.grad``; return the per-example norms ‖s ⊙ ∇L_i‖.
        ``example_mask`` (B,) zeroes c_i of padding examples; ``verify`` as in ``per_example_gradients``."""
        gradients = self.per_example_gradients(per_example_loss, verify=verify)
        return self.clip_and_accumulate([(gradients, 1.0)], clip_norm, example_mask, clip_scale=clip_scale)

    def clip_and_accumulate(
        self,
        evaluations: Sequence[tuple[EvaluationGradients, float]],
        clip_norm: float,
        example_mask: torch.Tensor | None = None,
        *,
        clip_scale: ClipScales | None = None,
    ) -> torch.Tensor:
        """Clip each example's weighted combination u_i = Σ_e w_e g_i^e once, in the geometry ‖s ⊙ u_i‖.

        c_i = clip factor of ‖s ⊙ u_i‖ at ``clip_norm``, times ``example_mask``; then ``.grad`` += Σ_e w_e Σ_i c_i g_i^e,
        the UN-scaled clipped sum (the mechanism scales the noise instead). Returns ‖s ⊙ u_i‖, shape (B,).
        Clipping the combination, not each evaluation, keeps the sensitivity at C (docs/clipping.md).
        """
        norms, terms = self.norms_and_terms(evaluations, clip_scale)
        with torch.no_grad():
            factors = self.clip_factors(norms, clip_norm)
            if example_mask is not None:
                factors = factors * example_mask.to(factors.dtype)
        self.add_terms(terms, factors, ~torch.isfinite(norms))
        return norms
