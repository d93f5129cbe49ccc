"""Which module clips which parameter, and where each forward of one goes: the hooks both norm passes share.

Every module that owns a trainable parameter gets a forward pre-hook (a broadcast batch of 1 is expanded to B)
and a forward hook, which hands the call to the micro-batch's ``Receiver``: book-keeping's recording
(bookkeeping.py) or the norm pass's taps (taps.py). A forward inside ``torch.utils.checkpoint`` is detected
here, so that book-keeping can stop and the pipeline re-select the norms inside the backward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from hf_dp.clipping.lora_params import claims_nested
from hf_dp.clipping.row_maps import ExampleRows
from hf_dp.clipping.rows import RowTracking
from hf_dp.clipping.rules import (
    Rule,
    UnsupportedModuleError,
    makes_own_rows,
    parameter_at,
    rule_for,
    rule_input,
)
from hf_dp.clipping.units import PrivacyUnits


def _is_batch_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) or type(module).__name__.endswith("BatchNorm")


def assign_parameters(model: nn.Module, allow_fallback: bool) -> dict[nn.Module, list[str]]:
    """Which module computes per-example gradients of which trainable parameter.

    A parameter owned by a module with a rule is left to it even if a parent also registers it
    (BERT's prediction head registers its decoder's bias twice). A module whose forward reads its submodules'
    parameters itself (``rules.claims_nested``: peft's LoRA on a parameter) owns them under their nested names,
    the outermost such module first.
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
    claimed: dict[int, tuple[nn.Module, str]] = {}
    for module in model.modules():  # pre-order: a wrapper claims before the wrapper it wraps
        if claims_nested(module):
            for pname, param in module.named_parameters():
                if param.requires_grad:
                    claimed.setdefault(id(param), (module, pname))
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                owners.setdefault(id(param), []).append((module, pname))
    owned: dict[nn.Module, list[str]] = {}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for module, pname in claimed.values():
        owned.setdefault(module, []).append(pname)
    for pid, candidates in owners.items():
        if pid in claimed:
            continue
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


@dataclass
class Layers:
    """The model's parameter-owning modules, the parameters each clips and its rule (None: torch.func)."""

    model: nn.Module
    owned: dict[nn.Module, list[str]]
    rules: dict[nn.Module, Rule | None] = field(init=False)
    module_names: dict[nn.Module, str] = field(init=False)

    def __post_init__(self) -> None:
        self.rules = {module: rule_for(module) for module in self.owned}
        self.module_names = {m: n for n, m in self.model.named_modules(remove_duplicate=False)}

    @property
    def parameters(self) -> list[nn.Parameter]:
        """What is clipped, each once, as the modules hold it now: FSDP2's ``prepare`` swaps sharded Parameters
        into the modules after the engine is built (and the optimizer's groups with them)."""
        unique = {
            id(parameter_at(m, n)): parameter_at(m, n) for m, names in self.owned.items() for n in names
        }
        return list(unique.values())

    def of(self, module: nn.Module) -> list[nn.Parameter]:
        return [parameter_at(module, name) for name in self.owned[module]]

    def where(self, module: nn.Module) -> str:
        """The module's name and type, for an error."""
        return f"{self.module_names.get(module, '?')} ({type(module).__name__})"

    def parameter_names(self) -> dict[int, str]:
        """Each parameter's name in the model, by id, as the modules hold them now."""
        return {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}


class Receiver(Protocol):
    """Where a micro-batch's recorded forwards go."""

    rows: int  # the micro-batch's rows: a broadcast batch of 1 is expanded to them
    on: bool  # still recording (book-keeping stops at a checkpoint)

    def admits(self, module: nn.Module) -> bool:
        """Every forward of a parameter-owning module, even without grad: record it (checkpoint detection)."""
        ...

    def receive(self, module: nn.Module, x: torch.Tensor | None, args: tuple, kwargs: dict, output) -> object:
        """A recorded forward with grad enabled, ``x`` its first tensor input; a replacement output or None."""
        ...

    def loose_use(self, module: nn.Module, name: str, param: nn.Parameter) -> torch.Tensor:
        """A clipped parameter read outside its module's forward (DeBERTa's relative embeddings): what the operation
        reads instead, its per-example gradients followed like a shared input's (shared.py)."""
        ...

    def joins(self, module: nn.Module, name: str) -> None:
        """A clipped parameter of a submodule (``name``, nested) read inside the forward of ``module``, which takes
        the torch.func fallback (Mamba's mixer reads its conv1d's and dt_proj's weights): that fallback covers it."""
        ...


class ForwardHooks:
    """The hooks on every parameter-owning module; ``receiver`` (None: nothing is recorded) gets each forward."""

    def __init__(self, modules: list[nn.Module], repeated: set[nn.Module] | None = None) -> None:
        self.receiver: Receiver | None = None
        # their batch of one is repeated, not broadcast (``repeated_prompts``)
        self.repeated = repeated or set()
        # while a receiver watches for loose reads: the modules inside their forward, innermost last
        self.running: list[nn.Module] | None = None
        self.in_hook = False
        self._handles = []
        for module in modules:
            self._handles.append(
                module.register_forward_pre_hook(self._expand_broadcast_batch, with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(self._record, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _expand_broadcast_batch(self, module: nn.Module, args: tuple, kwargs: dict):
        """HF models pass position_ids of batch size 1 and broadcast the output; expand the input to B
        instead, which leaves the forward unchanged but keeps each example's output gradient apart. Only ids: a
        float input of batch 1 (DeBERTa's relative embeddings, ModernBERT's unpadded tokens) is no broadcast the
        model would leave unchanged, and is refused (``check_batch_dimension``)."""
        receiver = self.receiver
        if receiver is not None and self.running is not None:
            self.running.append(module)
        if receiver is None or not receiver.on or not torch.is_grad_enabled() or module in self.repeated:
            return None
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if x.dim() > 0 and x.shape[0] == 1 and receiver.rows > 1 and not x.is_floating_point():
            return (x.expand(receiver.rows, *x.shape[1:]), *args[1:]), kwargs
        return None

    def _record(self, module: nn.Module, args: tuple, kwargs: dict, output):
        running = self.running
        if running and module in running:
            del running[len(running) - 1 - running[::-1].index(module)]
        self.in_hook = True  # what the receiver computes reads parameters, none of them loose
        try:
            return self._received(module, args, kwargs, output)
        finally:
            self.in_hook = False

    def _received(self, module: nn.Module, args: tuple, kwargs: dict, output):
        receiver = self.receiver
        if receiver is None or not receiver.admits(module) or not torch.is_grad_enabled():
            return None
        x = rule_input(module, args, kwargs)
        if (
            makes_own_rows(module)
            and x is not None
            and x.dim() > 0
            and x.shape[0] == 1
            and receiver.rows > 1
            and isinstance(output, torch.Tensor)
            and output.shape[:1] == (1,)
        ):  # positions of batch 1 made inside the forward (BART's decoder): broadcast here, as the model would
            x, output = x.expand(receiver.rows, *x.shape[1:]), output.expand(receiver.rows, *output.shape[1:])
            replaced = receiver.receive(module, x, args, kwargs, output)
            return output if replaced is None else replaced
        return receiver.receive(module, x, args, kwargs, output)


def repeated_prompts(model: nn.Module) -> set[nn.Module]:
    """peft's prompt encoders (prompt tuning, p-tuning), which make the prompts from a batch of one that peft then
    ``repeat``s to the batch: expanding that batch of one would give B copies repeated B times. Left as they are, their
    output is an input shared by all examples, followed to the batch (shared_outputs.py)."""
    encoders = getattr(model, "prompt_encoder", None)
    return set(encoders.modules()) if isinstance(encoders, nn.Module) else set()


def tensor_outputs(output) -> list[torch.Tensor]:
    return [
        o for o in (output if isinstance(output, tuple | list) else (output,)) if isinstance(o, torch.Tensor)
    ]


def batch_rows(
    layers: Layers, module: nn.Module, x: torch.Tensor | None, rows: int, tracking: RowTracking
) -> ExampleRows | None:
    """Which example each row of a trainable module's input belongs to: None when its rows are the micro-batch's
    own, the tracked map (rows.py) when they are the tokens of all examples flattened; otherwise refused."""
    mapped = tracking.rows_of(x)
    if mapped is None:
        check_batch_dimension(layers, module, x, rows)
    return mapped


def check_shared_use(layers: Layers, module: nn.Module, output: object, units: PrivacyUnits | None) -> None:
    """A layer on an input shared by all examples (shared.py) returns one tensor, and its examples are rows."""
    if not isinstance(output, torch.Tensor):
        raise UnsupportedModuleError(
            f"{layers.where(module)} takes an input shared by all examples and returns several tensors: register "
            "a rule for it with hf_dp.clipping.rules.register_rule, or freeze it"
        )
    if units is not None and not units.is_trivial:
        raise UnsupportedModuleError(
            f"{layers.where(module)} takes an input shared by all examples, whose gradient per privacy unit of "
            "several rows or records is not formed: freeze it, or use one unit per row"
        )


def check_batch_dimension(layers: Layers, module: nn.Module, x: torch.Tensor | None, rows: int) -> None:
    """A trainable module's input must have the micro-batch's rows (per-example gradients need them)."""
    if x is not None and x.dim() > 0 and x.shape[0] != rows:
        raise UnsupportedModuleError(
            f"{layers.where(module)} has trainable parameters but its input of shape {tuple(x.shape)} has no batch "
            f"dimension of {rows}: it is shared by all examples (like T5's relative_attention_bias) or takes rows "
            "of the examples that no tracked operation put there (like an MoE expert's routed tokens), so its "
            "per-example gradients cannot be told apart: freeze it"
        )


Received = Callable[[nn.Module, torch.Tensor, torch.Tensor], None]


class _Tap(torch.autograd.Function):
    """y ↦ y whose backward hands (module, its input x, ∂L/∂y) to ``receive``. ``anchor`` requires grad, so y does
    even while the parameters are frozen, and differentiating towards it runs every tap's backward; it receives no
    gradient (differentiate towards it with ``allow_unused=True``)."""

    @staticmethod
    def forward(ctx, output, anchor, receive, module, x):
        ctx.receive, ctx.module = receive, module
        ctx.save_for_backward(x)
        return output.detach()  # a fresh tensor, not a view: the model may modify it in place

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        ctx.receive(ctx.module, x, grad_output)
        return grad_output, None, None, None, None  # the anchor's gradient: none (no launch, no accumulation)


def tap(
    output: torch.Tensor, anchor: torch.Tensor, receive: Received, module: nn.Module, x: torch.Tensor
) -> torch.Tensor:
    """``output`` unchanged, with ``receive(module, x, ∂L/∂output)`` called when its gradient arrives; x is saved
    through autograd (a checkpoint drops and recomputes it)."""
    return _Tap.apply(output, anchor, receive, module, x)


_REENTRANT_FORWARD = torch_checkpoint.CheckpointFunction.forward.__code__


def in_reentrant_checkpoint() -> bool:
    """Inside the first forward of a reentrant ``torch.utils.checkpoint`` (run under no_grad, recomputed in the
    backward); a no_grad forward of the user's own (a frozen reference model, an evaluation) is not."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            return True
        frame = frame.f_back
    return False


def is_checkpointing() -> bool:
    """Inside a non-reentrant ``torch.utils.checkpoint`` forward (its saved-tensor hooks are on top)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")
