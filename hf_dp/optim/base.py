"""The base of hf_dp's own update rules: they run on the released ĝ, keep fp32 state, take no closure.

A closure would recompute a gradient after the noise, i.e. a non-private one. State is kept in at least
float32 whatever the parameter dtype (bf16 moments drift, and fp16 underflows ε²), also through
``load_state_dict``, which in torch would cast floating state to the parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 parameters; fp64 stays fp64."""
    return torch.promote_types(p.dtype, torch.float32)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(_to_device(v, device) for v in value)
    return value


class DPOptimizer(torch.optim.Optimizer):
    """Subclasses implement ``update()``, one step over ``param_groups`` with ``.grad`` = ĝ."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError(
                f"{type(self).__name__} takes no closure: it would recompute a non-private gradient after the noise"
            )
        self.update()

    def update(self) -> None:
        raise NotImplementedError

    def params_with_grad(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        """(group, p) for every parameter with a ĝ in ``.grad``; a sparse ĝ is refused (the rules are dense)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                yield group, p

    @staticmethod
    def decay(p: torch.Tensor, lr: float, weight_decay: float) -> None:
        """Decoupled weight decay θ ← θ(1 − ηλ) (Loshchilov & Hutter 2019): data-independent."""
        if weight_decay:
            p.mul_(1 - lr * weight_decay)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            if saved_id in state_dict["state"]:
                self.state[p] = {k: _to_device(v, p.device) for k, v in state_dict["state"][saved_id].items()}
