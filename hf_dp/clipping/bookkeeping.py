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

import functools
import logging
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hf_dp.clipping.checks import check_engine_sum, engine_sum_weights
from hf_dp.clipping.fallback import ModuleCall
from hf_dp.clipping.geometry import ClipScale
from hf_dp.clipping.hooks import (
    Layers,
    batch_rows,
    check_batch_dimension,
    check_shared_use,
    in_reentrant_checkpoint,
    is_checkpointing,
    tap,
    tensor_outputs,
)
from hf_dp.clipping.per_example import PerExampleGradient, combined_squared_norm
from hf_dp.clipping.row_maps import ExampleRows
from hf_dp.clipping.rows import RowTracking
from hf_dp.clipping.rules import call_rule_for, per_call_grads
from hf_dp.clipping.shared import SharedUse, anchored
from hf_dp.clipping.sums import Terms
from hf_dp.clipping.units import PrivacyUnits, regroup_for_rule

logger = logging.getLogger(__name__)
_LOGGED_FALLBACKS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules whose fallback was logged

# Book-keeping materialises a layer's B per-example gradients inside the backward when they take fewer floats
# than this share of the output gradient it would otherwise keep until the backward ends.
MATERIALISE_BELOW_OUTPUT_SHARE = 1.0

Parts = dict[int, tuple[nn.Parameter, list[PerExampleGradient]]]


@dataclass
class _RecordedForward:
    module: nn.Module
    x: torch.Tensor | None  # what its rule reads (rules.rule_input)
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]
    rows: ExampleRows | None  # flattened tokens: each row's example (rows.py); None: the batch's own rows
    joined: tuple[str, ...] = ()  # submodules' parameters its forward reads, covered by its fallback


@dataclass
class EvaluationGradients:
    """The per-example gradients of one evaluation (one forward and its backward), per Parameter object:
    ``parts[id(p)] = (p, [one factored part per use of p])``."""

    parts: Parts
    batch_size: int


class Recording:
    """One micro-batch's book-keeping forward (a ``Receiver``, hooks.py): each recorded call's input and outputs,
    and the per-example gradients of the layers formed inside the backward."""

    def __init__(
        self,
        layers: Layers,
        materialise: bool,
        rows: int,
        units: PrivacyUnits | None,
        tracking: RowTracking,
        low_precision_base: bool = False,
    ) -> None:
        self.layers, self.materialise, self.tracking = layers, materialise, tracking
        self.low_precision_base = low_precision_base  # the frozen base rounds the gradients in bf16/fp16
        self.rows = rows
        self.units = None if units is None or units.is_trivial else units  # None: each row is its own unit
        self.on = True
        self.saw_checkpointing = False  # a recorded forward ran under torch.utils.checkpoint
        self._calls: list[_RecordedForward] = []
        self._anchor: torch.Tensor | None = None
        self._materialised: list[tuple[nn.Module, dict[str, PerExampleGradient]]] = []
        self._shared: list[SharedUse] = []  # layers applied to an input shared by all examples
        # per fallback module, the submodules' parameters it reads
        self._joined: dict[nn.Module, set[str]] = {}

    def admits(self, module: nn.Module) -> bool:
        """Book-keeping would keep the inputs a checkpoint drops (non-reentrant) or never sees them (reentrant, run
        under no_grad): stop recording, and the pipeline re-selects the norms inside the backward."""
        if self.on and ((not torch.is_grad_enabled() and in_reentrant_checkpoint()) or is_checkpointing()):
            self.saw_checkpointing, self.on, self._calls = True, False, []
        return self.on

    def receive(self, module: nn.Module, x: torch.Tensor | None, args: tuple, kwargs: dict, output) -> object:
        outputs = tensor_outputs(output)
        if self.tracking.takes_shared(x, self.rows):
            return self._shared_use(module, x, output)
        if not any(o.requires_grad for o in outputs):
            return None
        rows = batch_rows(self.layers, module, x, self.rows, self.tracking)
        if self._materialises_in_backward(module, x, output, rows):
            if self._anchor is None:
                self._anchor = torch.zeros((), device=output.device, requires_grad=True)
            tapped = tap(output, self._anchor, functools.partial(self._materialise, rows=rows), module, x)
            return self.tracking.carried(output, tapped)
        if self.layers.rules[module] is None and isinstance(output, tuple) and len(outputs) > 1:
            # each output's own gradient, not through the others it feeds (an MoE router's scores are a function of
            # its logits): the gradient towards a fresh alias of each
            output = tuple(
                self.tracking.carried(o, o.view_as(o)) if isinstance(o, torch.Tensor) else o for o in output
            )
            outputs = tensor_outputs(output)
        joined = tuple(self._joined.pop(module, ()))
        self._calls.append(_RecordedForward(module, x, tuple(args), dict(kwargs), outputs, rows, joined))
        return output if self.layers.rules[module] is None and isinstance(output, tuple) else None

    def _shared_use(self, module: nn.Module, x: torch.Tensor, output) -> torch.Tensor:
        """A layer applied to an input without a batch dimension (shared.py): its output, made differentiable, is
        followed to where it meets the batch."""
        check_shared_use(self.layers, module, output, self.units)
        if self._anchor is None:
            self._anchor = torch.zeros((), device=output.device, requires_grad=True)
        reached = [False]
        shared = anchored(output, self._anchor, reached)
        use = SharedUse(module, x, shared, self.rows, reached=reached)
        self.tracking.share(shared, use, x)
        self._shared.append(use)
        return shared

    def loose_use(self, module: nn.Module, name: str, param: nn.Parameter) -> torch.Tensor:
        check_shared_use(self.layers, module, param, self.units)
        if self._anchor is None:
            self._anchor = torch.zeros((), device=param.device, requires_grad=True)
        alias = anchored(param, self._anchor)
        use = SharedUse(module, None, alias, self.rows, parameter=name)
        self.tracking.share(alias, use)
        self._shared.append(use)
        return alias

    def joins(self, module: nn.Module, name: str) -> None:
        self._joined.setdefault(module, set()).add(name)

    def _materialises_in_backward(
        self, module: nn.Module, x: torch.Tensor | None, output, rows: ExampleRows | None = None
    ) -> bool:
        """B explicit per-example gradients of the module take fewer floats than its output gradient (a
        linear layer: T > d_in), which book-keeping would keep to the end of the backward. Always on a time-major
        input (rows.py): Longformer scales its query projections' outputs in place (``query_vectors /= √d``), and
        the gradient towards a recorded output would be the one towards the scaled tensor, where the tap's fresh
        output (hooks.tap) keeps the scaling out of ∂L/∂y."""
        if self.layers.rules[module] is None or x is None or not isinstance(output, torch.Tensor):
            return False
        if rows is not None and rows.time_major:
            return True
        params = self.layers.of(module)
        if any(
            hasattr(p, "ds_shape") for p in params
        ):  # ZeRO-3 partitions (shaped by ds_shape): kept factored
            return False
        floats = self.rows * sum(p.numel() for p in params)
        return floats < MATERIALISE_BELOW_OUTPUT_SHARE * output.numel()

    def _materialise(
        self, module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor, rows: ExampleRows | None
    ) -> None:
        """In the backward: the module's explicit per-example gradients (B, *param.shape) from (x, ∂L/∂y), for its
        trained parameters only (not a frozen weight beside a trained bias: BiTFiT)."""
        with torch.no_grad():
            found = self._apply_rule(module, x, grad_output, rows)
            explicit = {
                name: found[name].explicit(getattr(module, name).shape) for name in self.layers.owned[module]
            }
        self._materialised.append((module, explicit))

    def _apply_rule(
        self, module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor, rows: ExampleRows | None
    ) -> dict[str, PerExampleGradient]:
        """The module's layer rule on (x, ∂L/∂y), per example (flattened rows laid out by example) and per privacy
        unit."""
        x, grad_output = regroup_for_rule(self.units, x, grad_output, self.layers.where(module), rows)
        return self.layers.rules[module](module, x, grad_output)

    def gradients(self, per_example_loss: torch.Tensor, verify: bool = False) -> EvaluationGradients:
        """The per-example gradients of the recorded forward, in factored form: one ``autograd.grad`` of Σ_i L_i
        with respect to the recorded outputs; no ``.grad`` is touched. ``verify``: also autograd's gradient of
        Σ_i w_i L_i, against which the engine's Σ_i w_i G_i is checked (checks.check_engine_sum)."""
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
        grads = (
            torch.autograd.grad(
                per_example_loss.sum(), outputs + anchor, retain_graph=bool(params), allow_unused=True
            )
            if outputs + anchor
            else ()
        )
        materialised, self._materialised, self._anchor = self._materialised, [], None
        # before a verifying backward adds to them
        shared = [
            (use, use.per_example(functools.partial(self._apply_rule, rows=None))) for use in self._shared
        ]
        self._shared = []
        weights = engine_sum_weights(count, per_example_loss.device) if params else None
        reference = self._weighted_gradient(per_example_loss, weights, params) if params else {}
        with torch.no_grad():
            parts = self._per_example_parts(calls, iter(grads[: len(outputs)]))
            for use, found in shared:
                if found is not None:
                    for name, part in found.items():
                        param = getattr(use.module, name)
                        parts.setdefault(id(param), (param, []))[1].append(part)
                elif use.x is not None and use.reached[0]:
                    # a gradient reached its output, but not along a path where it met the batch
                    check_batch_dimension(self.layers, use.module, use.x, self.rows)
            for module, found in materialised:
                for name in self.layers.owned[module]:
                    param = getattr(module, name)
                    parts.setdefault(id(param), (param, []))[1].append(found[name])
            if weights is not None:
                dtypes = [o.dtype for o in outputs if o.is_floating_point()]
                dtypes += [torch.bfloat16] if self.low_precision_base else []
                check_engine_sum(parts, reference, self.layers.parameter_names(), weights.float(), dtypes)
        return EvaluationGradients(parts, per_example_loss.shape[0])

    def _weighted_gradient(
        self, per_example_loss: torch.Tensor, weights: torch.Tensor, params: list[nn.Parameter]
    ) -> dict[int, torch.Tensor | None]:
        """Autograd's Σ_i w_i ∇L_i per parameter id (the taps fire again; what they form is let go)."""
        weighted = (per_example_loss * weights.to(per_example_loss)).sum()
        found = torch.autograd.grad(weighted, params, allow_unused=True)
        self._materialised = []
        return dict(zip((id(p) for p in params), found, strict=True))

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
                found = self._apply_rule(call.module, call.x, grad_out, call.rows)
            else:
                names = [*names, *call.joined]
                found = self._fallback(call, grads, names)
            for name in names:
                param = call.module.get_parameter(name)
                parts.setdefault(id(param), (param, []))[1].append(found[name])
        return parts

    def _fallback(
        self, call: _RecordedForward, grads: list, names: list[str]
    ) -> dict[str, PerExampleGradient]:
        count, rows = self.rows, call.rows
        if self.units is not None:  # each row's unit: the call's per-unit gradients
            count, rows = self.units.count, self.units.rows_of_call(call.rows, self.layers.where(call.module))
        if call.module not in _LOGGED_FALLBACKS and call_rule_for(call.module) is None:
            _LOGGED_FALLBACKS.add(call.module)
            vmapped = self.rows if rows is None else rows.count
            floats = vmapped * sum(call.module.get_parameter(name).numel() for name in names)
            logger.info(
                f"hf_dp: {self.layers.where(call.module)} has no per-example rule: its per-example gradients "
                f"({', '.join(names)}) come from the torch.func fallback, vmapped over {vmapped} "
                f"{'rows' if rows is not None else 'examples'} ({floats:,} floats a micro-batch)"
            )
        was_on, self.on = self.on, False
        try:
            with torch.enable_grad():
                return per_call_grads(
                    ModuleCall(call.module, call.args, call.kwargs, grads, count, rows), names
                )
        finally:
            self.on = was_on


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
