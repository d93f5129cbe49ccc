"""Gradient canaries that travel through the real DP step.

The audited model gets one extra layer, a probe ``nn.Linear(m, 1)`` that no real example reaches (its input is 0
for them, so their gradient on it is exactly 0). Canary j is a copy of a real row whose loss is replaced by
−A·w_j: its gradient is −A·e_j on the probe, 0 elsewhere, with A far above the clip norm. It is drawn by the
sampler, clipped by the engine, noised by the mechanism and stepped by the update rule like any example, so the
probe's update shows what the step released about it (the "Dirac canary" of Nasr et al. 2023).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import default_data_collator

CANARY_KEY = "hf_dp_audit_canary"  # 0 for a real row, j for canary j (1-based)
PROBE_NAME = "hf_dp_audit_probe"
CANARY_GRADIENT = 1e4  # A in units of the clip norm: ‖g_canary‖ = A·C


def attach_probe(model: nn.Module, canaries: int) -> nn.Linear:
    """Adds the probe layer (zero weights, one input per canary) to ``model`` and returns it."""
    param = next(model.parameters())
    probe = nn.Linear(canaries, 1, bias=False, device=param.device, dtype=param.dtype)
    nn.init.zeros_(probe.weight)
    model.add_module(PROBE_NAME, probe)
    return probe


def probe_of(model: nn.Module) -> nn.Linear:
    """The probe of a model, also inside DDP / DeepSpeed wrappers."""
    while not hasattr(model, PROBE_NAME):
        model = model.module
    return getattr(model, PROBE_NAME)


class WithCanaries(Dataset):
    """The rows of ``base`` (canary id 0) followed by one copy of a real row per canary id."""

    def __init__(self, base: Dataset, canary_ids: Sequence[int]) -> None:
        self.base, self.canary_ids = base, list(canary_ids)

    def __len__(self) -> int:
        return len(self.base) + len(self.canary_ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i < len(self.base):
            return {**self.base[i], CANARY_KEY: 0}
        j = i - len(self.base)
        return {**self.base[j % len(self.base)], CANARY_KEY: self.canary_ids[j]}


class CanaryCollator:
    """The user's collator on the rows without the canary ids, which come back as one tensor."""

    def __init__(self, collate=None) -> None:
        self.collate = collate or default_data_collator

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        ids = torch.tensor([row[CANARY_KEY] for row in rows])
        batch = self.collate([{k: v for k, v in row.items() if k != CANARY_KEY} for row in rows])
        return {**batch, CANARY_KEY: ids}


class CanaryLossMixin:
    """Put before a DPTrainer class: L_i is the user's loss for real rows and −A·C·w_j for canary j."""

    def compute_per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        inputs = dict(inputs)
        ids = inputs.pop(CANARY_KEY)
        losses = super().compute_per_example_loss(model, inputs)
        probe = probe_of(model)
        features = nn.functional.one_hot(ids, probe.in_features + 1)[:, 1:].to(probe.weight.dtype)
        amplitude = CANARY_GRADIENT * self.args.per_sample_max_grad_norm
        return losses.masked_fill(ids > 0, 0.0) - amplitude * probe(features).squeeze(-1)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """No weight decay on the probe: its update is then a function of the released gradient alone."""
        return [name for name in super().get_decay_parameter_names(model) if PROBE_NAME not in name]


def audited_trainer_class(trainer_class: type) -> type:
    return type(f"Audited{trainer_class.__name__}", (CanaryLossMixin, trainer_class), {})
