"""The per-example loss L_i: the model's own loss on example i alone.

For token losses, L_i is the mean over example i's non-ignored tokens (label -100 is ignored), so
each example's weight does not depend on the other examples in the batch (HF's batch loss averages
over all tokens in the batch, which mixes examples). Sequence classification follows HF's
``problem_type``: cross-entropy, mean squared error (regression) or mean binary cross-entropy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_dp.clipping.units import PrivacyUnits

IGNORE_INDEX = -100
_LOGITS_PER_CHUNK = 1 << 24  # logits taken into the cross-entropy at a time (64 MB in float32)


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
    logits: torch.Tensor,
    labels: torch.Tensor,
    shift: bool,
    label_smoothing: float = 0.0,
    units: PrivacyUnits | None = None,
) -> torch.Tensor:
    """L_i = mean over t with labels_{i,t} != -100 of CE(logits_{i,t}, labels_{i,t}); 0 if none.

    With records packed into rows (token ``units``) it is one loss per record, over that record's tokens; a
    position whose (shifted) label belongs to the next record is not predicted, so no record's loss reads another's.

    With label smoothing ε each token's CE is (1 − ε)·NLL + ε·mean_v(−log p_v) (Szegedy et al. 2016), the
    Trainer's ``LabelSmoother`` applied to each example alone.

    For causal LMs position t predicts labels_{t+1}: the LABELS are shifted (one -100 column appended),
    never the logits, which would copy the B·T·V logit tensor. The CE runs over the labelled tokens a chunk
    at a time (``_TokenCrossEntropy``), so no float32 copy or log-softmax of all the logits is ever held
    (HF's loss holds both). Float32/float64 logits of at most one chunk go to F.cross_entropy in one call:
    its log-softmax is then no larger than a chunk, and it is 2-3× faster than recomputing it on CPU.
    """
    if shift:
        labels = shifted_labels(labels, units)
    if logits.dtype in (torch.float32, torch.float64) and logits.numel() <= _LOGITS_PER_CHUNK:
        token_losses = _cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), label_smoothing
        ).view(labels.shape)
    else:
        token_losses = _TokenCrossEntropy.apply(logits, labels, label_smoothing)
    if units is not None and units.unit_of_token is not None:
        return units.mean_over_tokens(token_losses, labels != IGNORE_INDEX)
    counts = (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)
    return token_losses.sum(dim=1) / counts


def shifted_labels(labels: torch.Tensor, units: PrivacyUnits | None = None) -> torch.Tensor:
    """A causal LM's targets: position t predicts labels_{t+1} (one -100 column appended). In a packed row the
    last position of a record would predict the next record's first token: it gets -100."""
    labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if units is not None and units.unit_of_token is not None:
        unit = units.unit_of_token.to(labels.device)
        labels = labels.masked_fill(F.pad(unit[:, 1:] != unit[:, :-1], (0, 1)), IGNORE_INDEX)
    return labels


class _TokenCrossEntropy(torch.autograd.Function):
    """CE(logits_{i,t}, labels_{i,t}) in at least float32, shape ``labels.shape``, 0 where labels_{i,t} = -100.

    Our own chunking because F.cross_entropy on all B·T·V logits keeps their log-softmax for the backward
    (and upcasts nothing, so bf16/fp16 logits would first need a float32 copy of all of them), and HF's loss,
    which makes that copy, averages over the batch, mixing examples. Here only rows whose label is not -100
    are gathered, ``_LOGITS_PER_CHUNK`` logits at a time; the backward saves just the logits themselves and
    recomputes each chunk's CE to write its gradient into one B·T·V buffer.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
        batch, position = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
        targets = labels[batch, position]
        ctx.save_for_backward(logits, batch, position, targets)
        ctx.label_smoothing = label_smoothing
        losses = torch.zeros(
            labels.shape, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device
        )
        for rows in _chunks(targets.shape[0], logits.shape[-1]):
            index = (batch[rows], position[rows])
            losses[index] = _cross_entropy(logits[index], targets[rows], label_smoothing)
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, batch, position, targets = ctx.saved_tensors
        logits = logits.detach()
        grad = torch.zeros_like(logits)
        for rows in _chunks(targets.shape[0], logits.shape[-1]):
            index = (batch[rows], position[rows])
            with torch.enable_grad():
                chunk = _at_least_float32(logits[index]).requires_grad_()
                losses = _cross_entropy(chunk, targets[rows], ctx.label_smoothing)
                (chunk_grad,) = torch.autograd.grad(losses, chunk, grad_losses[index])
            grad[index] = chunk_grad.to(grad.dtype)
        return grad, None, None


def _chunks(rows: int, vocab: int) -> Iterator[slice]:
    """Consecutive slices of ``rows`` rows of ``vocab`` logits each, ``_LOGITS_PER_CHUNK`` logits (≥ 1 row) a slice."""
    step = max(1, _LOGITS_PER_CHUNK // vocab)
    return (slice(start, start + step) for start in range(0, rows, step))


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Per-row cross-entropy in at least float32 (0 for a row labelled -100)."""
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


def per_example_loss(
    model: nn.Module, inputs: dict[str, Any], label_smoothing: float = 0.0, units: PrivacyUnits | None = None
) -> torch.Tensor:
    """Run ``model`` on a batch (without letting it compute its batch loss) and return L_i, shape (B,), or one
    loss per packed record when ``units`` splits the rows into records."""
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
            logits, labels, shift=is_causal_lm(model), label_smoothing=label_smoothing, units=units
        )
    if units is not None and units.unit_of_token is not None:
        raise ValueError(
            "records packed into rows need a token loss (labels of shape (B, T)), not a sequence loss"
        )
    return sequence_loss_per_example(
        logits, labels, getattr(base.config, "problem_type", None), label_smoothing
    )
