"""What the privacy plan and the clipping hooks were made for when the DPTrainer was built, checked at ``train()``.

The plan (N, B̄, q, σ, C, the steps, the units), the sampler and the hooks are fixed in ``__init__``. An argument,
dataset or model changed on the trainer afterwards would be ignored (a layer unfrozen since gets noise only), or
fail deep in the loader (a smaller dataset) or the backward (a layer frozen since): refused in one line instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

# the arguments the plan is made of
PLANNED_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "num_train_epochs",
    "per_sample_max_grad_norm",
    "noise_multiplier",
    "target_epsilon",
    "target_delta",
    "accountant",
    "disable_dp",
    "poisson_sampling",
    "noise_mechanism",
    "num_bands",
    "privacy_unit_column",
    "max_examples_per_unit",
)
AFTER_INIT = "after the DPTrainer was built"


def trainable_names(model: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, p in model.named_parameters() if p.requires_grad)


@dataclasses.dataclass(frozen=True)
class PlannedSetting:
    """The planned arguments' values, the dataset and the hooked model with its trainable parameters' names."""

    arguments: dict[str, Any]
    dataset: Any
    model: nn.Module
    trainable: tuple[str, ...]

    @staticmethod
    def of(args, dataset, model: nn.Module) -> PlannedSetting:
        arguments = {name: getattr(args, name, None) for name in PLANNED_FIELDS}
        return PlannedSetting(arguments, dataset, model, trainable_names(model))

    def check(self, args, dataset, model: nn.Module) -> None:
        """The trainer's ``args``, ``train_dataset`` and ``model`` at ``train()`` are those planned for."""
        if model is not self.model:
            raise ValueError(
                f"DPTrainer: trainer.model was replaced {AFTER_INIT}, but the clipping hooks are on the first "
                "model; pass the model to train when building the DPTrainer"
            )
        now = trainable_names(model)
        if now != self.trainable:
            changed = sorted(set(now) ^ set(self.trainable))
            raise ValueError(
                f"DPTrainer: the model's trainable parameters changed {AFTER_INIT} ({changed[0]} and "
                f"{len(changed) - 1} more), but the clipping hooks were set then; set requires_grad before "
                "building the DPTrainer"
            )
        if dataset is not self.dataset:
            raise ValueError(
                f"DPTrainer: train_dataset was replaced {AFTER_INIT}, but the privacy plan (N, the sampling, σ) "
                "was made for the first one; pass the dataset to train on when building the DPTrainer"
            )
        for name, value in self.arguments.items():
            if getattr(args, name, None) != value:
                raise ValueError(
                    f"DPTrainer: args.{name} changed from {value!r} to {getattr(args, name, None)!r} {AFTER_INIT}, "
                    "but the privacy plan (the sampling, σ, the planned steps) was made then; set it in "
                    "DPTrainingArguments before building the DPTrainer"
                )


def refuse_compiled(model: nn.Module) -> None:
    """A model compiled by ``torch.compile`` (wrapped) or ``model.compile()`` (in place): the clipping hooks would
    run inside a compiled graph, whose backward the DP step cannot take as it needs (the flag torch_compile is
    refused for the same reason)."""
    if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError(
            "the model was compiled with torch.compile, but the DP step runs the bare module with per-layer "
            "clipping hooks; pass the model uncompiled (torch_compile stays False under DP)"
        )
