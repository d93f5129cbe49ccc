"""Multiple-choice heads (SWAG-style rows (batch, choices, length)): the model folds each example's C choices into
C rows of its own batch, and privacy_units.choice_units makes those rows one unit, so each example's gradient (all
its choices) is clipped once. A DP step equals the brute-force clipped sum (each example run alone, one backward
each) in both clipping modes, with and without activation checkpointing, and a noise-free trainer step is
lr · Σ_i clip(∇L_i) / B̄."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.plan import StepPlan
from hf_dp.losses import per_example_loss
from hf_dp.privacy_units import choice_units
from tests import models, oracle
from tests.test_engine import assert_close
from tests.trainer_utils import make_trainer, sampled_logical_batches, snapshot

CHOICES, LENGTH = 3, 8


def bert() -> T.PreTrainedModel:
    config = T.BertConfig(**models._ENCODER, pad_token_id=models.PAD, max_position_embeddings=32)
    return T.BertForMultipleChoice(config)


def roberta() -> T.PreTrainedModel:
    config = T.RobertaConfig(
        **models._ENCODER, pad_token_id=1, bos_token_id=0, eos_token_id=2, max_position_embeddings=40
    )
    return T.RobertaForMultipleChoice(config)


MODELS = {"bert": bert, "roberta": roberta}


def choice_batch(examples: int = 5, seed: int = 0, pad: int = models.PAD) -> dict[str, torch.Tensor]:
    """(examples, CHOICES, LENGTH) rows right-padded to different lengths, one correct choice per example."""
    rows = models.token_batch(examples * CHOICES, LENGTH, seed)
    mask = rows["attention_mask"].view(examples, CHOICES, LENGTH)
    ids = rows["input_ids"].view(examples, CHOICES, LENGTH).masked_fill(mask == 0, pad)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(examples) % CHOICES}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("mode", ["ghost", "per_sample"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_multiple_choice_dp_step_equals_brute_force(name: str, mode: str, checkpointing: bool) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().double().train()
    batch = choice_batch(pad=model.config.pad_token_id)
    units = choice_units(batch)
    assert units.rows == 5 * CHOICES and units.count == 5
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = norms.median().item()  # some examples clipped, some not
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    per_row, _ = oracle.per_example(  # each choice its own unit: what the fold must not do
        model, {"input_ids": batch["input_ids"].flatten(0, 1)[:, None]}, max_norm, loss_fn=_first_choice_loss
    )
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    engine = ClippingEngine(model, mode=mode)
    step = clipped_step(engine, model, Backend(checkpointing=checkpointing))
    for _ in range(2):  # the first step (checked) and a later one
        model.zero_grad(set_to_none=True)
        step.run(lambda m: per_example_loss(m, dict(batch)), torch.ones(5), StepPlan(max_norm), model, units)
        ours = {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}
        step.check_untouched()
        # the head's bias moves every choice's logit alike: its true gradient is exactly 0, and both sums hold
        # float64 rounding of the largest gradient there (~1e-15 of it)
        assert_close(ours, reference, rtol=1e-9, floor=1e-5)
    assert max((ours[n] - per_row[n]).norm() / per_row[n].norm().clamp(min=1e-12) for n in ours) > 1e-2
    engine.remove_hooks()


def _first_choice_loss(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """A one-choice row's loss (its logit's log-softmax over one choice is 0: the logit itself, for a gradient)."""
    return model(input_ids=inputs["input_ids"]).logits[:, 0]


class ChoiceRows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.batch = choice_batch(n, seed=1)

    def __len__(self) -> int:
        return self.batch["labels"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def stack(examples: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def test_a_noise_free_trainer_step_clips_each_example_with_all_its_choices(tmp_path) -> None:
    torch.manual_seed(0)
    model = bert().double()
    dataset = ChoiceRows(24)
    trainer = make_trainer(
        tmp_path, dataset=dataset, model=model, noise_multiplier=0.0, max_steps=1, insecure_dp_seed=11,
        per_sample_max_grad_norm=1e-3, learning_rate=0.1,
    )  # fmt: skip
    trainer.data_collator = stack
    before = snapshot(model)
    drawn = sampled_logical_batches(trainer, 1)[0]
    model.eval()  # the trainer's step runs in train mode; the model has no dropout
    reference, norms = oracle.per_example(model, stack([dataset[i] for i in drawn]), 1e-3)
    assert (norms > 1e-3).all()
    trainer.train()
    lr, expected_batch = trainer.args.learning_rate, trainer.expected_batch_size
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            (before[name] - p.detach()).double(), lr * reference[name] / expected_batch, rtol=1e-8, atol=1e-12
        )


def test_multiple_choice_rows_are_refused_for_another_head_and_with_users(tmp_path) -> None:
    classifier = T.BertForSequenceClassification(T.BertConfig(**models._ENCODER, pad_token_id=models.PAD))
    trainer = make_trainer(tmp_path, dataset=ChoiceRows(24), model=classifier, noise_multiplier=1.0)
    trainer.data_collator = stack
    with pytest.raises(ValueError, match="only a \\*ForMultipleChoice model takes") as info:
        trainer.train()
    assert "\n" not in str(info.value) and trainer.state.global_step == 0
    from hf_dp.privacy_units import micro_batch_units

    with pytest.raises(ValueError, match="privacy_unit_column with multiple-choice rows"):
        micro_batch_units(choice_batch(), torch.tensor([0, 1, 0, 1, 2]))


def test_a_label_outside_the_choices_is_refused_in_one_line(tmp_path) -> None:
    dataset = ChoiceRows(24)
    dataset.batch["labels"][:] = CHOICES  # one past the last choice
    trainer = make_trainer(tmp_path, dataset=dataset, model=bert(), noise_multiplier=1.0)
    trainer.data_collator = stack
    with pytest.raises(
        ValueError, match=f"the batch has label {CHOICES} but BertForMultipleChoice predicts"
    ) as info:
        trainer.train()
    assert "\n" not in str(info.value) and trainer.state.global_step == 0


def trimmed_without_mask(examples: list[dict]) -> dict[str, torch.Tensor]:
    """A collator that pads only to its batch's longest choice and drops the attention mask: a choice then attends
    to the padding its batch adds, so its example's loss depends on the batch."""
    batch = stack(examples)
    length = int(batch.pop("attention_mask").sum(dim=-1).max())
    return {"input_ids": batch["input_ids"][..., :length], "labels": batch["labels"]}


def test_a_choice_that_sees_its_batch_s_padding_is_refused_by_the_first_step(tmp_path) -> None:
    """The first step runs some examples alone (each collated on its own, all its choices) and compares."""
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, dataset=ChoiceRows(24), model=bert(), noise_multiplier=1.0, max_steps=1)
    trainer.data_collator = trimmed_without_mask
    with pytest.raises(
        ValueError, match="in its batch but .* alone .*the batch has no attention_mask"
    ) as info:
        trainer.train()
    assert "\n" not in str(info.value) and trainer.state.global_step == 0
