"""The per-example loss L_i: the model's own loss on example i alone.

For token losses, L_i is the mean over example i's non-ignored tokens (label -100 is ignored), so
each example's weight does not depend on the other examples in the batch (HF's batch loss averages
over all tokens in the batch, which mixes examples). Sequence classification follows HF's
``problem_type``: cross-entropy, mean squared error (regression) or mean binary cross-entropy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

IGNORE_INDEX = -100
_LOGITS_PER_CHUNK = 1 << 24  # low-precision logits upcast to float32 at a time (64 MB)


def _names(mapping: dict) -> set[str]:
    found: set[str] = set()
    for value in mapping.values():
        found.update(value if isinstance(value, tuple | list) else (value,))
    return found


_CAUSAL_LM_CLASSES = _names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under peft / DDP / DeepSpeed wrappers."""
    while True:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model


def is_causal_lm(model: nn.Module) -> bool:
    name = type(unwrap_model(model)).__name__
    return name in _CAUSAL_LM_CLASSES or name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def token_loss_per_example(
    logits: torch.Tensor, labels: torch.Tensor, shift: bool, label_smoothing: float = 0.0
) -> torch.Tensor:
    """L_i = mean over t with labels_{i,t} != -100 of CE(logits_{i,t}, labels_{i,t}); 0 if none.

    With label smoothing ε each token's CE is (1 − ε)·NLL + ε·mean_v(−log p_v) (Szegedy et al. 2016), the
    Trainer's ``LabelSmoother`` applied to each example alone.

    For causal LMs position t predicts labels_{t+1}: the LABELS are shifted (one -100 column appended),
    never the logits, which would copy the B·T·V logit tensor. bf16/fp16 logits are upcast a chunk of rows
    at a time, each chunk recomputed in the backward, so no float32 copy of all the logits is ever held.
    """
    if shift:
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if flat_logits.dtype in (torch.float32, torch.float64):
        token_losses = _cross_entropy(flat_logits, flat_labels, label_smoothing)
    else:
        # F.cross_entropy on low-precision logits would need a float32 copy of all B·T·V of them, kept for the
        # backward; HF's own loss has the same copy and averages over the batch, mixing examples
        rows = max(1, _LOGITS_PER_CHUNK // flat_logits.shape[-1])
        token_losses = torch.cat(
            [
                checkpoint(
                    _cross_entropy,
                    flat_logits[start : start + rows],
                    flat_labels[start : start + rows],
                    label_smoothing,
                    use_reentrant=False,
                )
                for start in range(0, flat_labels.shape[0], rows)
            ]
        )
    counts = (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)
    return token_losses.view(labels.shape).sum(dim=1) / counts


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Per-token cross-entropy in at least float32; 0 for ignored tokens."""
    return F.cross_entropy(
        _at_least_float32(logits),
        labels,
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=label_smoothing,
    )


def sequence_loss_per_example(
    logits: torch.Tensor, labels: torch.Tensor, problem_type: str | None, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Classification losses per example, with HF's rule for inferring ``problem_type``; label smoothing
    applies to single-label cross-entropy and is refused for the other problem types."""
    num_labels = logits.shape[-1]
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if label_smoothing and problem_type != "single_label_classification":
        raise ValueError(
            f"label_smoothing_factor={label_smoothing} applies to cross-entropy over classes, not to "
            f"problem_type={problem_type!r}; set it to 0"
        )
    logits = _at_least_float32(logits)
    if problem_type == "regression":
        return F.mse_loss(
            logits.view(labels.shape[0], -1),
            labels.to(logits.dtype).view(labels.shape[0], -1),
            reduction="none",
        ).mean(dim=1)
    if problem_type == "single_label_classification":
        return F.cross_entropy(
            logits.view(-1, num_labels), labels.view(-1), reduction="none", label_smoothing=label_smoothing
        )
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(dim=1)


def per_example_loss(model: nn.Module, inputs: dict[str, Any], label_smoothing: float = 0.0) -> torch.Tensor:
    """Run ``model`` on a batch (without letting it compute its batch loss) and return L_i, shape (B,)."""
    inputs = dict(inputs)
    labels = inputs.pop("labels", None)
    if labels is None:
        raise ValueError("the batch has no 'labels': DP training needs labels to form a per-example loss")
    base = unwrap_model(model)
    if (
        getattr(base.config, "is_encoder_decoder", False)
        and "decoder_input_ids" not in inputs
        and hasattr(base, "prepare_decoder_input_ids_from_labels")
    ):
        inputs["decoder_input_ids"] = base.prepare_decoder_input_ids_from_labels(labels=labels)
    outputs = model(**inputs)
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    if logits.dim() == 3 and labels.dim() == 2:
        return token_loss_per_example(
            logits, labels, shift=is_causal_lm(model), label_smoothing=label_smoothing
        )
    return sequence_loss_per_example(
        logits, labels, getattr(base.config, "problem_type", None), label_smoothing
    )
