"""The first micro-batch against the model it feeds: rows of tokens (batch, length), token ids inside the input
embedding, token type ids inside the token type table, sequences inside a learned position table, integer labels
inside the model's classes.

Each mismatch otherwise fails deep inside the forward or the loss (``index out of range in self``, ``Target 2
is out of bounds``; on a GPU a device-side assert that ends the process). Checked once, on the first micro-batch,
before any update: the few host reads it takes never recur in a steady-state step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100  # the label the token loss skips
NEXT_SENTENCE_CLASSES = 2  # BERT's next-sentence head: is next (0), is random (1)
POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")  # learned absolute positions, by name
TOKEN_TYPE_TABLES = ("token_type_embeddings",)  # BERT-style segment embeddings, by name


def check_inputs_fit(model: nn.Module, inputs: dict[str, Any]) -> None:
    """One line naming the first mismatch between ``inputs`` and ``model`` (the model under its trainer wrappers;
    a peft model is read through to its base)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    ids = inputs.get("input_ids")
    labels = inputs.get("labels")
    if isinstance(ids, torch.Tensor):
        _check_rows(ids, name)
    choices = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 3 else None
    if isinstance(ids, torch.Tensor) and ids.numel():
        _check_token_ids(base, ids, name)
        decoder_length = None
        if getattr(getattr(base, "config", None), "is_encoder_decoder", False) and isinstance(
            labels, torch.Tensor
        ):
            decoder_length = labels.shape[-1] if labels.dim() == 2 else None
        _check_positions(base, ids.shape[-1], decoder_length, inputs.get("position_ids"), name)
    token_types = inputs.get("token_type_ids")
    if isinstance(token_types, torch.Tensor) and token_types.numel():
        _check_token_types(base, token_types, name)
    if isinstance(labels, torch.Tensor) and labels.numel() and not labels.is_floating_point():
        _check_labels(base, labels, name, choices)


def _check_rows(ids: torch.Tensor, name: str) -> None:
    """Rows of at least one token, of shape (batch, length), or (batch, choices, length) for a multiple-choice
    model, which folds each example's choices into rows of its own batch (privacy_units.choice_units)."""
    # else a reshape error deep in the clipping
    if ids.dim() in (2, 3) and ids.shape[0] and not ids.shape[-1]:
        raise ValueError(
            f"input_ids has shape {tuple(ids.shape)}: the batch's rows hold no token (every example was tokenised "
            "to nothing, or truncated to max_length 0); drop empty rows from the dataset"
        )
    if ids.dim() > 2 and not (ids.dim() == 3 and name.endswith("ForMultipleChoice")):
        raise ValueError(
            f"input_ids has shape {tuple(ids.shape)}, but {name} takes rows of tokens (batch, length): only a "
            "*ForMultipleChoice model takes (batch, choices, length)"
        )


def _check_token_types(model: nn.Module, token_types: torch.Tensor, name: str) -> None:
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or module_name.rsplit(".", 1)[-1] not in TOKEN_TYPE_TABLES:
            continue
        rows = module.num_embeddings
        low, high = int(token_types.min()), int(token_types.max())
        if low < 0 or high >= rows:
            raise ValueError(
                f"token_type_ids holds type {high if high >= rows else low} but {name}'s token type table "
                f"({module_name}) has {rows} rows (config.type_vocab_size): give segments 0..{rows - 1}"
            )


def _check_token_ids(model: nn.Module, ids: torch.Tensor, name: str) -> None:
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return
    if not isinstance(embedding, nn.Embedding):
        return
    rows = embedding.num_embeddings
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= rows:
        raise ValueError(
            f"input_ids holds token id {high if high >= rows else low} but {name}'s input embedding has {rows} "
            "rows: the tokenizer does not match the model (after adding tokens, call "
            "model.resize_token_embeddings(len(tokenizer)))"
        )


def _position_limit(table: nn.Embedding) -> int:
    """How many positions a learned table holds: OPT's and BART's tables skip ``offset`` rows, RoBERTa-style
    ones count from ``padding_idx + 1``."""
    offset = getattr(table, "offset", None)
    if not isinstance(offset, int):
        offset = 0 if table.padding_idx is None else table.padding_idx + 1
    return table.num_embeddings - offset


def _check_positions(
    model: nn.Module, length: int, decoder_length: int | None, position_ids: Any, name: str
) -> None:
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or module_name.rsplit(".", 1)[-1] not in POSITION_TABLES:
            continue
        needed = decoder_length if decoder_length is not None and "decoder" in module_name else length
        if isinstance(position_ids, torch.Tensor) and position_ids.numel() and "decoder" not in module_name:
            needed = int(position_ids.max()) + 1
        limit = _position_limit(module)
        if needed > limit:
            raise ValueError(
                f"the batch has sequences of {needed} positions but {name}'s learned position table "
                f"({module_name}) holds {limit}: truncate the inputs to {limit} tokens (e.g. the tokenizer's "
                "max_length)"
            )


def _classes(model: nn.Module, labels: torch.Tensor, name: str, choices: int | None = None) -> int | None:
    """How many classes the labels index: a sequence classifier's ``num_labels`` (one label per row; next-sentence
    prediction's 2; a multiple-choice model's ``choices``), the output layer's width for token labels (a language
    model's vocabulary, a token classifier's classes)."""
    config = getattr(model, "config", None)
    if labels.dim() == 1 and choices is not None:
        return choices
    if labels.dim() == 1 and name.endswith("ForNextSentencePrediction"):
        return NEXT_SENTENCE_CLASSES
    if labels.dim() == 1:
        classes = getattr(config, "num_labels", None)
        single_label = getattr(config, "problem_type", None) in (None, "single_label_classification")
        sequence_classifier = name.endswith("ForSequenceClassification")
        return classes if sequence_classifier and single_label and classes and classes > 1 else None
    if labels.dim() != 2:
        return None
    if name.endswith("ForTokenClassification"):
        return getattr(config, "num_labels", None)
    try:
        output = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return output.out_features if isinstance(output, nn.Linear) else None


def _check_labels(model: nn.Module, labels: torch.Tensor, name: str, choices: int | None = None) -> None:
    classes = _classes(model, labels, name, choices)
    if classes is None:
        return
    outside = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= classes))
    if bool(outside.any()):
        value = int(labels[outside][0])
        skip = f", or {IGNORE_INDEX} to skip a token" if labels.dim() == 2 else ""
        raise ValueError(
            f"the batch has label {value} but {name} predicts {classes} classes (labels 0..{classes - 1}{skip}): "
            f"map the dataset's labels to 0..{classes - 1}"
            + (", or give the model num_labels" if name.endswith("ForSequenceClassification") else "")
        )
