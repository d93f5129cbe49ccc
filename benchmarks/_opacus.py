"""Opacus 1.6 ghost clipping as the benchmarks compare it: AdamW at the Trainer's defaults, the same σ and C as
hf_dp, one fixed batch (no Poisson sampling: the step is timed, not the sampler)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import TrainingArguments


def ghost_clipping(
    model: nn.Module, num_rows: int, batch: int, noise_multiplier: float, max_grad_norm: float
):
    """(engine, dp_model, dp_optimizer) of Opacus' ghost ("fast gradient") clipping over ``model``."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    defaults = TrainingArguments.__dataclass_fields__
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=defaults["learning_rate"].default,
        weight_decay=defaults["weight_decay"].default,
    )
    loader = DataLoader(TensorDataset(torch.zeros(num_rows, 1)), batch_size=batch)
    engine = PrivacyEngine()
    dp_model, dp_optimizer, _, _ = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        grad_sample_mode="ghost",
        loss_reduction="mean",
        poisson_sampling=False,
    )
    return engine, dp_model, dp_optimizer


def ghost_step(dp_model: nn.Module, dp_optimizer: torch.optim.Optimizer, losses: torch.Tensor) -> float:
    """One Opacus step from per-example losses: its two backward passes, the noisy update, zeroed gradients."""
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    loss = DPTensorFastGradientClipping(dp_model, dp_optimizer, losses, loss_reduction="mean")
    loss.backward()
    dp_optimizer.step()
    dp_optimizer.zero_grad(set_to_none=True)
    return loss.item()
