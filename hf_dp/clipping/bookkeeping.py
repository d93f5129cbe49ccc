"""Exact per-example gradients with one backward pass (book-keeping, Bu et al. 2023).

The forward hooks record each parameter-owning module's input; one ``autograd.grad`` of Σ_i L_i with respect
to the recorded outputs gives every output gradient without computing any weight gradient. From (input, output
gradient) each layer rule gives per-example gradients in factored form (per_example.py), and their norms are
summed per Parameter object: ‖s ⊙ u_i‖² = Σ_p ‖s ⊙ Σ_(uses, evaluations) w G_i‖², so tied weights get the norm
of the sum, cross terms included. Where B explicit per-example gradients are smaller than the output gradient
book-keeping would keep (long sequences: T > d_in, e.g. the LM head), the layer's are formed inside that
backward instead, as soon as its output gradient exists, and its input and output gradient are let go.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hf_dp.clipping.checks import check_engine_sum
from hf_dp.clipping.geometry import ClipScale
from hf_dp.clipping.hooks import (
    Layers,
    UnsupportedModuleError,
    check_batch_dimension,
    in_reentrant_checkpoint,
    is_checkpointing,
    tap,
    tensor_outputs,
)
from hf_dp.clipping.per_example import Materialised, PerExampleGradient, combined_squared_norm
from hf_dp.clipping.rules import functorch_per_example_grads
from hf_dp.clipping.sums import Terms
from hf_dp.clipping.units import PrivacyUnits, regroup_for_rule

# Book-keeping materialises a layer's B per-example gradients inside the backward when they take fewer floats
# than this share of the output gradient it would otherwise keep until the backward ends.
MATERIALISE_BELOW_OUTPUT_SHARE = 1.0

Parts = dict[int, tuple[nn.Parameter, list[PerExampleGradient]]]


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

    parts: Parts
    batch_size: int


class Recording:
    """One micro-batch's book-keeping forward (a ``Receiver``, hooks.py): each recorded call's input and outputs,
    and the per-example gradients of the layers formed inside the backward."""

    def __init__(self, layers: Layers, materialise: bool, rows: int, units: PrivacyUnits | None) -> None:
        self.layers, self.materialise = layers, materialise
        self.rows = rows
        self.units = None if units is None or units.is_trivial else units  # None: each row is its own unit
        self.on = True
        self.saw_checkpointing = False  # a recorded forward ran under torch.utils.checkpoint
        self._calls: list[_RecordedForward] = []
        self._anchor: torch.Tensor | None = None
        self._materialised: list[tuple[nn.Module, dict[str, PerExampleGradient]]] = []

    def admits(self, module: nn.Module) -> bool:
        """Book-keeping would keep the inputs a checkpoint drops (non-reentrant) or never sees them (reentrant, run
        under no_grad): stop recording, and the pipeline re-selects the norms inside the backward."""
        if self.on and ((not torch.is_grad_enabled() and in_reentrant_checkpoint()) or is_checkpointing()):
            self.saw_checkpointing, self.on, self._calls = True, False, []
        return self.on

    def receive(self, module: nn.Module, x: torch.Tensor | None, args: tuple, kwargs: dict, output) -> object:
        outputs = tensor_outputs(output)
        if not any(o.requires_grad for o in outputs):
            return None
        check_batch_dimension(self.layers, module, x, self.rows)
        if self._materialises_in_backward(module, x, output):
            if self._anchor is None:
                self._anchor = torch.zeros((), device=output.device, requires_grad=True)
            return tap(output, self._anchor, self._materialise, module, x)
        self._calls.append(_RecordedForward(module, tuple(args), dict(kwargs), outputs))
        return None

    def _materialises_in_backward(self, module: nn.Module, x: torch.Tensor | None, output) -> bool:
        """B explicit per-example gradients of the module take fewer floats than its output gradient (a
        linear layer: T > d_in), which book-keeping would keep to the end of the backward."""
        if self.layers.rules[module] is None or x is None or not isinstance(output, torch.Tensor):
            return False
        params = self.layers.of(module)
        if any(
            hasattr(p, "ds_shape") for p in params
        ):  # ZeRO-3 partitions (shaped by ds_shape): kept factored
            return False
        floats = self.rows * sum(p.numel() for p in params)
        return floats < MATERIALISE_BELOW_OUTPUT_SHARE * output.numel()

    def _materialise(self, module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """In the backward: the module's explicit per-example gradients (B, *param.shape) from (x, ∂L/∂y), for its
        trained parameters only (not a frozen weight beside a trained bias: BiTFiT)."""
        with torch.no_grad():
            found = self._apply_rule(module, x, grad_output)
            explicit = {
                name: found[name].explicit(getattr(module, name).shape) for name in self.layers.owned[module]
            }
        self._materialised.append((module, explicit))

    def _apply_rule(
        self, module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor
    ) -> dict[str, PerExampleGradient]:
        """The module's layer rule on (x, ∂L/∂y), per privacy unit."""
        x, grad_output = regroup_for_rule(self.units, x, grad_output, self.layers.where(module))
        return self.layers.rules[module](module, x, grad_output)

    def gradients(self, per_example_loss: torch.Tensor, verify: bool = False) -> EvaluationGradients:
        """The per-example gradients of the recorded forward, in factored form: one ``autograd.grad`` of Σ_i L_i
        with respect to the recorded outputs; no ``.grad`` is touched. ``verify``: also autograd's gradient of
        Σ_i L_i, against which the unclipped sum is checked (checks.py)."""
        calls, self._calls = self._calls, []
        count = self.rows if self.units is None else self.units.count
        if per_example_loss.dim() != 1 or per_example_loss.shape[0] != count:
            raise ValueError(
                f"the per-example loss must have shape ({count},), one per privacy unit, got "
                f"{tuple(per_example_loss.shape)}"
            )
        outputs = [o for call in calls for o in call.outputs if o.requires_grad]
        anchor = [] if self._anchor is None else [self._anchor]
        params = self.layers.parameters if verify else []
        grads = torch.autograd.grad(per_example_loss.sum(), outputs + anchor + params, allow_unused=True)
        output_grads = iter(grads[: len(outputs)])
        reference = dict(zip((id(p) for p in params), grads[len(outputs) + len(anchor) :], strict=True))
        materialised, self._materialised, self._anchor = self._materialised, [], None
        with torch.no_grad():
            parts = self._per_example_parts(calls, output_grads)
            for module, found in materialised:
                for name in self.layers.owned[module]:
                    param = getattr(module, name)
                    parts.setdefault(id(param), (param, []))[1].append(found[name])
            if verify:
                ones = per_example_loss.new_ones(per_example_loss.shape[0], dtype=torch.float32)
                dtypes = [o.dtype for o in outputs if o.is_floating_point()]
                check_engine_sum(parts, reference, self.layers.parameter_names(), ones, dtypes)
        return EvaluationGradients(parts, per_example_loss.shape[0])

    def _per_example_parts(
        self, calls: list[_RecordedForward], output_grads: Iterator[torch.Tensor | None]
    ) -> Parts:
        parts: Parts = {}
        for call in calls:
            grads = [next(output_grads) if o.requires_grad else None for o in call.outputs]
            if all(g is None for g in grads):
                continue
            names, rule = self.layers.owned[call.module], self.layers.rules[call.module]
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
        if self.units is not None and not self.units.per_row:
            raise UnsupportedModuleError(
                f"{self.layers.where(call.module)} has no per-example rule, and the torch.func fallback cannot split "
                "a packed row into its records: register a rule for it with hf_dp.clipping.rules.register_rule, or "
                "freeze it"
            )
        was_on, self.on = self.on, False
        try:
            with torch.enable_grad():
                found = functorch_per_example_grads(
                    call.module, call.args, call.kwargs, grads, names, self.rows
                )
        finally:
            self.on = was_on
        if self.units is None:
            return found
        return {name: Materialised(self.units.sum_rows(part.grads)) for name, part in found.items()}


def combined_terms(evaluations: Sequence[tuple[EvaluationGradients, float]]) -> tuple[Terms, int]:
    """Every evaluation's parts per parameter, weighted (w_e, G_i^e); and the micro-batch's unit count."""
    sizes = {gradients.batch_size for gradients, _ in evaluations}
    if len(sizes) != 1:
        raise ValueError(f"evaluations of one micro-batch must share its batch size, got {sorted(sizes)}")
    terms: Terms = {}
    for gradients, weight in evaluations:
        for pid, (param, parts) in gradients.parts.items():
            terms.setdefault(pid, (param, []))[1].extend((weight, part) for part in parts if weight != 0)
    return terms, sizes.pop()


def norms_of(
    terms: Terms, count: int, scales: dict[int, ClipScale], materialise: bool, device: torch.device
) -> torch.Tensor:
    """‖s ⊙ u_i‖ with ‖s ⊙ u_i‖² = Σ_params ‖s ⊙ Σ_(uses, evaluations) w G_i‖², every cross term included, each
    parameter's added into one (U,) buffer."""
    dtype = torch.float64 if any(p.dtype == torch.float64 for p, _ in terms.values()) else torch.float32
    total = None  # the first parameter's squared norms start the buffer (no zeros)
    for pid, (param, weighted) in terms.items():
        if weighted:
            # under DeepSpeed ZeRO-3 a parameter is partitioned to shape (0,); ds_shape is its real shape
            shape = getattr(param, "ds_shape", param.shape)
            total = combined_squared_norm(weighted, scales.get(pid), shape, materialise, into=total).to(dtype)
    if total is None:
        total = torch.zeros(count, dtype=dtype, device=device)
    return total.clamp(min=0).sqrt()
