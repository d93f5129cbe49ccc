"""Activation checkpointing's weighted pass without its forward through the checkpointed layers.

The weighted pass evaluates the model at the same parameters, on the same batch, with the same dropout masks as
the norm pass, so every checkpointed layer's output is the one the norm pass computed. The norm pass keeps those
outputs (B·T·d floats a layer: each is the next layer's input, which checkpointing keeps anyway) with the random
state each layer started from. In the weighted pass each layer returns its kept output at once, and runs only in
the backward: recomputed from its input under the same random state and autocast, then back-propagated, as
reentrant checkpointing does after a forward that this skips. One forward of the body less per step.

Applies to Hugging Face layers (``GradientCheckpointingLayer``, whose checkpoint function it swaps for the two
passes) that return one tensor, the outermost only (``outermost_checkpointed``). The first step checks the result
against the whole weighted pass (tail.py); through a framework, whose backward cannot run twice, it compares each
layer's output in the whole weighted pass with the kept one (``comparing``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer


@dataclass
class Kept:
    """A checkpointed call of the norm pass: its output, the random and autocast state it started from, and
    (``recording(keep_calls=True)``, layerwise.py) the layer's function and its inputs, detached."""

    output: torch.Tensor
    rng: torch.Tensor
    device_rng: tuple[torch.device, torch.Tensor] | None
    autocast: tuple[str, bool, torch.dtype]
    function: Callable | None = None
    args: tuple | None = None

    def rerun(self, function: Callable, args: list) -> object:
        """The layer's forward as the norm pass ran it: same random state (dropout masks) and autocast."""
        device_type, enabled, dtype = self.autocast
        devices = [self.device_rng[0]] if self.device_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=devices[0].type if devices else "cuda"):
            torch.set_rng_state(self.rng)
            if self.device_rng is not None:
                torch.cuda.set_rng_state(self.device_rng[1], self.device_rng[0])
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                return function(*args)


def _random_state(args: tuple) -> tuple[torch.Tensor, tuple[torch.device, torch.Tensor] | None]:
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    accelerator = None
    if device.type == "cuda":
        accelerator = (device, torch.cuda.get_rng_state(device))
    return torch.get_rng_state(), accelerator


class _Replay(torch.autograd.Function):
    """Returns the kept output; its backward recomputes the layer from its inputs and back-propagates."""

    @staticmethod
    def forward(ctx, layer: Callable, kept: Kept, *args):
        ctx.layer, ctx.kept = layer, kept
        ctx.tensor_positions = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*[args[k] for k in ctx.tensor_positions])
        return kept.output.clone()

    @staticmethod
    def backward(ctx, grad_output):
        args = list(ctx.others)
        tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        for position, tensor in zip(ctx.tensor_positions, tensors, strict=True):
            args[position] = tensor
        output = ctx.kept.rerun(ctx.layer, args)
        if output.requires_grad:
            torch.autograd.backward(output, grad_output)
        grads = [t.grad if t.requires_grad else None for t in tensors]
        found = dict(zip(ctx.tensor_positions, grads, strict=True))
        return (None, None, *[found.get(k) for k in range(len(args))])


def _autocast_state(args: tuple) -> tuple[str, bool, torch.dtype]:
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    return device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def outermost_checkpointed(model: nn.Module) -> list[nn.Module]:
    """The model's checkpointed Hugging Face layers not inside another: a nested one (Zamba's hybrid layer holds a
    Mamba decoder layer) runs within its parent's call, finishing before it, so it is replayed with its parent
    (kept in order of completion, its output would be handed to the next layer called)."""
    checkpointed = [
        m
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer)
        and getattr(m, "gradient_checkpointing", False)
        and "_gradient_checkpointing_func" in vars(m)
    ]
    inner = {id(m) for layer in checkpointed for m in layer.modules() if m is not layer}
    return [m for m in checkpointed if id(m) not in inner]


class LayerReplay:
    """The norm pass's checkpointed layer outputs, replayed in the weighted pass (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = outermost_checkpointed(model)
        self.kept: list[Kept] = []
        self.complete = True  # every call returned one tensor (else the weighted pass runs the layers)
        self.matched: bool | None = (
            None  # set by ``comparing``: the weighted pass's outputs were the kept ones
        )

    def __bool__(self) -> bool:
        return bool(self.layers)

    @contextlib.contextmanager
    def _swapped(self, make: Callable[[Callable], Callable]) -> Iterator[None]:
        originals = [layer._gradient_checkpointing_func for layer in self.layers]
        for layer, original in zip(self.layers, originals, strict=True):
            layer._gradient_checkpointing_func = make(original)
        try:
            yield
        finally:
            for layer, original in zip(self.layers, originals, strict=True):
                layer._gradient_checkpointing_func = original

    def recording(self, keep_calls: bool = False) -> contextlib.AbstractContextManager[None]:
        """The norm pass: keep each checkpointed call's output, random state and autocast state (``keep_calls``:
        its function and inputs too)."""
        self.kept, self.complete = [], True

        def make(checkpoint: Callable) -> Callable:
            def record(function: Callable, *args):
                rng, device_rng = _random_state(args)
                autocast = _autocast_state(args)
                output = checkpoint(function, *args)
                if isinstance(output, torch.Tensor):
                    entry = Kept(output.detach(), rng, device_rng, autocast)
                    if keep_calls:
                        entry.function = function
                        entry.args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                    self.kept.append(entry)
                else:
                    self.complete = False
                return output

            return record

        return self._swapped(make)

    def comparing(self, tolerance: float) -> contextlib.AbstractContextManager[None]:
        """A weighted pass that runs the layers (the first step through a framework): ``matched`` tells whether
        each output equals the kept one within ``tolerance`` (relative), so that later passes may replay them."""
        kept = iter(self.kept)
        self.matched = True

        def make(checkpoint: Callable) -> Callable:
            def compare(function: Callable, *args):
                output = checkpoint(function, *args)
                entry = next(kept, None)
                if (
                    entry is None
                    or not isinstance(output, torch.Tensor)
                    or output.shape != entry.output.shape
                ):
                    self.matched = False
                    return output
                with torch.no_grad():
                    error = (output.detach().float() - entry.output.float()).norm()
                    self.matched &= bool(error <= tolerance * entry.output.float().norm())
                return output

            return compare

        return self._swapped(make)

    def replaying(self) -> contextlib.AbstractContextManager[None]:
        """The weighted pass: each checkpointed call returns its kept output; the layer runs in the backward."""
        kept = iter(self.kept)

        def make(checkpoint: Callable) -> Callable:
            def replay(function: Callable, *args):
                entry = next(kept, None)
                if entry is None:
                    raise RuntimeError(
                        "the weighted pass called more checkpointed layers than the norm pass: its forward changed"
                    )
                return _Replay.apply(function, entry, *args)

            return replay

        return self._swapped(make)
