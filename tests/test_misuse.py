"""User mistakes end in one line that says what to change, before training (docs/trainer-arguments.md)."""

from __future__ import annotations

import datasets
import pandas
import pytest
import torch
import transformers
from trl import DPOTrainer, SFTTrainer

from hf_dp import DPTrainer, DPTrainerMixin
from hf_dp.clipping.units import PrivacyUnits
from hf_dp.loss_contract import require_per_example
from hf_dp.losses import token_loss_per_example
from tests import models
from tests.trainer_utils import TokenRows, make_args, make_trainer, pad_collate


def test_a_model_with_no_trainable_parameters_is_refused(tmp_path):
    model = models.gpt2()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        make_trainer(tmp_path, model=model, noise_multiplier=1.0)


def test_a_streaming_dataset_is_refused_in_one_line(tmp_path):
    rows = [{"input_ids": [5, 6, 7]}] * 8
    streaming = datasets.IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ValueError, match="map-style train_dataset .* not IterableDataset"):
        make_trainer(tmp_path, dataset=streaming, noise_multiplier=1.0)


@pytest.mark.parametrize("trl_trainer, ours", [(SFTTrainer, "DPSFTTrainer"), (DPOTrainer, "DPDPOTrainer")])
def test_the_mixin_mixed_straight_into_a_trl_trainer_points_at_hf_dp_trl(tmp_path, trl_trainer, ours):
    mixed = type("MyPrivateTrainer", (DPTrainerMixin, trl_trainer), {})
    with pytest.raises(TypeError, match=rf"into trl's {trl_trainer.__name__} directly.*hf_dp\.trl\.{ours}"):
        mixed(model=models.gpt2(), args=make_args(tmp_path, noise_multiplier=1.0))


def test_a_loss_of_the_wrong_length_says_how_many_units_and_rows():
    pairs = PrivacyUnits.of_rows(torch.tensor([0, 1, 2, 0, 1, 2]))
    with pytest.raises(ValueError, match=r"shape \(3,\) for this micro-batch's 3 units made of 6 rows"):
        require_per_example(torch.zeros(5), 3, "MyTrainer.compute_per_example_loss", pairs)
    with pytest.raises(ValueError, match=r"returned \(\); .* 4 units \(no mean over the batch\)"):
        require_per_example(torch.zeros(()), 4, "MyTrainer.compute_loss")


def user_rows(missing: object, at: tuple[int, ...] = (5, 9, 20)) -> dict[str, list]:
    """32 token rows of 16 users, two rows each, with ``missing`` for the user id of the rows ``at``."""
    users: list[object] = [i // 2 for i in range(32)]
    for i in at:
        users[i] = missing
    return {"input_ids": TokenRows(32).rows, "user_id": users}


@pytest.mark.parametrize(
    "dataset",
    [
        datasets.Dataset.from_dict(user_rows(None)),  # None: today one unit of all the rows without an id
        datasets.Dataset.from_pandas(pandas.DataFrame(user_rows(float("nan")))),  # NaN: today a unit per row
    ],
    ids=["None", "NaN"],
)
def test_a_privacy_unit_column_with_missing_ids_is_refused(tmp_path, dataset):
    with pytest.raises(
        ValueError, match=r"privacy_unit_column='user_id' has no id in 3 of 32 rows .*first: row 5"
    ):
        make_trainer(tmp_path, dataset=dataset, noise_multiplier=1.0, privacy_unit_column="user_id")


@pytest.mark.parametrize("learning_rate", [float("nan"), float("inf")])
def test_a_learning_rate_that_is_not_finite_is_refused(tmp_path, learning_rate):
    with pytest.raises(ValueError, match=rf"learning_rate={learning_rate} .* set a finite learning_rate"):
        make_args(tmp_path, learning_rate=learning_rate, noise_multiplier=1.0)


def test_max_steps_0_is_refused_and_minus_1_trains_the_epochs(tmp_path):
    # at max_steps=0 train() returned after no step, while σ was calibrated for num_train_epochs × steps per epoch
    with pytest.raises(
        ValueError, match=r"max_steps=0 trains no step.*max_steps >= 1.*-1 to train num_train_epochs"
    ):
        make_args(tmp_path, max_steps=0, noise_multiplier=1.0)
    trainer = make_trainer(tmp_path, max_steps=-1, num_train_epochs=2, noise_multiplier=1.0)
    assert trainer.planned_steps == 2 * trainer.steps_per_epoch


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_steps=-1, num_train_epochs=0), r"num_train_epochs=0 trains no step"),
        (dict(per_device_train_batch_size=0), r"per_device_train_batch_size=0 makes an empty logical batch"),
        (dict(gradient_accumulation_steps=0), r"gradient_accumulation_steps=0 makes an empty logical batch"),
    ],
    ids=["epochs_0", "batch_0", "accumulation_0"],
)
def test_a_schedule_that_trains_nothing_is_refused(tmp_path, overrides, message):
    # each ended in a ZeroDivisionError or "steps must be an integer >= 1" from the accountant
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, noise_multiplier=1.0, **overrides)


def test_an_empty_dataset_or_a_list_for_a_user_id_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="train_dataset is empty"):  # was: lower per_device_train_batch_size
        make_trainer(tmp_path, dataset=datasets.Dataset.from_dict({"input_ids": []}), noise_multiplier=1.0)
    lists = datasets.Dataset.from_dict(
        {"input_ids": TokenRows(32).rows, "user_id": [[i, i] for i in range(32)]}
    )
    with pytest.raises(
        ValueError, match=r"privacy_unit_column='user_id' holds a list in row 0, not a user id"
    ):
        make_trainer(
            tmp_path, dataset=lists, noise_multiplier=1.0, privacy_unit_column="user_id"
        )  # TypeError
    lists.set_format("torch")  # a tensor per row, each hashed by identity: a unit per row
    with pytest.raises(ValueError, match=r"holds a Tensor in row 0, not a user id"):
        make_trainer(tmp_path, dataset=lists, noise_multiplier=1.0, privacy_unit_column="user_id")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(noise_mechanism="BandMF", num_bands="2"),
            r"noise_mechanism='BandMF' is unknown",
        ),  # was: drop num_bands
        (
            dict(noise_mechanism="bandmf", num_bands="²"),
            r"num_bands='²' must be an integer >= 1",
        ),  # int() failed
    ],
)
def test_a_misspelt_noise_mechanism_or_band_count_is_named(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, noise_multiplier=1.0, **overrides)


def test_a_collator_of_lists_or_of_rows_without_their_labels_is_named(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0)
    trainer.data_collator = lambda rows: {k: v.tolist() for k, v in pad_collate(rows).items()}
    with pytest.raises(ValueError, match=r"the data collator returned no tensors \(input_ids: list"):
        trainer.train()  # was: a bare StopIteration
    trainer = make_trainer(tmp_path, noise_multiplier=1.0)
    trainer.data_collator = lambda rows: {**pad_collate(rows), "labels": pad_collate(rows)["labels"][:-1]}
    with pytest.raises(
        ValueError, match=r"the batch has labels for \d+ rows and the model returns logits for"
    ):
        trainer.train()  # was: a RuntimeError from the loss


def test_user_units_with_a_collator_that_packs_examples_into_rows_is_refused(tmp_path):
    rows = TokenRows(32).rows
    data = datasets.Dataset.from_dict(
        {"input_ids": rows, "labels": rows, "user_id": [i // 2 for i in range(32)]}
    )
    trainer = make_trainer(
        tmp_path,
        dataset=data,
        noise_multiplier=1.0,
        privacy_unit_column="user_id",
        per_device_train_batch_size=2,
    )
    trainer.data_collator = transformers.DataCollatorWithFlattening()
    with pytest.raises(
        ValueError, match=r"privacy_unit_column: the collator made 1 row\(s\) of \d+ examples"
    ):
        trainer.train()  # was: a shape error deep in the clipping


class PlainLM(torch.nn.Module):
    """A language model that is not a transformers model: no config, its own forward's keyword arguments only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(models.VOCAB, 8), torch.nn.Linear(8, models.VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return {"logits": self.head(self.embed(input_ids))}


class PlainLMTrainer(DPTrainer):
    def compute_per_example_loss(self, model, inputs):
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"})["logits"]
        return token_loss_per_example(logits, inputs["labels"], shift=True)


def test_a_model_that_is_not_a_transformers_model_needs_its_per_example_loss(tmp_path):
    with pytest.raises(
        ValueError, match=r"PlainLM is not a transformers model.*override compute_per_example_loss"
    ):
        make_trainer(tmp_path, model=PlainLM(), noise_multiplier=1.0).train()  # was: AttributeError 'config'
    # the override gets the model's inputs only (the first step's examples alone carried hf_dp's mask key into
    # a forward without **kwargs: TypeError)
    trainer = make_trainer(tmp_path, model=PlainLM(), trainer_class=PlainLMTrainer, noise_multiplier=1.0)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.dp.examples_checked
