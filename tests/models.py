"""Tiny random Hugging Face models and batches, and the brute-force per-example reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_dp.losses import per_example_loss

VOCAB, PAD = 64, 0


def gpt2(**overrides) -> GPT2LMHeadModel:
    config = dict(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=PAD,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(GPT2Config(**{**config, **overrides}))


# The encoder size shared by the tiny BERT and RoBERTa models (dropout off so brute force can compare).
_ENCODER = dict(
    num_hidden_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    intermediate_size=32,
    vocab_size=VOCAB,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def bert_classifier(num_labels: int = 3) -> BertForSequenceClassification:
    config = BertConfig(**_ENCODER, num_labels=num_labels, pad_token_id=PAD, max_position_embeddings=32)
    return BertForSequenceClassification(config)


def bert_mlm() -> BertForMaskedLM:
    return BertForMaskedLM(BertConfig(**_ENCODER, pad_token_id=PAD, max_position_embeddings=32))


def roberta_classifier(num_labels: int = 2) -> RobertaForSequenceClassification:
    config = RobertaConfig(
        **_ENCODER,
        num_labels=num_labels,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        max_position_embeddings=40,
    )
    return RobertaForSequenceClassification(config)


def llama(**sizes) -> LlamaForCausalLM:
    """A tiny Llama (GQA); ``sizes`` override its LlamaConfig fields."""
    return LlamaForCausalLM(
        LlamaConfig(
            **{
                "num_hidden_layers": 2,
                "hidden_size": 16,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "intermediate_size": 32,
                "vocab_size": VOCAB,
                "pad_token_id": PAD,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "max_position_embeddings": 32,
                **sizes,
            }
        )
    )


def t5(freeze_relative_bias: bool = True) -> T5ForConditionalGeneration:
    """T5 (RMSNorm "T5LayerNorm", encoder-decoder); its relative attention bias is shared by all examples."""
    model = T5ForConditionalGeneration(
        T5Config(
            num_layers=1,
            num_decoder_layers=1,
            d_model=16,
            d_kv=8,
            num_heads=2,
            d_ff=32,
            vocab_size=VOCAB,
            pad_token_id=PAD,
            eos_token_id=1,
            decoder_start_token_id=PAD,
            dropout_rate=0.0,
        )
    )
    if freeze_relative_bias:
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.requires_grad_(False)
    return model


def gpt2_lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        gpt2(),
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0, fan_in_fan_out=True
        ),
    )


def token_batch(
    batch: int = 5, length: int = 10, seed: int = 0, causal: bool = True
) -> dict[str, torch.Tensor]:
    """Right-padded token batch with ragged lengths, pad labels and some extra ignored labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    lengths = torch.randint(3, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :2] = -100
    if not causal:
        labels = labels.masked_fill(torch.rand(batch, length, generator=g) < 0.5, -100)
        labels[:, 0] = ids[:, 0]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def classification_batch(
    num_labels: int, batch: int = 5, length: int = 10, seed: int = 0, pad: int = PAD
) -> dict[str, torch.Tensor]:
    out = token_batch(batch, length, seed)
    out["input_ids"] = out["input_ids"].masked_fill(out["attention_mask"] == 0, pad)
    out["labels"] = torch.arange(batch) % num_labels
    return out


def seq2seq_batch(batch: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    source = token_batch(batch, 8, seed)
    target = token_batch(batch, 6, seed + 1)
    return {
        "input_ids": source["input_ids"],
        "attention_mask": source["attention_mask"],
        "labels": target["labels"],
    }


def brute_force(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    max_norm: float,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] = per_example_loss,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_i clip(∇L_i) with one backward per example (each example run alone), and the norms ‖∇L_i‖."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    norms = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(loss_fn(model, one)[0], [p for _, p in named], allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, named, strict=True)]
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        norms.append(norm)
        factor = min(1.0, max_norm / (norm.item() + 1e-6))
        for (n, _), g in zip(named, grads, strict=True):
            total[n] += factor * g.double()
    return total, torch.stack(norms)


def brute_force_combined(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    max_norm: float,
    evaluations: tuple = ((1.0, None),),
    scale: dict | None = None,
    clipping_fn: str = "abadi",
    mask: torch.Tensor | None = None,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] = per_example_loss,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_i c_i u_i with u_i = Σ_e w_e ∇L_i(θ + shift_e), and the norms ‖s ⊙ u_i‖, by one backward per example
    and evaluation (each example run alone), then the combination, scale (Parameter → dense tensor or
    FactoredScale), clip (abadi or automatic, as in the engine) and mask, written out explicitly.
    ``evaluations``: (weight, {Parameter: shift} or None) pairs."""
    from hf_dp.clipping.geometry import dense_scale

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    scales = {id(p): dense_scale(s).double() for p, s in (scale or {}).items()}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    norms = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        combined = [torch.zeros_like(p, dtype=torch.float64) for _, p in named]
        for weight, shift in evaluations:
            saved = {p: p.detach().clone() for p in (shift or {})}
            with torch.no_grad():
                for p, delta in (shift or {}).items():
                    p.add_(delta)
            grads = torch.autograd.grad(loss_fn(model, one)[0], [p for _, p in named], allow_unused=True)
            with torch.no_grad():
                for p, value in saved.items():
                    p.copy_(value)
            for k, (g, (_, p)) in enumerate(zip(grads, named, strict=True)):
                combined[k] += weight * (torch.zeros_like(p) if g is None else g).double()
        norm = torch.sqrt(
            sum((u * scales.get(id(p), 1.0)).pow(2).sum() for u, (_, p) in zip(combined, named, strict=True))
        )
        norms.append(norm)
        if clipping_fn == "abadi":
            factor = min(1.0, max_norm / (norm.item() + 1e-6))
        else:
            factor = max_norm / (norm.item() + 0.01)
        factor *= 1.0 if mask is None else float(mask[i])
        for (n, _), u in zip(named, combined, strict=True):
            total[n] += factor * u
    return total, torch.stack(norms)
