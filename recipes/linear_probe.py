"""A private linear probe: a linear classifier trained with DP on a frozen pretrained encoder's pooled features.

The encoder is public and frozen, so each example's features are a fixed function of that example alone: training
the classifier on them under DP-SGD protects the example exactly as training it behind the frozen encoder would,
and the encoder then runs once per example instead of once per sampled batch (Tramèr & Boneh 2021, "Differentially
private learning needs better features"). The features live in memory only: like the text they come from, they
are private data.

Features are the encoder's pooled last hidden states scaled to unit L2 norm (sentence-transformers' own
normalisation), so each example's gradient is bounded whatever the text.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import AutoModel, DataCollatorWithPadding, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

ENCODER_BATCH = 128


class LinearProbeConfig(PretrainedConfig):
    """The probe's width and classes, and how its features were made (encoder, pooling, dtype)."""

    model_type = "hf_dp_linear_probe"

    def __init__(
        self,
        hidden_size: int = 768,
        encoder: str = "",
        pooling: str = "mean",
        encoder_dtype: str = "float32",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.encoder = encoder
        self.pooling = pooling
        self.encoder_dtype = encoder_dtype


class LinearProbe(PreTrainedModel):
    """logits = W f + b on unit-norm features f, zero-initialised."""

    config_class = LinearProbeConfig

    def __init__(self, config: LinearProbeConfig) -> None:
        super().__init__(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()
        with torch.no_grad():
            self.classifier.weight.zero_()
            self.classifier.bias.zero_()

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        logits = self.classifier(features)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def encoder_dtype(name: str) -> torch.dtype:
    """``auto``: bfloat16 where the CPU (or GPU) computes it natively, else float32."""
    if name == "auto":
        if torch.cuda.is_available():
            native = torch.cuda.is_bf16_supported()
        else:
            native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return torch.bfloat16 if native else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"unknown --encoder_dtype {name!r}; use auto, float32 or bfloat16")
    return dtypes[name]


def pooled_features(
    encoder: nn.Module, rows: Dataset, collator: DataCollatorWithPadding, pooling: str, label: str
) -> torch.Tensor:
    """(N, d) unit-norm pooled features of the tokenized ``rows``, in their order: the masked mean of the last
    hidden states (``mean``) or the first token's (``cls``), encoded in batches of similar length."""
    lengths = torch.tensor([len(ids) for ids in rows["input_ids"]])
    order = torch.argsort(lengths, stable=True).tolist()
    columns = [c for c in rows.column_names if c in ("input_ids", "attention_mask", "token_type_ids")]
    rows = rows.select_columns(columns)
    device = next(encoder.parameters()).device
    features = torch.empty(len(rows), encoder.config.hidden_size)
    started = time.time()
    with torch.inference_mode():
        for start in range(0, len(order), ENCODER_BATCH):
            index = order[start : start + ENCODER_BATCH]
            batch = {k: v.to(device) for k, v in collator([rows[i] for i in index]).items()}
            hidden = encoder(**batch).last_hidden_state.float()
            if pooling == "mean":
                weights = batch["attention_mask"].unsqueeze(-1).float()
                pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
            else:
                pooled = hidden[:, 0]
            features[index] = nn.functional.normalize(pooled, dim=-1).cpu()
    print(f"{label}: {len(rows)} rows encoded in {time.time() - started:.0f} s", flush=True)
    return features


def probe_datasets(
    model_name: str, tokenizer: Any, splits: dict[str, Dataset], pooling: str, dtype: torch.dtype
) -> tuple[dict[str, Dataset], int]:
    """Each tokenized split as torch-formatted ``{"features", "labels"}`` rows, and the feature width."""
    encoder = AutoModel.from_pretrained(model_name, dtype=dtype).eval()
    if torch.cuda.is_available():
        encoder = encoder.cuda()
    collator = DataCollatorWithPadding(tokenizer)
    out = {}
    for name, rows in splits.items():
        features = pooled_features(encoder, rows, collator, pooling, f"features of {name}")
        dataset = Dataset.from_dict({"features": features.numpy(), "labels": rows["labels"]})
        out[name] = dataset.with_format("torch")
    return out, encoder.config.hidden_size
