"""Which position predicts which label is the model's own convention: transformers' causal LMs whose loss is
``self.loss_function`` shift their labels (position t predicts label t + 1); those whose loss is a plain
``CrossEntropyLoss()`` of their logits against the labels as given (the seq2seq decoders' ``*ForCausalLM``, TrOCR,
Whisper's decoder, XLNet) do not; any other loss of its own is refused in one line. Each per-example loss averages,
token-weighted, to the model's own loss of the batch, and a DP step equals the brute-force clipped sum."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.losses import is_causal_lm, per_example_loss
from tests import models, oracle
from tests.test_checkpointing import checkpointed_steps
from tests.test_engine import assert_close
from tests.trainer_utils import make_trainer

V, PAD = models.VOCAB, models.PAD
DECODER = {
    "vocab_size": V,
    "d_model": 16,
    "decoder_layers": 1,
    "decoder_attention_heads": 2,
    "decoder_ffn_dim": 32,
}
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}


def bart() -> T.PreTrainedModel:
    return T.BartForCausalLM(
        T.BartConfig(**DECODER, **NO_DROPOUT, max_position_embeddings=32, pad_token_id=PAD)
    )


def trocr() -> T.PreTrainedModel:
    config = T.TrOCRConfig(
        **DECODER,
        **NO_DROPOUT,
        max_position_embeddings=32,
        pad_token_id=PAD,
        use_learned_position_embeddings=True,
    )
    return T.TrOCRForCausalLM(config)


def whisper() -> T.PreTrainedModel:
    encoder = {"encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32}
    config = T.WhisperConfig(**DECODER, **encoder, **NO_DROPOUT, max_target_positions=32, pad_token_id=PAD)
    return T.WhisperForCausalLM(config)


def xlnet() -> T.PreTrainedModel:
    return T.XLNetLMHeadModel(
        T.XLNetConfig(vocab_size=V, d_model=16, n_layer=1, n_head=2, d_inner=32, dropout=0.0)
    )


# model: (builder, whether its own loss shifts the labels, whether hf_dp clips it: XLNet's relative attention
# takes position embeddings it returns several tensors from, refused by the clipping engine in one line)
UNSHIFTED = {
    "bart": (bart, True),
    "trocr": (trocr, True),
    "whisper": (whisper, True),
    "xlnet": (xlnet, False),
}


def _without_cross_attention(model: T.PreTrainedModel) -> T.PreTrainedModel:
    """A decoder run alone: its cross-attention sees no encoder output and gets no gradient."""
    for name, param in model.named_parameters():
        if "encoder_attn" in name:
            param.requires_grad_(False)
    return model


@pytest.mark.parametrize("name", list(UNSHIFTED))
def test_a_causal_lm_whose_own_loss_is_unshifted_keeps_its_convention(name: str) -> None:
    build, clipped = UNSHIFTED[name]
    torch.manual_seed(0)
    model = _without_cross_attention(build().double().train())
    batch = models.token_batch()
    assert is_causal_lm(model) is False
    own = model(**batch).loss
    ours = per_example_loss(model, dict(batch))
    counted = (batch["labels"] != -100).sum(dim=1)
    torch.testing.assert_close((ours * counted).sum() / counted.sum(), own)
    shifted = model(**{**batch, "labels": batch["labels"].roll(-1, dims=1)}).loss
    assert not torch.isclose(shifted, own)  # the two conventions differ on this batch
    if not clipped:
        return
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = norms.median().item()  # some examples clipped, some not
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    step = clipped_step(ClippingEngine(model), model, Backend())
    for ours_sum in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours_sum, reference, rtol=1e-9, floor=1e-6)


def test_a_shifted_causal_lm_s_per_example_losses_average_to_its_own_loss() -> None:
    gpt2, batch = models.gpt2().eval(), models.token_batch()
    assert is_causal_lm(gpt2) is True
    own = gpt2(**batch).loss
    ours = per_example_loss(gpt2, dict(batch))
    counted = (batch["labels"][:, 1:] != -100).sum(dim=1)
    torch.testing.assert_close((ours * counted).sum() / counted.sum(), own)


def test_a_causal_lm_with_a_loss_of_its_own_is_refused_in_one_line(tmp_path) -> None:
    """XLM's head computes its own loss (an optional adaptive softmax): which position predicts which label is not
    known, so training stops before the first step."""
    config = T.XLMConfig(vocab_size=V, emb_dim=16, n_layers=1, n_heads=2, dropout=0.0, attention_dropout=0.0)
    trainer = make_trainer(tmp_path, model=T.XLMWithLMHeadModel(config), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="XLMWithLMHeadModel computes a loss of its own") as info:
        trainer.train()
    assert "\n" not in str(info.value) and trainer.state.global_step == 0
