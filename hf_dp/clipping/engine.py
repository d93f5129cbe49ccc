"""Exact per-example clipping with one backward pass (book-keeping, Bu et al. 2023).

Forward hooks record each parameter-owning module's input; one ``autograd.grad`` of Σ_i L_i with
respect to the recorded outputs gives every output gradient without computing any weight gradient.
From (input, output gradient) each layer rule gives per-example gradients in factored form, their
norms are summed per Parameter object (so tied weights get the norm of the sum, cross terms
included), c_i = clip factor, and Σ_i c_i G_i is written to ``.grad`` by one GEMM per layer.
Where B explicit per-example gradients are smaller than the output gradient book-keeping would keep
(long sequences: T > d_in, e.g. the LM head), the layer's are formed inside that backward instead, as
soon as its output gradient exists, and its input and output gradient are let go (``_materialise``).

A step may evaluate each example at several parameter points and clip the weighted combination
u_i = Σ_e w_e g_i^e once (DiSK), in a scaled geometry ‖s ⊙ u_i‖ ≤ C (scale-then-privatize, DP²):
``per_example_gradients`` once per evaluation, then ``clip_and_accumulate`` once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hf_dp.clipping.geometry import (
    ClippingFn,
    ClippingMode,
    ClipScale,
    ClipScales,
    FactoredScale,
    clip_factors,
)
from hf_dp.clipping.per_example import Materialised, PerExampleGradient, Weighted, combined_squared_norm
from hf_dp.clipping.rules import functorch_per_example_grads, rule_for
from hf_dp.clipping.sums import ClippedSums
from hf_dp.clipping.taps import NormCollector, frozen, in_reentrant_checkpoint, is_checkpointing, tap
from hf_dp.clipping.units import PrivacyUnits, regroup_for_rule

LOW_PRECISION = (torch.bfloat16, torch.float16)
# With checkpointing, explicit per-example gradients replace the second pass when all B of them take at most
# this share of the model's parameter count (LoRA adapters: ~1%; full fine-tuning never qualifies).
KEPT_GRADIENTS_SHARE = 0.05
# Book-keeping materialises a layer's B per-example gradients inside the backward when they take fewer floats
# than this share of the output gradient it would otherwise keep until the backward ends.
MATERIALISE_BELOW_OUTPUT_SHARE = 1.0


class UnsupportedModuleError(ValueError):
    """A trainable parameter cannot be clipped per example."""


@dataclass
class _RecordedForward:
    module: nn.Module
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]


@dataclass
class EvaluationGradients:
    """The per-example gradients of one evaluation (one forward and its backward), per Parameter object:
    ``parts[id(p)] = (p, [one factored part per use of p])``."""

    parts: dict[int, tuple[nn.Parameter, list[PerExampleGradient]]]
    batch_size: int


def _scales_by_id(scales: ClipScales | None, clipped: list[nn.Parameter]) -> dict[int, ClipScale]:
    """The clip scales of the parameters this engine clips, checked against their shapes."""
    found: dict[int, ClipScale] = {}
    by_id = {id(p): p for p in clipped}
    for param, scale in (scales or {}).items():
        if id(param) not in by_id:
            continue
        if isinstance(scale, FactoredScale):
            shape = (scale.rows.numel(), scale.cols.numel())
            if param.dim() != 2 or tuple(param.shape) != shape:
                raise ValueError(
                    f"a FactoredScale {shape} needs a 2-D parameter of that shape, got {tuple(param.shape)}"
                )
        elif scale.shape != param.shape:
            raise ValueError(
                f"a dense clip scale must be shaped like its parameter {tuple(param.shape)}, got {tuple(scale.shape)}"
            )
        found[id(param)] = scale
    return found


def _is_batch_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) or type(module).__name__.endswith("BatchNorm")


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
        self.clipping_fn = clipping_fn
        self.materialise = mode == "per_sample"
        self._owned = self._assign_parameters(model, allow_functorch_fallback)
        self._rules = {module: rule_for(module) for module in self._owned}
        self._clipped_numel = sum(p.numel() for p in self.parameters)
        self._model_numel = sum(p.numel() for p in model.parameters())
        self._module_names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
        self._calls: list[_RecordedForward] = []
        self._batch_size: int | None = None  # rows of the micro-batch in the forward
        self._units: PrivacyUnits | None = None  # None: each row is its own privacy unit
        self._recording = False
        self._collector: NormCollector | None = None
        # book-keeping's explicit per-example gradients formed in the backward (see _materialise)
        self._anchor: torch.Tensor | None = None
        self._materialised: list[tuple[nn.Module, dict[str, PerExampleGradient]]] = []
        self.saw_checkpointing = False  # a recorded forward ran under torch.utils.checkpoint
        self.nonfinite_examples = 0  # examples clipped to zero because their gradient overflowed
        # the float32 clipped sums of bf16/fp16 parameters, which the mechanism noises and casts
        self.low_precision_sums: dict[nn.Parameter, torch.Tensor] = {}
        self._handles = []
        for module in self._owned:
            self._handles.append(
                module.register_forward_pre_hook(self._expand_broadcast_batch, with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(self._record, with_kwargs=True))

    @property
    def parameters(self) -> list[nn.Parameter]:
        """What this engine clips, each once, as its modules hold them now: FSDP2's ``prepare`` swaps sharded
        Parameters into the modules after the engine is built (and the optimizer's groups with them)."""
        unique = {id(getattr(m, n)): getattr(m, n) for m, names in self._owned.items() for n in names}
        return list(unique.values())

    # ---- set-up -------------------------------------------------------------------------------------

    @staticmethod
    def _assign_parameters(model: nn.Module, allow_fallback: bool) -> dict[nn.Module, list[str]]:
        """Which module computes per-example gradients of which trainable parameter.

        A parameter owned by a module with a rule is left to it even if a parent also registers it
        (BERT's prediction head registers its decoder's bias twice).
        """
        for name, module in model.named_modules():
            if _is_batch_norm(module):
                raise UnsupportedModuleError(
                    f"{name} ({type(module).__name__}) mixes examples in a batch, so per-example gradients do not "
                    "exist: replace it with GroupNorm or LayerNorm"
                )
            trainable = any(p.requires_grad for p in module.parameters(recurse=False))
            if isinstance(module, nn.RNNBase) and trainable and rule_for(module) is None:
                raise UnsupportedModuleError(
                    f"{name} ({type(module).__name__}) is a trainable recurrent layer: it has no per-example rule and "
                    "its fused kernel cannot run per example under torch.func; freeze it, or register a rule for it "
                    "with hf_dp.clipping.rules.register_rule"
                )
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for pname, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    owners.setdefault(id(param), []).append((module, pname))
        owned: dict[nn.Module, list[str]] = {}
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        for pid, candidates in owners.items():
            with_rule = [(m, n) for m, n in candidates if rule_for(m) is not None]
            chosen = with_rule or candidates
            if not with_rule and not allow_fallback:
                module, _ = candidates[0]
                raise UnsupportedModuleError(
                    f"trainable parameter {names[pid]} sits in {type(module).__name__}, which has no per-example "
                    "rule: freeze it or allow the torch.func fallback"
                )
            for module, pname in chosen:
                owned.setdefault(module, []).append(pname)
        return owned

    def parameter_name(self, param: nn.Parameter) -> str:
        """The parameter's name in the model, as the modules hold it now (see ``parameters``)."""
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        return names.get(id(param), "?")

    def remove_hooks(self) -> None:
        """Leave the user's model as it was (the trainer calls this when training ends)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> ClippingEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove_hooks()

    # ---- recording ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def record(self, batch_size: int, units: PrivacyUnits | None = None) -> Iterator[None]:
        """Record the forward passes of one micro-batch of ``batch_size`` rows; ``units`` groups its rows or tokens
        into privacy units (None: one unit per row), and the per-example losses and norms are then per unit."""
        self._calls, self._batch_size, self._recording = [], batch_size, True
        self._units = None if units is None or units.is_trivial else units
        self._anchor, self._materialised = None, []
        try:
            yield
        finally:
            self._recording = False

    def keeps_gradients(self, batch_size: int) -> bool:
        """B explicit per-example gradients cost at most KEPT_GRADIENTS_SHARE of the model's weights (LoRA)."""
        return batch_size * self._clipped_numel <= KEPT_GRADIENTS_SHARE * self._model_numel

    @contextlib.contextmanager
    def norms_in_backward(
        self,
        batch_size: int,
        clip_scale: ClipScales | None = None,
        probe: bool = False,
        keep_gradients: bool = False,
        units: PrivacyUnits | None = None,
        freeze: bool = True,
        keep_tail: bool = False,
    ) -> Iterator[NormCollector]:
        """Tap the forward of one micro-batch; ``backward()`` of Σ_i L_i then fills ``collector.norms()`` without
        keeping any layer input alive and without touching ``.grad`` (the clipped parameters are frozen).
        ``keep_gradients``: the collector also keeps each example's explicit gradient (see ``keeps_gradients``).
        ``units``: the norms are per privacy unit (``batch_size`` of them), as in ``record``. ``freeze=False``
        when the backward differentiates towards ``collector.anchor`` only (FSDP2, which decides from
        ``requires_grad`` in a forward which gradients it will reduce: frozen there, they never would be).
        ``keep_tail``: the collector keeps what the weighted pass needs to skip the model's tail (tail.py)."""
        missing = [self._module_names.get(m, "?") for m, rule in self._rules.items() if rule is None]
        if missing:
            raise UnsupportedModuleError(
                f"{missing[0]} has no per-example rule, which activation checkpointing needs (the torch.func "
                "fallback re-runs the module outside the checkpoint): register one with "
                "hf_dp.clipping.rules.register_rule, freeze it, or turn checkpointing off"
            )
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.parameters) else torch.float32
        collector = NormCollector(
            self._rules,
            self._owned,
            batch_size,
            _scales_by_id(clip_scale, self.parameters),
            self.materialise,
            dtype,
            device,
            probe,
            keep_gradients,
            None if units is None or units.is_trivial else units,
            self._module_names,
            keep_tail,
        )
        self._collector, self._batch_size = collector, batch_size if units is None else units.rows
        try:
            with frozen(self.parameters if freeze else []):
                yield collector
        finally:
            self._collector = None

    def _active(self) -> bool:
        return (self._recording or self._collector is not None) and torch.is_grad_enabled()

    def _stop_recording_if_checkpointed(self) -> None:
        """Book-keeping would keep the inputs a checkpoint drops (non-reentrant) or never sees them (reentrant, run
        under no_grad): stop recording and let the strategy switch to norms in the backward."""
        if self._recording and (
            (not torch.is_grad_enabled() and in_reentrant_checkpoint()) or is_checkpointing()
        ):
            self.saw_checkpointing, self._recording, self._calls = True, False, []

    def _expand_broadcast_batch(self, module: nn.Module, args: tuple, kwargs: dict):
        """HF models pass position_ids of batch size 1 and broadcast the output; expand the input to B
        instead, which leaves the forward unchanged but keeps each example's output gradient apart."""
        if not self._active() or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if x.dim() > 0 and x.shape[0] == 1 and self._batch_size and self._batch_size > 1:
            return (x.expand(self._batch_size, *x.shape[1:]), *args[1:]), kwargs
        return None

    def _record(self, module: nn.Module, args: tuple, kwargs: dict, output):
        self._stop_recording_if_checkpointed()
        if (
            self._collector is not None
            and self._collector.counting
            and not torch.is_grad_enabled()
            and in_reentrant_checkpoint()
        ):
            self._collector.count(
                module, checkpointed=True
            )  # reentrant checkpointing: tapped when recomputed in the backward
        if not self._active():
            return None
        outputs = [
            o
            for o in (output if isinstance(output, tuple | list) else (output,))
            if isinstance(o, torch.Tensor)
        ]
        if self._collector is None and not any(o.requires_grad for o in outputs):
            return None
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and first.dim() > 0 and first.shape[0] != self._batch_size:
            raise UnsupportedModuleError(
                f"{self._module_names.get(module, '?')} ({type(module).__name__}) has trainable parameters but its "
                f"input of shape {tuple(first.shape)} has no batch dimension of {self._batch_size} (it is shared "
                "by all examples, like T5's relative_attention_bias): freeze it"
            )
        if self._collector is not None:
            if first is None or not isinstance(output, torch.Tensor):
                raise UnsupportedModuleError(
                    f"{self._module_names.get(module, '?')} ({type(module).__name__}) must take a tensor first "
                    "and return one tensor for its norm to be computed inside the backward (activation "
                    "checkpointing): register a rule for a module that does, or turn checkpointing off"
                )
            return self._collector.tap(module, first, output)
        if self._materialises_in_backward(module, first, output):
            if self._anchor is None:
                self._anchor = torch.zeros((), device=output.device, requires_grad=True)
            return tap(output, self._anchor, self._materialise, module, first)
        self._calls.append(_RecordedForward(module, tuple(args), dict(kwargs), outputs))
        return None

    def _materialises_in_backward(self, module: nn.Module, x: torch.Tensor | None, output) -> bool:
        """B explicit per-example gradients of the module take fewer floats than its output gradient (a
        linear layer: T > d_in), which book-keeping would keep to the end of the backward."""
        if self._rules[module] is None or x is None or not isinstance(output, torch.Tensor):
            return False
        params = [getattr(module, name) for name in self._owned[module]]
        if any(
            hasattr(p, "ds_shape") for p in params
        ):  # ZeRO-3 partitions (shaped by ds_shape): kept factored
            return False
        floats = (self._batch_size or 0) * sum(p.numel() for p in params)
        return floats < MATERIALISE_BELOW_OUTPUT_SHARE * output.numel()

    def _materialise(self, module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """In the backward: the module's explicit per-example gradients (B, *param.shape) from (x, ∂L/∂y), for its
        trained parameters only (not a frozen weight beside a trained bias: BiTFiT)."""
        with torch.no_grad():
            found = self._apply_rule(module, x, grad_output)
            explicit = {
                name: found[name].explicit(getattr(module, name).shape) for name in self._owned[module]
            }
        self._materialised.append((module, explicit))

    def _apply_rule(
        self, module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor
    ) -> dict[str, PerExampleGradient]:
        """The module's layer rule on (x, ∂L/∂y), per privacy unit."""
        where = f"{self._module_names.get(module, '?')} ({type(module).__name__})"
        x, grad_output = regroup_for_rule(self._units, x, grad_output, where)
        return self._rules[module](module, x, grad_output)

    # ---- per-example gradients, then the clipped sum ----------------------------------------------

    def clipped_backward(
        self,
        per_example_loss: torch.Tensor,
        clip_norm: float,
        example_mask: torch.Tensor | None = None,
        *,
        verify: bool = False,
        clip_scale: ClipScales | None = None,
        loss_scale: float = 1.0,
    ) -> torch.Tensor:
        """Add Σ_i c_i ∇L_i to every clipped parameter's ``.grad``; return the per-example norms ‖s ⊙ ∇L_i‖.

        ``example_mask`` (B,) zeroes c_i of padding examples. ``verify`` also runs autograd's own gradient of
        Σ_i L_i and raises if the unclipped engine sum disagrees, which catches a parameter used outside the
        forward of the module that owns it. ``loss_scale`` S: the losses given are S·L_i (fp16), see
        ``clip_and_accumulate``.
        """
        gradients = self.per_example_gradients(per_example_loss, verify=verify)
        return self.clip_and_accumulate(
            [(gradients, 1.0)], clip_norm, example_mask, clip_scale=clip_scale, loss_scale=loss_scale
        )

    def per_example_gradients(
        self, per_example_loss: torch.Tensor, verify: bool = False
    ) -> EvaluationGradients:
        """The per-example gradients of the forward recorded by the last ``record(B)``, in factored form.

        One ``autograd.grad`` of Σ_i L_i with respect to the recorded outputs; no ``.grad`` is touched. Call it
        while the parameters are still those of the forward (the rules read the recorded inputs only, but
        the torch.func fallback and ``verify`` use the current parameters).
        """
        calls, self._calls = self._calls, []
        count = self._batch_size if self._units is None else self._units.count
        if per_example_loss.dim() != 1 or per_example_loss.shape[0] != count:
            raise ValueError(
                f"the per-example loss must have shape ({count},), one per privacy unit, got "
                f"{tuple(per_example_loss.shape)}"
            )
        outputs = [o for call in calls for o in call.outputs if o.requires_grad]
        anchor = [] if self._anchor is None else [self._anchor]
        params = self.parameters if verify else []
        grads = torch.autograd.grad(per_example_loss.sum(), outputs + anchor + params, allow_unused=True)
        output_grads = iter(grads[: len(outputs)])
        reference = dict(zip((id(p) for p in params), grads[len(outputs) + len(anchor) :], strict=True))
        materialised, self._materialised, self._anchor = self._materialised, [], None
        with torch.no_grad():
            parts = self._per_example_parts(calls, output_grads)
            for module, found in materialised:
                for name in self._owned[module]:
                    param = getattr(module, name)
                    parts.setdefault(id(param), (param, []))[1].append(found[name])
            if verify:
                # mixed precision (bf16 autocast) rounds the two computations differently
                tolerance = max(
                    [1e-3] + [4 * torch.finfo(o.dtype).eps for o in outputs if o.is_floating_point()]
                )
                ones = per_example_loss.new_ones(per_example_loss.shape[0], dtype=torch.float32)
                self._verify(parts, reference, ones, tolerance)
        return EvaluationGradients(parts, per_example_loss.shape[0])

    def per_example_norms(
        self,
        evaluations: Sequence[tuple[EvaluationGradients, float]],
        *,
        clip_scale: ClipScales | None = None,
    ) -> torch.Tensor:
        """‖s ⊙ u_i‖ with u_i = Σ_e w_e g_i^e (s = 1 for a parameter without a scale), shape (B,); no ``.grad``."""
        return self._norms_and_terms(evaluations, clip_scale)[0]

    def clip_factors(self, norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
        """c_i at ``clip_norm`` with this engine's clipping function; c_i = 0 for an example whose gradient is not
        finite (an overflow in low precision): it then contributes nothing, within the sensitivity C. Counted in
        ``nonfinite_examples``."""
        if not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        finite = torch.isfinite(norms)
        self.nonfinite_examples += int((~finite).sum())
        return torch.where(finite, clip_factors(norms.nan_to_num(), clip_norm, self.clipping_fn), 0.0)

    def add_to_sum(self, param: nn.Parameter, part: PerExampleGradient, weights: torch.Tensor) -> None:
        """The clipped sum += Σ_i w_i G_i: in ``.grad``, or for a bf16/fp16 parameter in its float32 sum
        (``low_precision_sums``), which the mechanism noises in float32 before the one cast."""
        if param.dtype not in LOW_PRECISION:
            param.grad = part.accumulate(param.grad, weights, param)
            return
        wide = self.low_precision_sums.get(param)
        like = (
            wide if wide is not None else torch.empty(param.shape, dtype=torch.float32, device=param.device)
        )
        self.low_precision_sums[param] = part.accumulate(wide, weights, like)

    def take_sums(self) -> ClippedSums:
        """The logical batch's clipped sums for the release; the engine's float32 sums start empty again."""
        sums, self.low_precision_sums = ClippedSums(self.low_precision_sums), {}
        return sums

    def move_to_low_precision_sums(self) -> None:
        """After autograd wrote a micro-batch's clipped sum into a bf16/fp16 ``.grad``: add it to the float32 sum."""
        for param in self.parameters:
            if param.dtype in LOW_PRECISION and param.grad is not None:
                wide = self.low_precision_sums.get(param)
                grad = param.grad.float()
                self.low_precision_sums[param] = grad if wide is None else wide.add_(grad)
                param.grad = None

    def clip_and_accumulate(
        self,
        evaluations: Sequence[tuple[EvaluationGradients, float]],
        clip_norm: float,
        example_mask: torch.Tensor | None = None,
        *,
        clip_scale: ClipScales | None = None,
        loss_scale: float = 1.0,
    ) -> torch.Tensor:
        """Clip each example's weighted combination u_i = Σ_e w_e g_i^e once, in the geometry ‖s ⊙ u_i‖.

        c_i = clip factor of ‖s ⊙ u_i‖ at ``clip_norm``, times ``example_mask``; then ``.grad`` += Σ_e w_e Σ_i c_i g_i^e,
        the UN-scaled clipped sum (the mechanism scales the noise instead). Returns ‖s ⊙ u_i‖, shape (B,).
        Clipping the combination, not each evaluation, keeps the sensitivity at C (docs/clipping.md).
        ``loss_scale`` S (a power of two): the evaluations are of S·L_i (fp16 loss scaling), so the norms are
        ‖s ⊙ S u_i‖ / S and the factors applied to the S-scaled parts c_i / S, both exact.
        """
        norms, terms = self._norms_and_terms(evaluations, clip_scale)
        norms = norms / loss_scale
        with torch.no_grad():
            factors = self.clip_factors(norms, clip_norm)
            if example_mask is not None:
                factors = factors * example_mask.to(factors.dtype)
            factors = factors / loss_scale
            overflowed = ~torch.isfinite(norms)
            for param, weighted in terms.values():
                for weight, part in weighted:
                    if overflowed.any():  # 0 · inf would be nan: their rows go, not just their weights
                        part = part.without_examples(overflowed)
                    self.add_to_sum(param, part, factors if weight == 1 else weight * factors)
        return norms

    def _norms_and_terms(self, evaluations, clip_scale):
        sizes = {gradients.batch_size for gradients, _ in evaluations}
        if len(sizes) != 1:
            raise ValueError(f"evaluations of one micro-batch must share its batch size, got {sorted(sizes)}")
        terms: dict[int, tuple[nn.Parameter, list[Weighted]]] = {}
        for gradients, weight in evaluations:
            for pid, (param, parts) in gradients.parts.items():
                terms.setdefault(pid, (param, []))[1].extend((weight, part) for part in parts if weight != 0)
        with torch.no_grad():
            norms = self._norms(terms, sizes.pop(), _scales_by_id(clip_scale, self.parameters))
        return norms, terms

    def _per_example_parts(
        self, calls: list[_RecordedForward], output_grads: Iterator[torch.Tensor | None]
    ) -> dict[int, tuple[nn.Parameter, list[PerExampleGradient]]]:
        parts: dict[int, tuple[nn.Parameter, list[PerExampleGradient]]] = {}
        for call in calls:
            grads = [next(output_grads) if o.requires_grad else None for o in call.outputs]
            if all(g is None for g in grads):
                continue
            names, rule = self._owned[call.module], self._rules[call.module]
            if rule is not None:
                grad_out = grads[0] if grads[0] is not None else torch.zeros_like(call.outputs[0])
                found = self._apply_rule(call.module, call.args[0], grad_out)
            else:
                found = self._fallback(call, grads, names)
            for name in names:
                param = getattr(call.module, name)
                parts.setdefault(id(param), (param, []))[1].append(found[name])
        return parts

    def _fallback(
        self, call: _RecordedForward, grads: list, names: list[str]
    ) -> dict[str, PerExampleGradient]:
        if self._units is not None and not self._units.per_row:
            raise UnsupportedModuleError(
                f"{self._module_names.get(call.module, '?')} ({type(call.module).__name__}) has no per-example rule, and "
                "the torch.func fallback cannot split a packed row into its records: register a rule for it with "
                "hf_dp.clipping.rules.register_rule, or freeze it"
            )
        was_recording, self._recording = self._recording, False
        try:
            with torch.enable_grad():
                found = functorch_per_example_grads(
                    call.module, call.args, call.kwargs, grads, names, self._batch_size or 0
                )
        finally:
            self._recording = was_recording
        if self._units is None:
            return found
        return {name: Materialised(self._units.sum_rows(part.grads)) for name, part in found.items()}

    def _norms(
        self, terms: dict[int, tuple[nn.Parameter, list[Weighted]]], batch_size: int, scales: dict
    ) -> torch.Tensor:
        """‖s ⊙ u_i‖² = Σ_params ‖s ⊙ Σ_(uses, evaluations) w G_i‖², every cross term included."""
        dtype = torch.float64 if any(p.dtype == torch.float64 for p, _ in terms.values()) else torch.float32
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        total = torch.zeros(batch_size, dtype=dtype, device=device)
        for pid, (param, weighted) in terms.items():
            if weighted:
                # under DeepSpeed ZeRO-3 a parameter is partitioned to shape (0,); ds_shape is its real shape
                shape = getattr(param, "ds_shape", param.shape)
                squared = combined_squared_norm(weighted, scales.get(pid), shape, self.materialise)
                total += squared.to(total)
        return total.clamp(min=0).sqrt()

    def _verify(self, parts: dict, reference: dict, ones: torch.Tensor, tolerance: float) -> None:
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        largest = max((g.norm().item() for g in reference.values() if g is not None), default=0.0)
        for pid, (param, param_parts) in parts.items():
            ours = None
            for part in param_parts:
                ours = part.accumulate(
                    ours, ones, param.detach().to(torch.promote_types(param.dtype, torch.float32))
                )
            ref = reference.get(pid)
            ref = torch.zeros_like(param) if ref is None else ref
            error = (ours - ref.float()).norm().item()
            if error > tolerance * max(ref.norm().item(), 1e-3 * largest, 1e-12):
                raise UnsupportedModuleError(
                    f"parameter {names.get(pid, '?')} gets gradient from outside the forward of the module that owns "
                    f"it (engine {ours.norm().item():.4g} vs autograd {ref.norm().item():.4g}), so its per-example "
                    "norm would be wrong: freeze it or call it through its module"
                )
        missing = [
            names.get(pid, "?")
            for pid, g in reference.items()
            if pid not in parts and g is not None and g.any()
        ]
        if missing:
            raise UnsupportedModuleError(
                f"parameter {missing[0]} has a gradient but its module's forward was never recorded: freeze it or "
                "call it through its module"
            )
