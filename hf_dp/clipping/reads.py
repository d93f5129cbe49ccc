"""Which operations read a tensor's values, and the watch for clipped parameters read outside their module.

A gradient flows from an operation that reads a parameter's values (``linear``, ``matmul``, ``weight.T``), not
from one that reads its shape, dtype or layout. ``LooseWatch`` is the row tracker's read check alone (rows.py):
once the tracker has stopped, it hands every parameter a recorded forward reads to ``loose`` (engine._loose),
which refuses one read outside its module's forward that the first step did not make.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor
Loose = Callable[[nn.Parameter], Tensor | None]

# fmt: off
_METADATA = {
    Tensor.dim, Tensor.size, Tensor.numel, Tensor.nelement, Tensor.stride, Tensor.element_size,
    Tensor.is_floating_point, Tensor.is_complex, Tensor.is_contiguous, Tensor.get_device, Tensor.data_ptr,
    Tensor.__len__, torch.is_floating_point, torch.is_complex, torch.numel,
}
# fmt: on

# properties whose getter returns the tensor's values (a gradient flows through ``weight.T``)
_VALUE_PROPERTIES = {Tensor.T.__get__, Tensor.mT.__get__, Tensor.H.__get__, Tensor.mH.__get__}


def reads_values(func) -> bool:
    """Whether an operation reads a tensor's values (a gradient can flow), not its shape, dtype or layout."""
    if func in _VALUE_PROPERTIES:
        return True
    return func not in _METADATA and getattr(func, "__name__", "") != "__get__"


class LooseWatch(TorchFunctionMode):
    """A recorded forward after the tracker switched itself off: only hands ``loose`` each clipped parameter an
    operation reads, so that a read outside its module's forward that the first step did not make is refused
    (engine._loose), not left out of the norms while the weighted pass back-propagates through it."""

    def __init__(self, loose: Loose) -> None:
        super().__init__()
        self.loose = loose

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled() and reads_values(func):
            for value in (*args, *kwargs.values()):
                if isinstance(value, nn.Parameter):
                    self.loose(value)
        return func(*args, **kwargs)
