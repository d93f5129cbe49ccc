"""The per-example loss L_i: the model's own loss on example i alone.

For token losses, L_i is the mean over example i's non-ignored tokens (label -100 is ignored), so
each example's weight does not depend on the other examples in the batch (HF's batch loss averages
over all tokens in the batch, which mixes examples). Sequence classification follows HF's
``problem_type``: cross-entropy, mean squared error (regression) or mean binary cross-entropy.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.bart.modeling_bart import shift_tokens_right

from hf_dp.clipping.units import PrivacyUnits

IGNORE_INDEX = -100
_LOGITS_PER_CHUNK = 1 << 22  # logits taken into the cross-entropy at a time (16 MB in float32)


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
    """Whether position t predicts label t+1 (the labels are shifted): a transformers causal LM whose own loss is
    transformers' shifted causal-LM loss, or a class named like one outside transformers. A transformers causal LM
    whose own loss is the plain token cross-entropy on labels it does not shift (BartForCausalLM and the other
    seq2seq decoders', TrOCR, Whisper's decoder, XLNet, CPM-Ant) keeps that convention: position t predicts label t.
    Any other loss of its own is refused in one line."""
    cls = type(unwrap_model(model))
    name = cls.__name__
    if not (name in _CAUSAL_LM_CLASSES or name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        return False
    shifts = _shifts_its_labels(cls)
    if shifts is None:
        raise ValueError(
            f"{name} computes a loss of its own (not transformers' causal-LM loss nor a plain token cross-entropy), "
            "so which position predicts which label is the model's own convention: override "
            "compute_per_example_loss(model, inputs) to return one loss per example"
        )
    return shifts


# ``loss_fct(logits.view(-1, V), labels.view(-1))``: cross-entropy of position t against label t
_UNSHIFTED_TOKEN_LOSS = re.compile(r"loss_\w*\(logits\.view\(-1, [\w.]+(\(-1\))?\), labels\.view\(-1\)\)")


_DOCSTRING = re.compile(r'"""[\s\S]*?"""')


@functools.cache
def _shifts_its_labels(cls: type) -> bool | None:
    """True where a transformers causal LM's forward calls ``self.loss_function`` (its ForCausalLMLoss, which
    shifts), and for any class outside transformers; False where it takes a default ``CrossEntropyLoss()`` of its
    logits against the labels as they are (``_UNSHIFTED_TOKEN_LOSS``); None for any other loss of its own."""
    if not cls.__module__.startswith("transformers.models."):
        return True
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    if "self.loss_function(" in source:
        return True
    code = _DOCSTRING.sub("", source)
    if "CrossEntropyLoss()" in code and _UNSHIFTED_TOKEN_LOSS.search(code) and "shift" not in code:
        return False
    return None


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
    never the logits, which would copy the B·T·V logit tensor. The CE runs a chunk of rows at a time
    (``_TokenCrossEntropy``): no float32 copy and no log-softmax of all the logits is ever held (HF's loss,
    the stock Trainer's, holds both), only the logits and, in the backward, their gradient.
    """
    if shift:
        labels = shifted_labels(labels, units)
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

    With z a row of logits, y its label and lse = log Σ_v exp z_v: CE = (1 − ε)(lse − z_y) + ε(lse − mean_v z_v)
    (ε the label smoothing, as F.cross_entropy) and ∂CE/∂z = softmax(z) − (1 − ε)·onehot(y) − ε/V.

    Our own because F.cross_entropy keeps a log-softmax of all B·T·V logits for its backward (and needs a
    float32 copy of bf16/fp16 logits), and HF's loss, which does both, averages over the batch, mixing
    examples. Here the forward goes ``_LOGITS_PER_CHUNK`` logits at a time and keeps only lse per row; the
    backward writes exp(z − lse) straight into the gradient buffer, chunk by chunk, and finishes it in place.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        targets = labels.reshape(-1, 1).to(flat.device)
        labelled = targets[:, 0] != IGNORE_INDEX
        targets = targets.clamp(min=0)  # an ignored row's target is never read: its loss and gradient are 0
        # torch.promote_types(logits.dtype, torch.float32) without a call through torch's dispatcher
        wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lse = torch.empty(flat.shape[0], dtype=wide, device=flat.device)
        losses = torch.empty_like(lse)
        for rows in _chunks(flat.shape[0], flat.shape[1]):
            z = flat[rows].to(wide)
            torch.logsumexp(z, dim=-1, out=lse[rows])  # written in place: no copy
            torch.sub(lse[rows], z.gather(1, targets[rows])[:, 0], out=losses[rows])
            if label_smoothing:
                losses[rows] *= 1 - label_smoothing
                losses[rows] += label_smoothing * (lse[rows] - z.mean(dim=-1))
        ctx.save_for_backward(logits, targets, labelled, lse)
        ctx.label_smoothing = label_smoothing
        return losses.where(labelled, 0.0).view(labels.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, labelled, lse = ctx.saved_tensors
        flat = logits.detach().reshape(-1, logits.shape[-1])
        smoothing, vocab = ctx.label_smoothing, flat.shape[1]
        # where() reads a broadcast gradient (a sum's backward) as it is; reshaping it first would copy it
        weights = torch.where(labelled.view(grad_losses.shape), grad_losses.to(lse.dtype), 0.0).view(-1, 1)
        grad = torch.empty(flat.shape, dtype=logits.dtype, device=flat.device)
        in_place = grad.dtype == lse.dtype  # else each chunk is finished in float32, then cast
        for rows in _chunks(flat.shape[0], vocab):
            g = grad[rows] if in_place else torch.empty(grad[rows].shape, dtype=lse.dtype, device=grad.device)
            torch.sub(flat[rows], lse[rows, None], out=g)
            g.exp_().mul_(weights[rows])  # w·softmax(z)
            if smoothing:
                g.sub_(weights[rows] * (smoothing / vocab))
            g.scatter_add_(1, targets[rows], weights[rows] * -(1 - smoothing))
            g.masked_fill_(~labelled[rows, None], 0.0)  # 0 even where an ignored row's logits overflowed
            if not in_place:
                grad[rows] = g
        return grad.view(logits.shape), None, None


def _chunks(rows: int, vocab: int) -> Iterator[slice]:
    """Consecutive slices of ``rows`` rows of ``vocab`` logits each, ``_LOGITS_PER_CHUNK`` logits (≥ 1 row) a slice."""
    step = max(1, _LOGITS_PER_CHUNK // vocab)
    return (slice(start, start + step) for start in range(0, rows, step))


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


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
    _check_sequence_labels(logits, labels, problem_type)
    logits = _at_least_float32(logits)
    if problem_type == "regression":
        return F.mse_loss(
            logits.view(labels.shape[0], -1),
            labels.to(logits.dtype).view(labels.shape[0], -1),
            reduction="none",
        ).mean(dim=1)
    if problem_type == "single_label_classification":
        return F.cross_entropy(
            logits.view(-1, num_labels),
            labels.view(-1).long(),
            reduction="none",
            label_smoothing=label_smoothing,
        )
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(dim=1)


def _check_sequence_labels(logits: torch.Tensor, labels: torch.Tensor, problem_type: str) -> None:
    """One line where the labels cannot be the targets of ``problem_type`` (else a shape or dtype error deep in the
    loss): one class index per row for single-label classification, a (B, num_labels) target for multi-label."""
    rows, num_labels = logits.shape[0], logits.shape[-1]
    if problem_type == "single_label_classification":
        if labels.is_floating_point() or labels.numel() != rows:
            raise ValueError(
                f"the batch has labels of shape {tuple(labels.shape)} and dtype {labels.dtype}, but single-label "
                f"classification takes one integer class per row, shape ({rows},): give each example its class "
                "index, or set the model's config.problem_type to 'multi_label_classification' or 'regression'"
            )
    elif problem_type == "multi_label_classification" and labels.shape != logits.shape:
        raise ValueError(
            f"the batch has labels of shape {tuple(labels.shape)}, but multi-label classification takes a 0/1 "
            f"target per class, shape ({rows}, {num_labels}): give multi-hot float labels, or one integer class index "
            "per row (int64, not float) for single-label classification"
        )


def decoder_inputs_from_labels(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The decoder_input_ids an encoder-decoder model makes from its labels when given none: its own
    ``prepare_decoder_input_ids_from_labels``, else the labels shifted right with decoder_start_token_id first and
    -100 as pad_token_id (BART's, Blenderbot's and M2M100's ``shift_tokens_right``)."""
    if hasattr(model, "prepare_decoder_input_ids_from_labels"):
        return model.prepare_decoder_input_ids_from_labels(labels=labels)
    start, pad = model.config.decoder_start_token_id, model.config.pad_token_id
    if start is None or pad is None:
        raise ValueError(
            f"{type(model).__name__} needs decoder_input_ids: put them in the batch, or set the config's "
            f"decoder_start_token_id ({start}) and pad_token_id ({pad}) to build them from the labels"
        )
    return shift_tokens_right(labels, pad, start)


def _after_virtual_tokens(
    model: nn.Module, labels: torch.Tensor, positions: int, packed: bool
) -> torch.Tensor:
    """The labels of rows that peft's prompt tuning or p-tuning prefixed with virtual tokens, which predict nothing
    (``IGNORE_INDEX``), as peft's own loss labels them; the labels as they are for any other model."""
    while getattr(model, "active_peft_config", None) is None and isinstance(
        getattr(model, "module", None), nn.Module
    ):
        model = model.module  # under DDP / DeepSpeed
    config = getattr(model, "active_peft_config", None)
    virtual = getattr(config, "num_virtual_tokens", 0) if getattr(config, "is_prompt_learning", False) else 0
    if not virtual or virtual + labels.shape[1] != positions:
        return labels
    if packed:
        raise ValueError(
            f"peft's {config.peft_type} puts virtual tokens before each row, which packs records into rows: pad "
            "each example in its own row instead (DataCollatorWithPadding)"
        )
    return torch.cat([labels.new_full((labels.shape[0], virtual), IGNORE_INDEX), labels], dim=1)


def per_example_loss(
    model: nn.Module, inputs: dict[str, Any], label_smoothing: float = 0.0, units: PrivacyUnits | None = None
) -> torch.Tensor:
    """Run ``model`` on a batch (without letting it compute its batch loss) and return L_i, shape (B,), or one
    loss per packed record when ``units`` splits the rows into records."""
    inputs = dict(inputs)
    labels = inputs.pop("labels", None)
    if labels is None:
        raise ValueError(
            f"the batch has no 'labels' (its keys: {sorted(inputs)}): DP training needs labels to form a "
            "per-example loss; a language model's collator must copy input_ids into labels (e.g. "
            "DataCollatorForLanguageModeling(tokenizer, mlm=False)); other targets (a question-answering head's "
            "start/end positions) need compute_per_example_loss overridden"
        )
    base = unwrap_model(model)
    if getattr(base, "config", None) is None:
        raise ValueError(
            f"{type(base).__name__} is not a transformers model, so its per-example loss is unknown: override "
            "compute_per_example_loss(model, inputs) to return one loss per example"
        )
    packed = units is not None and units.unit_of_token is not None
    if packed and getattr(
        base.config, "is_encoder_decoder", False
    ):  # else a shape error in the records' means
        raise ValueError(
            f"records packed into rows (a collator's position_ids, e.g. DataCollatorWithFlattening) reach "
            f"{type(base).__name__}, an encoder-decoder model, whose labels are decoder tokens outside the packed "
            "row; pad each example in its own row instead (DataCollatorForSeq2Seq)"
        )
    if (
        getattr(base.config, "is_encoder_decoder", False)
        and "decoder_input_ids" not in inputs
        and "decoder_inputs_embeds" not in inputs
    ):
        inputs["decoder_input_ids"] = decoder_inputs_from_labels(base, labels)
    outputs = model(**inputs)
    if isinstance(outputs, dict) and "logits" not in outputs:  # else a KeyError from the model's output class
        raise ValueError(
            f"{type(base).__name__} returns no logits (its outputs: {list(outputs)}), so its per-example loss is "
            "unknown: load the model with its task head (AutoModelForCausalLM, AutoModelForSequenceClassification, "
            "...), not AutoModel, or override compute_per_example_loss(model, inputs)"
        )
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    if labels.shape[0] != logits.shape[0]:
        raise ValueError(
            f"the batch has labels for {labels.shape[0]} rows and the model returns logits for {logits.shape[0]}: "
            "the collator must give every row its labels"
        )
    if logits.dim() == 3 and labels.dim() == 2:
        labels = _after_virtual_tokens(model, labels, logits.shape[1], packed)
        if logits.shape[1] != labels.shape[1]:
            raise ValueError(
                f"the model returns logits for {logits.shape[1]} positions per row and the batch has labels for "
                f"{labels.shape[1]}: give labels for every position the model predicts"
            )
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
