"""The clipping engine of one model: its hooks, its clipped parameters, and the two ways to a micro-batch's
per-example norms.

``record`` + ``per_example_gradients``: book-keeping (Bu et al. 2023, bookkeeping.py), one backward for the
output gradients, then the factored per-example gradients; ``norms_and_terms`` combines several evaluations
u_i = Σ_e w_e g_i^e (DiSK) and takes ‖s ⊙ u_i‖ in a scaled geometry (scale-then-privatize, DP²).
``norms_in_backward``: the norms inside a backward of Σ_i L_i, for activation checkpointing and FSDP2 (taps.py).
The clip factors and the clipped sums are the engine's ``SumWriter``'s (``sums``, sums.py); which passes a step
takes is the pipeline's choice (pipeline.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from hf_dp.clipping.bookkeeping import EvaluationGradients, Recording, combined_terms, norms_of
from hf_dp.clipping.geometry import ClippingFn, ClippingMode, ClipScales, scales_by_id
from hf_dp.clipping.groups import ClipGroups, GroupSums, clip_groups
from hf_dp.clipping.hooks import (
    ForwardHooks,
    Layers,
    Receiver,
    UnsupportedModuleError,
    assign_parameters,
    repeated_prompts,
)
from hf_dp.clipping.lora_params import wrapped, wraps_fallback
from hf_dp.clipping.quantized import check_quantized_base
from hf_dp.clipping.rows import RowTracking
from hf_dp.clipping.rules import call_rule_for, parameter_at, rule_for
from hf_dp.clipping.sums import SumWriter, Terms
from hf_dp.clipping.taps import NormCollector, TapOptions
from hf_dp.clipping.units import PrivacyUnits
from hf_dp.clipping.wide_gemm import LOW_PRECISION

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
    """A model's forward hooks (``layers``: which module clips which parameter), its per-example norms, and the
    writer of its clipped sums (``sums``)."""

    def __init__(
        self,
        model: nn.Module,
        clipping_fn: ClippingFn = "abadi",
        mode: ClippingMode = "ghost",
        allow_functorch_fallback: bool = True,
        grouping: str | Sequence[str] = "all",
        group_norms: Sequence[float] | None = None,
        clip_norm: float = 1.0,
    ) -> None:
        """``grouping``, ``group_norms``: group-wise clipping (groups.py; ``clip_norm`` C, which the groups'
        norms share)."""
        self.model = model
        # the base computes in bf16/fp16 (a quantised layer's compute dtype, or its weights): its backward rounds
        # there, though trainable adapters and their outputs are float32
        self.low_precision_base = check_quantized_base(model) | any(
            p.dtype in LOW_PRECISION for p in model.parameters()
        )
        self.materialise = mode == "per_sample"
        self.layers = Layers(model, assign_parameters(model, allow_functorch_fallback))
        self.row_tracking = RowTracking()  # flattened tokens: each row's example, carried through the forward
        self.sums = SumWriter(clipping_fn)
        self.clipped_numel = sum(p.numel() for p in self.parameters)
        self.model_numel = sum(p.numel() for p in model.parameters())
        self.saw_checkpointing = False  # a recorded forward ran under torch.utils.checkpoint
        self._recording: Recording | None = None  # the last micro-batch's book-keeping forward
        self._hooks = ForwardHooks(list(self.layers.owned), repeated_prompts(model))
        names = self.layers.parameter_names()
        every_name: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            every_name.setdefault(id(param), []).append(name)
        self.groups: ClipGroups | None = clip_groups(
            [(names.get(id(p), "?"), p) for p in self.parameters],
            grouping,
            group_norms,
            clip_norm,
            {
                names.get(id(p), "?"): every_name.get(id(p)) or [names.get(id(p), "?")]
                for p in self.parameters
            },
        )

    @property
    def parameters(self) -> list[nn.Parameter]:
        """What this engine clips, each once, as its modules hold them now (FSDP2 swaps in sharded ones)."""
        return self.layers.parameters

    def parameter_name(self, param: nn.Parameter) -> str:
        """The parameter's name in the model, as the modules hold it now."""
        return self.layers.parameter_names().get(id(param), "?")

    def fallback_report(self) -> str | None:
        """One line naming the modules without a layer rule, which take the torch.func fallback (by type: how many,
        the first one's name, floats each), and what it costs: their per-example gradients materialised, those
        floats per example (per row, where a module takes flattened rows: MoE routers and experts) each
        micro-batch; None when every module has a rule."""
        kinds: dict[tuple[str, int], list[nn.Module]] = {}
        for module, rule in self.layers.rules.items():
            if rule is not None:
                continue
            if wraps_fallback(module):
                # a LoRA wrapper's fallback materialises the wrapped module's W' = W + s·B A
                params = list(wrapped(module).parameters(recurse=False))
            elif call_rule_for(module) is None:
                params = self.layers.of(module)
            else:
                continue
            kinds.setdefault((type(module).__name__, sum(p.numel() for p in params)), []).append(module)
        if not kinds:
            return None
        listed = "; ".join(
            f"{len(found)} × {kind} ({floats:,} floats each, e.g. {self.layers.module_names.get(found[0], '?')})"
            for (kind, floats), found in kinds.items()
        )
        return (
            f"hf_dp: modules without a layer rule take the torch.func fallback, which materialises their per-example "
            f"gradients, per example (or per row where a module sees flattened rows) each micro-batch: {listed}; "
            "register a rule (hf_dp.clipping.rules.register_rule) or freeze them to avoid it"
        )

    def remove_hooks(self) -> None:
        """Leave the user's model as it was (the trainer calls this when training ends)."""
        self._hooks.remove()

    def __enter__(self) -> ClippingEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove_hooks()

    def _loose(self, receiver: Receiver) -> Callable[[nn.Parameter], torch.Tensor | None]:
        """For the row tracker: a clipped parameter read while none of the modules owning it is in its forward
        joins the fallback of the innermost running module when that takes the torch.func fallback and contains it
        (``receiver.joins``), else goes to ``receiver.loose_use`` (shared.py); its owners as the modules hold them
        now (FSDP2 swaps). Once the tracker has switched itself off (the first micro-batch read no parameter so),
        such a read is refused: the plan and the first step's checks were fixed without it."""
        watching = not self.row_tracking.on
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for module, names in self.layers.owned.items():
            for name in names:
                owners.setdefault(id(parameter_at(module, name)), []).append((module, name))
        running = self._hooks.running = []  # off again when the receiver goes (record, norms_in_backward)

        def loose(param: nn.Parameter) -> torch.Tensor | None:
            found = owners.get(id(param))
            if found is None or self._hooks.in_hook or any(module in running for module, _ in found):
                return None
            if watching:
                module, name = found[0]
                where = self.layers.module_names.get(module, type(module).__name__)
                raise UnsupportedModuleError(
                    f"{where}.{name} was read outside the forward of its module in a later step, "
                    "where the first step (whose checks fixed how this model is clipped) did not read it so; the "
                    "step is refused before anything is released: read it through its module, or freeze it"
                )
            inner = running[-1] if running else None
            if inner is not None and self.layers.rules.get(inner, rule_for) is None:
                nested = next((n for n, p in inner.named_parameters() if p is param), None)
                # inside a module that takes the torch.func fallback: it covers the read
                if nested is not None:
                    receiver.joins(inner, nested)
                    self.row_tracking.keep()  # every step must see the read
                    return None
            module, name = found[0]
            return receiver.loose_use(module, name, param)

        return loose

    def _watched(
        self, receiver: Receiver, watch: bool
    ) -> Callable[[nn.Parameter], torch.Tensor | None] | None:
        """What a recorded forward hands its loose reads to: the tracker's, or the watch's where ``watch``."""
        return self._loose(receiver) if self.row_tracking.on or watch else None

    # ---- the norms ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def record(
        self, batch_size: int, units: PrivacyUnits | None = None, watch: bool = False
    ) -> Iterator[Recording]:
        """Record the forward passes of one micro-batch of ``batch_size`` rows; ``units`` groups its rows or tokens
        into privacy units (None: one unit per row), and the per-example losses and norms are then per unit.
        ``watch``: once the row tracker has stopped, still refuse a loose parameter read (reads.LooseWatch), for a
        sum pass that back-propagates the model (sum_passes.WholeSum, BodySum), through which its gradient would
        pass uncounted; the sums formed from the taps leave it out."""
        recording = Recording(
            self.layers, self.materialise, batch_size, units, self.row_tracking, self.low_precision_base
        )
        self._recording = recording
        self._hooks.receiver = recording
        try:
            with self.row_tracking.forward(batch_size, self._watched(recording, watch)):
                yield recording
        finally:
            self._hooks.receiver, self._hooks.running = None, None
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

    @contextlib.contextmanager
    def norms_in_backward(
        self,
        batch_size: int,
        clip_scale: ClipScales | None = None,
        units: PrivacyUnits | None = None,
        options: TapOptions = NO_OPTIONS,
        freeze: bool = True,
        group_sums: GroupSums | None = None,
        watch: bool = False,
    ) -> Iterator[NormCollector]:
        """Tap the forward of one micro-batch; ``backward()`` of Σ_i L_i then fills ``collector.norms()`` without
        keeping any layer input alive and without touching ``.grad`` (the clipped parameters are frozen).
        ``batch_size`` counts the privacy units ``units`` groups the rows into (None: one a row). ``freeze=False``
        when the backward differentiates towards ``collector.anchor`` only (FSDP2, which decides from
        ``requires_grad`` in a forward which gradients it will reduce: frozen there, they never would be).
        ``group_sums``: group-wise clipping, each group's clipped sum formed in the backward (groups.py); ``watch``
        as for ``record``."""
        scales = scales_by_id(clip_scale, self.parameters)
        collector = NormCollector(
            self.layers, batch_size, units, scales, self.materialise, options, self.row_tracking, group_sums
        )
        collector.low_precision = self.low_precision_base
        self._hooks.receiver = collector
        try:
            with (
                frozen(self.parameters if freeze else []),
                self.row_tracking.forward(collector.rows, self._watched(collector, watch)),
            ):
                yield collector
        finally:
            self._hooks.receiver, self._hooks.running = None, None
