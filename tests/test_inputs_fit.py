"""The first micro-batch is checked to fit the model (hf_dp/inputs_fit.py): a token id outside the vocabulary, a
token type outside the type table, multiple-choice rows (batch, choices, length), a sequence longer than a learned
position table and a label outside the classes are refused in one line before the first update; every family's own batch passes; and the position limit is the table's real one (the model runs at
the limit and fails one past it)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import BertForNextSentencePrediction

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.inputs_fit import check_inputs_fit
from tests import models
from tests.test_families import FAMILIES
from tests.test_flattened_rows import bart, opt


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_batch_fits(family):
    build, batch, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    check_inputs_fit(build(), batch())


def _classifier_batch(labels: list[int]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.full((len(labels), 4), 5), "labels": torch.tensor(labels)}


def test_token_id_outside_the_vocabulary_is_refused():
    batch = models.token_batch()
    batch["input_ids"][2, 1] = models.VOCAB
    with pytest.raises(
        ValueError, match=f"token id {models.VOCAB} but GPT2LMHeadModel's input embedding has"
    ):
        check_inputs_fit(models.gpt2(), batch)


def test_labels_outside_the_classes_are_refused():
    model = models.bert_classifier(num_labels=3)
    check_inputs_fit(model, _classifier_batch([0, 1, 2]))
    with pytest.raises(ValueError, match="label 3 but BertForSequenceClassification predicts 3 classes"):
        check_inputs_fit(model, _classifier_batch([0, 3, 1]))
    with pytest.raises(ValueError, match="label -1 but"):
        check_inputs_fit(model, _classifier_batch([-1, 0, 1]))
    regression = models.bert_classifier(num_labels=1)  # integer targets of a regression head: not classes
    check_inputs_fit(regression, _classifier_batch([0, 7, 1]))
    next_sentence = BertForNextSentencePrediction(models.bert_classifier().config)
    check_inputs_fit(next_sentence, _classifier_batch([0, 1, 1]))
    with pytest.raises(
        ValueError, match=r"label 2 but BertForNextSentencePrediction predicts 2 classes .*0..1$"
    ):
        check_inputs_fit(next_sentence, _classifier_batch([0, 2, 1]))


def test_token_labels_outside_the_vocabulary_are_refused():
    batch = models.token_batch()
    check_inputs_fit(models.gpt2(), batch)  # -100 is skipped, not a class
    batch["labels"][0, 3] = models.VOCAB + 5
    with pytest.raises(
        ValueError, match=f"label {models.VOCAB + 5} but GPT2LMHeadModel predicts {models.VOCAB}"
    ):
        check_inputs_fit(models.gpt2(), batch)


def _runs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> bool:
    try:
        with torch.no_grad():
            model(**batch)
    except (IndexError, RuntimeError):  # a table lookup past its end, or a buffer expanded past it
        return False
    return True


@pytest.mark.parametrize(
    "build, positions",
    [
        (models.gpt2, 32),  # wpe: n_positions rows
        (models.bert_classifier, 32),
        (models.roberta_classifier, 38),  # 40 rows, counted past padding_idx 1
        (opt, 32),  # 34 rows, offset 2
        (bart, 32),  # encoder and decoder tables, offset 2
    ],
)
def test_position_limit_is_the_models_own(build, positions):
    """At the limit the model runs and the check passes; one token more, the model fails and the check refuses."""
    model = build().eval()
    for length, fits in ((positions, True), (positions + 1, False)):
        ids = torch.full((2, length), 5)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if model.config.is_encoder_decoder:
            batch["decoder_input_ids"] = torch.full((2, 3), 5)
        assert _runs(model, batch) == fits, (type(model).__name__, length)
        checked = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if fits:
            check_inputs_fit(model, checked)
        else:
            with pytest.raises(
                ValueError, match=f"sequences of {length} positions .* holds {positions}: truncate"
            ):
                check_inputs_fit(model, checked)


def test_decoder_labels_longer_than_the_decoder_table_are_refused():
    batch = {"input_ids": torch.full((2, 8), 5), "labels": torch.full((2, 40), 5)}
    with pytest.raises(ValueError, match=r"sequences of 40 positions .*decoder\.embed_positions"):
        check_inputs_fit(bart(), batch)


def test_trainer_refuses_before_the_first_update(tmp_path):
    """Through DPTrainer: the over-long batch stops the run at its first micro-batch, the weights untouched."""
    model = models.gpt2()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rows = [[3 + i % 50 for i in range(40)]] * 8
    args = DPTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        noise_multiplier=1.0,
        per_sample_max_grad_norm=1.0,
        report_to=[],
        use_cpu=True,
    )
    trainer = DPTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows})
    )
    with pytest.raises(
        ValueError, match="sequences of 40 positions but GPT2LMHeadModel's learned position table"
    ):
        trainer.train()
    assert trainer.state.global_step == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_multiple_choice_rows_fit_a_multiple_choice_head_only():
    """(batch, choices, length) rows: a multiple-choice head takes them (privacy_units.choice_units folds each
    example's choices into one unit), with labels among its choices; any other head refuses them in one line."""
    from transformers import BertConfig, BertForMultipleChoice

    config = BertConfig(**models._ENCODER, pad_token_id=models.PAD, max_position_embeddings=32)
    batch = {"input_ids": torch.full((2, 3, 4), 5), "labels": torch.tensor([0, 2])}
    check_inputs_fit(BertForMultipleChoice(config), batch)
    with pytest.raises(
        ValueError, match=r"the batch has label 3 but BertForMultipleChoice predicts 3 classes"
    ):
        check_inputs_fit(BertForMultipleChoice(config), {**batch, "labels": torch.tensor([0, 3])})
    with pytest.raises(
        ValueError,
        match=r"input_ids has shape \(2, 3, 4\), but BertForSequenceClassification takes rows of tokens",
    ):
        check_inputs_fit(models.bert_classifier(num_labels=3), batch)


def test_token_type_ids_outside_the_type_table_are_refused():
    model = models.bert_classifier(num_labels=3)
    batch = _classifier_batch([0, 1, 2])
    batch["token_type_ids"] = torch.ones_like(batch["input_ids"])
    check_inputs_fit(model, batch)  # segments 0 and 1: BERT's two types
    batch["token_type_ids"][1, 2] = 2  # was: IndexError "index out of range in self" from the embedding
    with pytest.raises(
        ValueError, match=r"token_type_ids holds type 2 but BertForSequenceClassification's token type table"
    ):
        check_inputs_fit(model, batch)


def test_rows_without_a_token_are_refused():
    batch = {
        "input_ids": torch.zeros((4, 0), dtype=torch.long),
        "labels": torch.zeros((4, 0), dtype=torch.long),
    }
    with pytest.raises(ValueError, match=r"input_ids has shape \(4, 0\): the batch's rows hold no token"):
        check_inputs_fit(models.gpt2(), batch)  # was: "cannot reshape tensor of 0 elements" in the clipping
    check_inputs_fit(models.gpt2(), {"input_ids": torch.zeros((0, 5), dtype=torch.long)})  # no example drawn
