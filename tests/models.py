"""Tiny random Hugging Face models and batches (the brute-force reference is tests/oracle.py)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
    T5Config,
    T5ForConditionalGeneration,
)

from tests import oracle

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


def modernbert_classifier(num_labels: int = 3) -> nn.Module:
    """A tiny ModernBERT: its classification head normalises the pooled (B, d) output (a LayerNorm without
    positions)."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    sizes = {"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32}
    sizes |= {"global_attn_every_n_layers": 1, "local_attention": 8, "max_position_embeddings": 32}
    config = ModernBertConfig(vocab_size=VOCAB, pad_token_id=PAD, num_labels=num_labels, **sizes)
    return ModernBertForSequenceClassification(config)


def deberta_classifier(num_labels: int = 3) -> nn.Module:
    """A tiny DeBERTa-v2 with disentangled attention over relative embeddings shared by all examples."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    relative = {"relative_attention": True, "position_buckets": 8, "max_relative_positions": 16}
    config = DebertaV2Config(
        **_ENCODER,
        **relative,
        num_labels=num_labels,
        pad_token_id=PAD,
        max_position_embeddings=32,
        pos_att_type=["p2c", "c2p"],
    )
    return DebertaV2ForSequenceClassification(config)


# A tiny decoder's config fields (Llama's names, which most decoder families share).
DECODER_SIZES = {
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
}


def llama(**sizes) -> LlamaForCausalLM:
    """A tiny Llama (GQA); ``sizes`` override its LlamaConfig fields."""
    return LlamaForCausalLM(LlamaConfig(**{**DECODER_SIZES, **sizes}))


def gemma() -> GemmaForCausalLM:
    """A tiny Gemma: its RMSNorms compute x̂ ⊙ (1 + w), its head is tied to the scaled embeddings."""
    return GemmaForCausalLM(GemmaConfig(**DECODER_SIZES, head_dim=8))


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


def mixtral() -> MixtralForCausalLM:
    """A tiny Mixtral: its MoE layers (router and experts) take the rows of all examples flattened."""
    return MixtralForCausalLM(MixtralConfig(**DECODER_SIZES, num_local_experts=4, num_experts_per_tok=2))


def mixtral_lora_attention() -> nn.Module:
    """The tiny Mixtral with its MoE layers frozen: LoRA on the attention projections only."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return get_peft_model(mixtral(), LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))


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


# The brute-force reference is tests/oracle.py; these two names stay for tests/test_checkpointing.py (edited in
# parallel, to be renamed), and are the oracle itself, not another copy of it.
brute_force = oracle.per_example
brute_force_combined = oracle.per_example
