"""First-step checks that the clipped step is exact for this model, each raising one actionable line.

Each compares two computations of the same quantity within a relative tolerance, all in ``TOLERANCES``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.hooks import UnsupportedModuleError
from hf_dp.clipping.per_example import LossFn
from hf_dp.clipping.rng_replay import replay_rng, rng_state
from hf_dp.clipping.tail import Tail, forward_from_leaf
from hf_dp.clipping.units import PrivacyUnits

if TYPE_CHECKING:
    from hf_dp.clipping.per_example import PerExampleGradient
    from hf_dp.clipping.taps import NormCollector


@dataclass(frozen=True)
class Tolerance:
    """A relative error allowed between two computations: ``float32`` when all ran in float32 or wider,
    ``low_precision`` when one ran in bf16/fp16 (said, or a bf16/fp16 dtype among those involved), ``float64`` (where set) when every dtype involved is float64,
    and at least ``eps_multiple`` machine epsilons of the dtypes involved."""

    float32: float
    low_precision: float
    eps_multiple: float = 0.0
    float64: float | None = None

    def at(self, low_precision: bool, dtypes: Sequence[torch.dtype] = ()) -> float:
        low_precision = low_precision or any(d in (torch.bfloat16, torch.float16) for d in dtypes)
        chosen = self.low_precision if low_precision else self.float32
        if self.float64 is not None and dtypes and all(d == torch.float64 for d in dtypes):
            chosen = self.float64
        return max([chosen] + [self.eps_multiple * torch.finfo(d).eps for d in dtypes])


@dataclass(frozen=True)
class Tolerances:
    """Every first-step check's tolerance, in one place."""

    # ⟨Σ_i c_i g_i, V_p⟩ from autograd vs Σ_i c_i ⟨G_i, V_p⟩ from the taps; the two passes round bf16 differently:
    # measured up to 1.5% of a parameter's gradient (Llama 8×512, T 512)
    projections: Tolerance = Tolerance(float32=1e-3, low_precision=5e-2)
    # the weighted pass without the tail vs the whole weighted pass (same rounding as the projections; in float64,
    # the float32 inside some layers: Mamba's mixer, up to 5e-7)
    tail: Tolerance = Tolerance(float32=1e-3, low_precision=5e-2, float64=1e-6)
    # book-keeping's unclipped sum vs autograd's gradient; mixed precision (bf16 autocast) rounds them differently
    engine_sum: Tolerance = Tolerance(float32=1e-3, low_precision=1e-3, eps_multiple=4)
    # relative change of a record's loss that counts as "moved" when another record's embeddings are perturbed
    records_apart: Tolerance = Tolerance(float32=1e-5, low_precision=1e-5)
    # an example's loss and gradient norm in its batch vs alone: the same arithmetic on other shapes (GEMM
    # blocking, padded softmax); what the batch may not change (positions shifted by padding: percents)
    examples_alone: Tolerance = Tolerance(float32=1e-5, low_precision=2e-2, float64=1e-10)


TOLERANCES = Tolerances()


def check_records_apart(
    embeddings: nn.Module, module: nn.Module, losses_of: LossFn, units: PrivacyUnits
) -> None:
    """Per-record clipping of a packed row is exact only if no record's loss reads another record (attention
    kept within records). Checked once, forward only: each record's loss must not move when the input
    embeddings of the records of the other parity are perturbed (same dropout masks; RNG left as it was)."""
    parity = units.unit_of_token % 2
    state = rng_state()
    generator = torch.Generator(device=units.unit_of_token.device).manual_seed(0)

    def losses_with(perturbed: int | None) -> torch.Tensor:
        def perturb(_module, _args, output):
            where = (units.unit_of_token >= 0) & (parity == perturbed)
            noise = torch.randn(output.shape, generator=generator, dtype=output.dtype, device=output.device)
            return output + noise * where[..., None].to(output.dtype)

        handle = None if perturbed is None else embeddings.register_forward_hook(perturb)
        replay_rng(state)
        try:
            with torch.no_grad():
                return losses_of(module).double()
        finally:
            if handle is not None:
                handle.remove()

    plain = losses_with(None)
    tolerance = TOLERANCES.records_apart.at(low_precision=False)
    record_parity = torch.arange(units.count, device=plain.device) % 2
    for perturbed in (0, 1):
        moved = (losses_with(perturbed) - plain).abs() > tolerance * (1 + plain.abs())
        crossing = moved & (record_parity != perturbed)
        if crossing.any():
            raise ValueError(
                f"packed record {int(crossing.nonzero()[0])} of a row reads the tokens of other records (attention "
                "crosses records), so clipping per record would not bound its influence: pass position_ids and "
                "no attention_mask with an attention that keeps packed sequences apart (sdpa, eager, flash), and "
                "use_cache=False"
            )
    replay_rng(state)


@dataclass(frozen=True)
class ExamplesAlone:
    """A few rows of the first micro-batch, each with the loss function of its example alone, and what most
    likely makes them differ, read off the batch."""

    rows: list[int]
    losses: list[LossFn]
    cause: str

    @staticmethod
    def of(
        alone: Sequence[tuple[int, dict]], inputs: dict, loss_of: Callable[[dict], LossFn]
    ) -> ExamplesAlone:
        """From the loader's ``(row, example alone)`` pairs (data.ALONE_KEY) and the micro-batch's inputs."""
        return ExamplesAlone(
            [row for row, _ in alone], [loss_of(e) for _, e in alone], batch_dependence_cause(inputs)
        )


def batch_dependence_cause(inputs: dict) -> str:
    """The likely reason an example's loss depends on its batch, from the micro-batch's own tensors."""
    mask, ids = inputs.get("attention_mask"), inputs.get("input_ids")
    if (
        mask is None and isinstance(ids, torch.Tensor) and ids.dim() in (2, 3)
    ):  # rows, or multiple-choice rows
        return (
            "the batch has no attention_mask, so every example attends to the padding its batch adds: pass the "
            "collator's attention_mask (tokenizer(..., return_attention_mask=True), DataCollatorWithPadding)"
        )
    if (
        isinstance(mask, torch.Tensor)
        and mask.dim() in (2, 3)
        and "position_ids" not in inputs
        and bool((mask[..., 0] == 0).any())
    ):
        return (
            "rows are padded on the left and no position_ids are passed, so the model counts an example's "
            "positions from its batch's padded start: pad on the right (tokenizer.padding_side='right') or pass "
            "position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)"
        )
    return (
        "something in the model or the loss mixes the examples of a batch (batch statistics such as BatchNorm, "
        "a loss normalised over the batch, positions or padding the batch sets): make each example's loss its "
        "own, as if it were alone"
    )


def check_examples_alone(
    losses_of: LossFn,
    alone: ExamplesAlone,
    backend: Backend,
    module: nn.Module,
    base: nn.Module,
    low_precision: bool,
) -> None:
    """Per-example clipping bounds a step's sensitivity by C only if example i's gradient g_i is a function of
    example i alone: adding an example to D must change no other example's term. Checked once, on the first
    micro-batch: each sampled example's loss in the batch, and where the model is whole and its activations fit
    (``base``, not sharded, no activation checkpointing, which eval mode turns off) its gradient norm ‖∇_θ L_i‖,
    equal those of the example alone, in eval mode (dropout's masks differ with the batch's shape). A sharded
    model (``module``: the framework's) compares the losses. Every process raises if one differs. RNG and
    train/eval modes are left as they were."""
    sharded = backend.framework_owns_gradients or backend.fsdp
    if not sharded:
        module = base
    norms = not (sharded or backend.checkpointing)
    params = [p for p in base.parameters() if p.requires_grad] if norms else []
    state, modes = rng_state(), {m: m.training for m in module.modules()}
    module.eval()
    try:
        with torch.set_grad_enabled(bool(params)):
            in_batch = losses_of(module)
            found = [_loss_and_norm(in_batch[row], params, retain=True) for row in alone.rows]
            reference = [_loss_and_norm(losses(module)[0], params, retain=False) for losses in alone.losses]
    finally:
        for m, training in modes.items():
            m.training = training
        replay_rng(state)
    # bf16/fp16 weights run the forward as autocast does (quantized bases hold integer weights: not dtypes of it)
    weights = {p.dtype for p in base.parameters() if p.is_floating_point()}
    tolerance = TOLERANCES.examples_alone.at(low_precision, [in_batch.dtype, *weights])
    differ = [
        (row, ours, theirs)
        for row, ours_pair, theirs_pair in zip(alone.rows, found, reference, strict=True)
        for ours, theirs in zip(ours_pair, theirs_pair, strict=True)
        if abs(ours - theirs) > tolerance * (1 + abs(theirs))
    ]
    failed = torch.tensor(float(bool(differ)), device=in_batch.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if differ:
        row, ours, theirs = differ[0]
        raise ValueError(
            f"example {row} of the first batch gives {ours:.6g} in its batch but {theirs:.6g} alone (its loss or "
            f"gradient norm), so one example's gradient depends on the rest of the batch and clipping does not "
            f"bound its influence: {alone.cause}"
        )
    if failed:
        raise ValueError(
            "on another process an example's loss in its batch differs from its loss alone; that process "
            "names the cause"
        )


def _loss_and_norm(loss: torch.Tensor, params: Sequence[nn.Parameter], retain: bool) -> tuple[float, ...]:
    """(L, ‖∇_θ L‖ over ``params``), or (L,) without params, in float64."""
    if not params:
        return (float(loss.detach().double()),)
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
    return float(loss.detach().double()), float(norm)


def check_projections(
    params: Sequence[nn.Parameter],
    name_of: Callable[[nn.Parameter], str],
    collector: NormCollector,
    weights: torch.Tensor,
    gradients: dict[int, torch.Tensor | None] | None = None,
) -> None:
    """⟨Σ_i c_i g_i, V_p⟩ from autograd (the first micro-batch's ``.grad``, None or 0 before it: GradientGuard) must
    equal Σ_i c_i ⟨G_i, V_p⟩ from the norm pass for every parameter p: otherwise some use of p escaped the taps and
    its norm would be too small. The error is measured against ‖Σ_i c_i g_i‖ too (the typical size of a projection
    on V_p ~ N(0, I), which may land near 0 by chance), and against 1e-3 of the largest parameter's gradient (a
    gradient that is 0 in exact arithmetic, a softmax's shift, carries rounding of the others' size; a
    misattributed gradient that small moves no norm). ``gradients``: autograd's, per parameter id, where not in
    ``.grad``."""
    tolerance = TOLERANCES.projections.at(collector.low_precision)
    grads = {id(p): p.grad if gradients is None else gradients.get(id(p)) for p in params}
    floor = max([1e-6] + [1e-3 * float(g.double().norm()) for g in grads.values() if g is not None])
    for param in params:
        projection = collector.projections.get(id(param))
        ours = 0.0 if projection is None else float((weights.double() * projection.double()).sum())
        scale = 0.0 if projection is None else float((weights.double() * projection.double()).abs().sum())
        grad = grads[id(param)]
        theirs = 0.0 if grad is None else float((grad.double() * collector.direction(param).double()).sum())
        gradient = 0.0 if grad is None else float(grad.double().norm())
        if abs(ours - theirs) > tolerance * max(scale, abs(theirs), gradient, floor):
            raise UnsupportedModuleError(
                f"parameter {name_of(param)} gets gradient from outside the forward of the module that owns it, "
                f"or credited to the wrong examples (norm pass {ours:.4g} vs autograd {theirs:.4g} along a probe), "
                "so its per-example norm would be wrong: freeze it or call it through its module"
            )


def sums_match(
    params: Sequence[nn.Parameter],
    ours: dict[int, torch.Tensor | None],
    whole: dict[int, torch.Tensor | None],
    low_precision: bool,
) -> bool:
    """``ours`` equals ``whole`` (both per parameter id; None is 0) for every parameter, relative to its norm."""
    tolerance = TOLERANCES.tail.at(
        low_precision, [g.dtype for g in (*ours.values(), *whole.values()) if g is not None]
    )
    largest = max((float(g.float().norm()) for g in whole.values() if g is not None), default=0.0)
    for param in params:
        theirs = whole.get(id(param))
        theirs = torch.zeros_like(param, dtype=torch.float32) if theirs is None else theirs.float()
        mine = ours.get(id(param))
        mine = torch.zeros_like(theirs) if mine is None else mine.float()
        if float((mine - theirs).norm()) > tolerance * max(float(theirs.norm()), 1e-3 * largest, 1e-12):
            return False
    return True


def tensors_match(ours: torch.Tensor, theirs: torch.Tensor, low_precision: bool) -> bool:
    """``ours`` equals ``theirs`` relative to its norm, within the tail's check tolerance; tensors of different
    shapes do not (a chain that runs from a decoder's layers into an encoder's, seq2seq)."""
    if ours.shape != theirs.shape:
        return False
    tolerance = TOLERANCES.tail.at(low_precision, [ours.dtype, theirs.dtype])
    return float((ours.float() - theirs.float()).norm()) <= tolerance * max(
        float(theirs.float().norm()), 1e-12
    )


def tail_separable(
    tail: Tail,
    module: nn.Module,
    losses_of: LossFn,
    factors: torch.Tensor,
    units: PrivacyUnits | None,
    params: Callable[[], Sequence[nn.Parameter]],
    low_precision: bool,
) -> bool:
    """Whether the body's backward from h plus the tail's Σ_i c_i G_i is the whole weighted pass (tail.py), checked
    without writing ``.grad`` (a framework's backward cannot run twice): with h cut to a leaf, Σ_i c_i L_i must
    reach no parameter but the tail's, which get Σ_i c_i G_i, and its gradient at h must be spread(c) ⊙
    ∂(Σ_j L_j)/∂h. Same dropout masks as the norm pass (the caller replays its random state). ``params``: the
    clipped parameters as the modules hold them after the forward; with them, the tail's parameters as its uses
    held them (FSDP2: the unsharded ones, which its backward gathers again where they were freed)."""
    losses, hidden = forward_from_leaf(tail.boundary, lambda: losses_of(module))
    tail_sums = tail.clipped_sums(factors)
    trainable = list({id(p): p for p in [*params(), *tail_sums] if p.requires_grad}.values())
    weighted = (factors.detach().to(losses.dtype) * losses).sum()
    try:
        found = torch.autograd.grad(weighted, [hidden, *trainable], allow_unused=True)
    except RuntimeError:  # it reached a reentrant checkpoint: the loss reads the body other than through h
        return False
    at_hidden = tail.hidden_gradient(factors, units)
    hidden_gradient = found[0] if found[0] is not None else torch.zeros_like(at_hidden)
    if not tensors_match(hidden_gradient, at_hidden, low_precision):
        return False
    autograd_sums = dict(zip([id(p) for p in trainable], found[1:], strict=True))
    ours = {id(p): total for p, total in tail_sums.items()}
    # every tail parameter and every one autograd reached (the others are 0 on both sides)
    compared = [p for p in trainable if id(p) in ours or autograd_sums[id(p)] is not None]
    return sums_match(compared, ours, autograd_sums, low_precision)


def check_engine_sum(
    parts: dict[int, tuple[nn.Parameter, list[PerExampleGradient]]],
    reference: dict[int, torch.Tensor | None],
    names: dict[int, str],
    weights: torch.Tensor,
    dtypes: Sequence[torch.dtype],
) -> None:
    """Book-keeping's Σ_i w_i G_i (``weights``: one per unit, ``engine_sum_weights``) must equal autograd's gradient
    of Σ_i w_i L_i for every parameter, which catches a parameter used outside the forward of the module that owns
    it, a rule that does not match its module's forward, and rows credited to the wrong example (unequal weights
    see a swap that a plain sum would not); ``dtypes``: the recorded outputs'."""
    tolerance = TOLERANCES.engine_sum.at(False, dtypes)
    largest = max((g.norm().item() for g in reference.values() if g is not None), default=0.0)
    for pid, (param, param_parts) in parts.items():
        ours = None
        for part in param_parts:
            ours = part.accumulate(
                ours, weights, param.detach().to(torch.promote_types(param.dtype, torch.float32))
            )
        ref = reference.get(pid)
        ref = torch.zeros_like(param) if ref is None else ref
        error = (ours - ref.float()).norm().item()
        if error > tolerance * max(ref.norm().item(), 1e-3 * largest, 1e-12):
            weights_scale = max(p.detach().float().norm().item() for p, _ in parts.values())
            if largest <= 1e-6 * weights_scale:  # rounding against rounding: nothing to check
                raise ValueError(
                    f"the first micro-batch's gradient is zero up to rounding (largest {largest:.2g} against weights "
                    f"of norm {weights_scale:.3g}), so the first step cannot check the per-example gradients: its "
                    "examples carry no signal (a preference pair whose chosen and rejected are the same?); check the "
                    "training data"
                )
            raise UnsupportedModuleError(
                f"parameter {names.get(pid, '?')} gets gradient from outside the forward of the module that owns "
                f"it, or that module's rule does not match its forward or credits rows to the wrong examples (engine {ours.norm().item():.4g} vs "
                f"autograd {ref.norm().item():.4g}), so its per-example norm would be wrong: freeze it, call it "
                "through its module or register a rule for the module (docs/clipping.md)"
            )
    missing = [
        names.get(pid, "?") for pid, g in reference.items() if pid not in parts and g is not None and g.any()
    ]
    if missing:
        raise UnsupportedModuleError(
            f"parameter {missing[0]} has a gradient but its module's forward was never recorded: freeze it or "
            "call it through its module"
        )


def engine_sum_weights(count: int, device: torch.device) -> torch.Tensor:
    """w_i ∈ [0.5, 1.5) per unit for ``check_engine_sum``, the same at every run (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    return (0.5 + torch.rand(count, generator=generator)).to(device)


class GradientWrittenOutsideClipping(RuntimeError):
    """Something other than the clipped step wrote a parameter's ``.grad`` during a DP step."""


class GradientGuard:
    """The clipped step owns ``.grad`` between two releases: at a logical batch's first micro-batch every gradient
    must be None or zero, and ``check_untouched`` (before the release) and every later micro-batch find each
    ``.grad`` exactly as the step left it (same tensor, same version), or training stops before any noise."""

    def __init__(self, params: Callable[[], list[nn.Parameter]]) -> None:
        self._params = params
        self._left: list | None = None  # the gradients' (identity, version) after the step's last write

    def _versions(self) -> list:
        return [None if p.grad is None else (id(p.grad), p.grad._version) for p in self._params()]

    def written(self) -> None:
        """The step has just written its part of the clipped sum."""
        self._left = self._versions()

    def check_untouched(self, before_release: bool = True) -> None:
        if self._left is None:
            stray = [p for p in self._params() if p.grad is not None and p.grad.any()]
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
