"""No example's gradient may depend on the rest of its batch: the first step checks, for the examples padding
changes most, that the loss and gradient norm an example gives in its batch are those it gives alone, and refuses
in one line naming the likely cause (checks.check_examples_alone). The measured sensitivity of the cases refused
here is above C (one noise-free step on D and on D plus one row, ‖S(D + x) − S(D)‖ / C, against 1.000 C for the
controls)."""

from __future__ import annotations

import pytest
import torch

from hf_dp import DPTrainer
from tests import models
from tests.trainer_utils import TokenRows, left_pad_collate, make_trainer, pad_collate


class LabelledRows(TokenRows):
    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": i % 3}


def _padded_without_mask(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad input_ids and pass no attention_mask: a bidirectional encoder then attends to the padding."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), length), models.PAD)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
    return {"input_ids": ids, "labels": torch.tensor([e["labels"] for e in examples])}


def _others_moved(tmp_path, collator, model_fn, dataset) -> float:
    """‖S(D + x) − S(D) − S({x})‖ / C for one noise-free SGD step at lr 1 with every example clipped, the check
    off: how far the four shortest rows' clipped terms move when the longest row x joins their batch (0 when
    each example's term is its own; then S(D + x) − S(D) is x's clipped gradient, of norm C)."""
    by_length = sorted(range(len(dataset)), key=lambda i: len(dataset[i]["input_ids"]))
    assert len(dataset[by_length[3]]["input_ids"]) < len(dataset[by_length[-1]]["input_ids"])
    sums = []
    for rows in (by_length[:4], by_length[:4] + by_length[-1:], by_length[-1:]):
        torch.manual_seed(0)
        model = model_fn().double()
        trainer = make_trainer(
            tmp_path,
            dataset=dataset,
            model=model,
            noise_multiplier=0.0,
            learning_rate=1.0,
            max_steps=1,
            per_sample_max_grad_norm=1e-3,
            gradient_accumulation_steps=1,
        )
        trainer.dp.examples_checked = True  # measure what the check refuses
        before = [p.detach().clone() for p in model.parameters()]
        trainer.train_one_step([dict(collator([dataset[i] for i in rows]))])
        expected = trainer.expected_batch_size
        sums.append(
            torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)])
            * expected
        )
    return float((sums[1] - sums[0] - sums[2]).norm()) / 1e-3


def _first_step(tmp_path, collator, model, dataset, trainer_class=DPTrainer) -> DPTrainer:
    trainer = make_trainer(
        tmp_path,
        dataset=dataset,
        model=model,
        trainer_class=trainer_class,
        noise_multiplier=0.0,
        max_steps=1,
        insecure_dp_seed=3,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
    )
    trainer.data_collator = collator
    return trainer


def test_left_padding_without_position_ids_is_refused_before_the_first_update(tmp_path) -> None:
    """GPT-2 (learned absolute positions) counts positions from the padded start: an example's positions move
    with the longest row of its batch."""
    torch.manual_seed(0)
    model = models.gpt2().double()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _first_step(tmp_path, left_pad_collate, model, TokenRows(24))
    with pytest.raises(ValueError, match=r"padded on the left and no position_ids.*padding_side='right'"):
        trainer.train()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert trainer.dp.mechanism is None or trainer.dp.mechanism.step == 0  # nothing released, no ε spent


def test_a_collator_without_attention_mask_is_refused(tmp_path) -> None:
    torch.manual_seed(0)
    trainer = _first_step(tmp_path, _padded_without_mask, models.bert_classifier().double(), LabelledRows(24))
    with pytest.raises(ValueError, match="no attention_mask, so every example attends to the padding"):
        trainer.train()


def test_in_the_refused_cases_an_example_moves_the_others_terms(tmp_path) -> None:
    """What the check stands for: where it refuses, one example joining the batch moves the other examples'
    clipped terms, which the noise (sized for one term, C) does not cover; right padding with an attention
    mask moves none (float64 rounding)."""
    dataset, bert_rows = TokenRows(24), LabelledRows(24)
    gpt2 = lambda: models.gpt2()  # noqa: E731
    assert _others_moved(tmp_path, left_pad_collate, gpt2, dataset) > 1e-2
    assert _others_moved(tmp_path, pad_collate, gpt2, dataset) < 1e-9  # S read off the weights: ~1e-12
    assert _others_moved(tmp_path, _padded_without_mask, models.bert_classifier, bert_rows) > 1e-5


class BatchNormalisedLoss(DPTrainer):
    """Each loss divided by the batch's mean loss: the value an example gives depends on the others."""

    def compute_per_example_loss(self, model, inputs):
        losses = super().compute_per_example_loss(model, inputs)
        return losses / losses.detach().mean()


class BatchCentredGradient(DPTrainer):
    """L_i − mean(L) + mean(L) (constant): every loss value is its own, but each gradient carries the batch's."""

    def compute_per_example_loss(self, model, inputs):
        losses = super().compute_per_example_loss(model, inputs)
        return losses - losses.mean() + losses.mean().detach()


@pytest.mark.parametrize("trainer_class", [BatchNormalisedLoss, BatchCentredGradient])
def test_a_loss_that_reads_the_batch_is_refused(tmp_path, trainer_class) -> None:
    """The second one shows in the gradient norm only: the check compares both."""
    torch.manual_seed(0)
    trainer = _first_step(tmp_path, pad_collate, models.gpt2().double(), TokenRows(24), trainer_class)
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        trainer.train()


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_right_padding_trains_and_the_check_leaves_the_random_stream_as_it_was(tmp_path, dropout) -> None:
    """Right padding with an attention mask and no position_ids passes (dropout on too: the check runs in eval
    mode); the run's weights equal those of the same run with the check already done."""
    results = []
    for checked in (False, True):
        torch.manual_seed(0)
        model = models.gpt2(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        trainer = _first_step(tmp_path, pad_collate, model, TokenRows(24))
        trainer.dp.examples_checked = checked
        trainer.train()
        assert trainer.dp.examples_checked
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
