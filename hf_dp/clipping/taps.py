"""Per-example norms computed INSIDE the backward, for models with activation checkpointing.

Book-keeping keeps every layer's input until one backward has produced all output gradients, which is what
activation checkpointing exists to avoid. Here each parameter-owning module's output passes through an
identity ``tap`` that saves the module's input through autograd (so checkpointing drops and recomputes
it like any other saved activation) and, when the output gradient arrives, turns (input, output gradient)
into this module's contribution to ‖s ⊙ g_i‖² with the layer's rule, then lets both go. A parameter used
several times in one forward (tied embeddings, a shared layer) keeps its parts until its last use arrives
and gets the norm of the sum, cross terms included.

Recomputation runs the forward hooks again; uses are counted in the first forward only and norms are added
only in backward, where each tap fires exactly once (non-reentrant checkpointing runs the ORIGINAL graph's
nodes; reentrant checkpointing runs the forward under no_grad, untapped, and taps its recomputation).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from hf_dp.clipping.geometry import ClipScale
from hf_dp.clipping.per_example import (
    Materialised,
    OuterProductSum,
    PerExampleGradient,
    combined_squared_norm,
)
from hf_dp.clipping.tail import Tail, TailBoundary, keep_form
from hf_dp.clipping.units import PrivacyUnits, regroup_for_rule

Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, PerExampleGradient]]


Receiver = Callable[[nn.Module, torch.Tensor, torch.Tensor], None]


class _Tap(torch.autograd.Function):
    """y ↦ y whose backward hands (module, its input x, ∂L/∂y) to ``receive``. ``anchor`` requires grad, so y does
    even while the parameters are frozen, and differentiating towards it runs every tap's backward."""

    @staticmethod
    def forward(ctx, output, anchor, receive, module, x):
        ctx.receive, ctx.module = receive, module
        ctx.save_for_backward(x)
        return output.detach()  # a fresh tensor, not a view: the model may modify it in place

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        ctx.receive(ctx.module, x, grad_output)
        return grad_output, grad_output.new_zeros(()), None, None, None  # zero for the anchor


def tap(
    output: torch.Tensor, anchor: torch.Tensor, receive: Receiver, module: nn.Module, x: torch.Tensor
) -> torch.Tensor:
    """``output`` unchanged, with ``receive(module, x, ∂L/∂output)`` called when its gradient arrives; x is saved
    through autograd (a checkpoint drops and recomputes it)."""
    return _Tap.apply(output, anchor, receive, module, x)


class _AgainstIds:
    """A dense use G = Σ_t left_t ⊗ right_t kept only as ⟨left_t, onehot(ids_s)⟩ (B, T, S) and right: all the
    cross term with a later embedding use of those ids needs (a tied LM head: B·T·S floats instead of B·T·V)."""

    def __init__(self, part: OuterProductSum, ids: torch.Tensor) -> None:
        self.gram = part.left_gram(OuterProductSum(ids, part.right, part.rows))
        self.right = part.right

    def inner(self, embedding: OuterProductSum) -> torch.Tensor:
        return (self.gram * torch.bmm(self.right, embedding.right.transpose(1, 2))).sum(dim=(1, 2))


class NormCollector:
    """Σ over parameters of ‖s ⊙ G_i‖², filled by the taps during one backward of Σ_i L_i.

    ``probe`` (the first step): also ⟨G_i, V_p⟩ for a random V_p per parameter (``direction``, regenerated from
    its seed when needed, never stored), so the strategy can check that the norm pass saw every use of every
    parameter against autograd's gradient. ``keep_tail``: also keep what the weighted pass needs to skip the
    uses after the last checkpointed one (``tail``, see tail.py).
    """

    def __init__(
        self,
        rules: dict[nn.Module, Rule],
        owned: dict[nn.Module, list[str]],
        batch_size: int,
        scales: dict[int, ClipScale],
        materialise: bool,
        dtype: torch.dtype,
        device: torch.device,
        probe: bool = False,
        keep_gradients: bool = False,
        units: PrivacyUnits | None = None,
        module_names: dict[nn.Module, str] | None = None,
        keep_tail: bool = False,
    ) -> None:
        self.rules, self.owned, self.scales, self.materialise = rules, owned, scales, materialise
        # each scale by where its parameter is used: FSDP2 swaps the module's sharded parameter for an unsharded
        # one (another object) during the forward and backward, so the backward's ids are not the scales' keys
        self._site_scales = {
            (module, name): scales[id(getattr(module, name))]
            for module, names in owned.items()
            for name in names
            if id(getattr(module, name)) in scales
        }
        self.units, self.module_names = units, module_names or {}  # norms per privacy unit (units.py)
        self.batch_size = batch_size
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.squared = torch.zeros(batch_size, dtype=dtype, device=device)
        self.uses: dict[int, int] = {}  # per parameter, in the first forward
        self.counting = True
        self.low_precision = False  # a tapped output was bf16/fp16 (autocast or low-precision weights)
        self._waiting: dict[int, tuple[nn.Parameter, list[PerExampleGradient]]] = {}
        self._ids: dict[int, torch.Tensor | None] = {}  # an embedding's ids, per parameter used once as one
        self._tied_heads: dict[int, _AgainstIds] = {}
        self.probe = probe
        self.projections: dict[int, torch.Tensor] = {}
        # few trainable weights (LoRA): keep each example's explicit gradient, so no second pass is needed
        self.kept: dict[int, tuple[nn.Parameter, torch.Tensor]] | None = {} if keep_gradients else None
        # the first forward's uses in order: the tail is every use after the last checkpointed one
        self.keep_tail = keep_tail
        self._calls, self._last_checkpointed = 0, 0
        self._calls_of: dict[nn.Module, int] = {}
        self._boundary: tuple[int, TailBoundary] | None = None  # (its use's number, the boundary)
        self._tail_parts: list[tuple[nn.Parameter, PerExampleGradient]] = []

    def direction(self, param: nn.Parameter) -> torch.Tensor:
        """The probe V_p of a parameter: N(0, I), the same values at every call (one seed; each parameter is checked
        on its own)."""
        generator = torch.Generator(device=param.device).manual_seed(0)
        return torch.randn(param.shape, generator=generator, dtype=self.squared.dtype, device=param.device)

    def count(self, module: nn.Module, checkpointed: bool = False) -> int:
        """One more use of the module's parameters in the forward (not in a recomputation); its number."""
        for name in self.owned[module]:
            pid = id(getattr(module, name))
            self.uses[pid] = self.uses.get(pid, 0) + 1
        self._calls += 1
        self._calls_of[module] = self._calls_of.get(module, 0) + 1
        if checkpointed:
            self._last_checkpointed = self._calls
        return self._calls

    def tap(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        self.low_precision |= output.dtype in (torch.bfloat16, torch.float16)
        receive = self.add
        if self.counting:
            checkpointed = is_checkpointing()
            call = self.count(module, checkpointed)
            if isinstance(module, nn.Embedding):
                pid = id(module.weight)
                ids = x if self.units is None else self.units.regroup(x)
                self._ids[pid] = None if pid in self._ids else ids.reshape(ids.shape[0], -1)
            if self.keep_tail and self._last_checkpointed and not checkpointed:
                receive = functools.partial(self.add, call=call)  # a tail use if no checkpointed use follows
                if call == self._last_checkpointed + 1 and x.requires_grad:
                    self._boundary = (call, TailBoundary(module, self._calls_of[module]))
                    self._boundary[1].watch(x)
        return tap(output, self.anchor, receive, module, x)

    def tail(self) -> Tail | None:
        """After the backward: the tail the weighted pass may skip (None: no checkpointed use, or no tail)."""
        if self._boundary is None or not self._tail_parts:
            return None
        call, boundary = self._boundary
        if call != self._last_checkpointed + 1 or boundary.gradient is None:
            return None
        return Tail(boundary, self._tail_parts)

    def add(self, module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor, call: int = 0) -> None:
        where = f"{self.module_names.get(module, '?')} ({type(module).__name__})"
        x, grad_output = regroup_for_rule(self.units, x, grad_output, where)
        found = self.rules[module](module, x, grad_output)
        in_tail = call > self._last_checkpointed
        for name in self.owned[module]:
            param = getattr(module, name)
            pid, part = id(param), found[name]
            if in_tail:  # kept for the weighted pass, in the form its norm is also computed from
                part = keep_form(part, param.shape)
                self._tail_parts.append((param, part))
            if (module, name) in self._site_scales:
                self.scales[pid] = self._site_scales[module, name]
            if self.probe:
                projection = part.project(self.direction(param))
                self.projections[pid] = self.projections.get(pid, 0) + projection
            if self.kept is not None:
                grads = part.explicit(param.shape).grads
                if pid in self.kept:
                    self.kept[pid][1].add_(grads)  # another use: the per-example gradient is the sum
                else:
                    self.kept[pid] = (param, grads)
                continue
            if self.uses.get(pid, 1) <= 1:
                self._add_norm(param, [part])
                continue
            if pid in self._tied_heads and isinstance(part, OuterProductSum) and part.is_index:
                head = self._tied_heads.pop(
                    pid
                )  # ‖G_head + G_emb‖² = ‖G_head‖² + ‖G_emb‖² + 2⟨G_head, G_emb⟩
                self.squared += (part.squared_norm(False) + 2 * head.inner(part)).to(self.squared)
                continue
            if self._is_tied_head(pid, part):
                self._tied_heads[pid] = _AgainstIds(part, self._ids[pid])
                self.squared += part.squared_norm(False).to(self.squared)
                continue
            _, parts = self._waiting.setdefault(pid, (param, []))
            parts.append(part)
            if len(parts) == self.uses[pid]:
                self._add_norm(*self._waiting.pop(pid))

    def _is_tied_head(self, pid: int, part: PerExampleGradient) -> bool:
        """The first of exactly two uses, dense, and the other one an embedding whose ids the forward showed."""
        return (
            self.uses[pid] == 2
            and pid not in self._waiting
            and self._ids.get(pid) is not None
            and pid not in self.scales
            and not self.materialise
            and isinstance(part, OuterProductSum)
            and not part.is_index
        )

    def _add_norm(self, param: nn.Parameter, parts: list[PerExampleGradient]) -> None:
        shape = getattr(param, "ds_shape", param.shape)  # DeepSpeed ZeRO-3 partitions to shape (0,)
        terms = [(1.0, part) for part in parts]
        self.squared += combined_squared_norm(terms, self.scales.get(id(param)), shape, self.materialise).to(
            self.squared
        )

    def norms(self) -> torch.Tensor:
        """‖s ⊙ g_i‖, shape (B,), once the backward is done (call once); a use whose output got no gradient
        simply contributed nothing."""
        for param, parts in self._waiting.values():
            self._add_norm(param, parts)
        self._waiting.clear()
        self._tied_heads.clear()  # its embedding use got no gradient: ‖G_head‖² is already in
        for param, grads in (self.kept or {}).values():
            self._add_norm(param, [Materialised(grads)])
        return self.squared.clamp(min=0).sqrt()

    def kept_gradients(self) -> list[tuple[nn.Parameter, Materialised]]:
        """The explicit per-example gradients (``keep_gradients``), to be summed with the clip factors."""
        return [(param, Materialised(grads)) for param, grads in (self.kept or {}).values()]


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
