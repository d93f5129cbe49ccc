"""User mistakes end in one line that says what to change, before training (docs/trainer-arguments.md)."""

from __future__ import annotations

import dataclasses

import datasets
import pandas
import pytest
import torch
import transformers
from trl import DPOTrainer, SFTTrainer

from hf_dp import DPTrainer, DPTrainerMixin, DPTrainingArguments
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


@dataclasses.dataclass
class Seq2SeqArgs(DPTrainingArguments, transformers.Seq2SeqTrainingArguments):
    """What a Seq2SeqTrainer under DP takes (module level: the Trainer pickles its arguments)."""


def test_the_mixin_in_a_seq2seq_trainer_asks_for_seq2seq_arguments(tmp_path):
    mixed = type("MySeq2SeqTrainer", (DPTrainerMixin, transformers.Seq2SeqTrainer), {})
    with pytest.raises(
        TypeError, match=r"MySeq2SeqTrainer is a Seq2SeqTrainer.*Args\(DPTrainingArguments, Seq2Seq"
    ):
        mixed(model=models.t5(), args=make_args(tmp_path, noise_multiplier=1.0))  # was: AttributeError

    defaults = make_args(tmp_path, noise_multiplier=1.0).to_dict()
    keep = ("output_dir", "report_to", "use_cpu", "save_strategy", "per_device_train_batch_size", "max_steps")
    extra = dict(noise_multiplier=1.0, max_grad_norm=0.0, dp_optimizer="sgd", predict_with_generate=True)
    args = Seq2SeqArgs(**{k: defaults[k] for k in keep}, **extra)
    rows = TokenRows(32).rows
    data = datasets.Dataset.from_dict({"input_ids": rows, "labels": [row[:4] for row in rows]})
    trainer = mixed(model=models.t5(), args=args, train_dataset=data, data_collator=_seq2seq_collate)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.get_epsilon() > 0


def _seq2seq_collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    out = pad_collate(examples)
    labels = [torch.tensor(e["labels"]) for e in examples]
    out["labels"] = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)
    return out


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


def _classifier_trainer(tmp_path, labels, problem_type=None, dtype=None) -> DPTrainer:
    model = models.bert_classifier(num_labels=3)
    model.config.problem_type = problem_type

    def collate(examples):
        return {**pad_collate(examples), "labels": torch.tensor([e["labels"] for e in examples], dtype=dtype)}

    data = datasets.Dataset.from_dict({"input_ids": TokenRows(32).rows, "labels": labels})
    args = make_args(tmp_path, noise_multiplier=1.0)
    return DPTrainer(model=model, args=args, train_dataset=data, data_collator=collate)


@pytest.mark.parametrize(
    "labels, problem_type, message",
    [
        # float class ids: HF infers multi-label, and BCE failed on the (B,) target
        (
            [float(i % 3) for i in range(32)],
            None,
            r"labels of shape \(\d+,\), but multi-label .*int64, not float",
        ),
        # one class per row to a multi-label head
        ([i % 3 for i in range(32)], "multi_label_classification", r"multi-label classification takes a 0/1"),
        # float labels to a single-label head: "expected target dtype to be Long"
        (
            [float(i % 3) for i in range(32)],
            "single_label_classification",
            r"dtype torch.float32, but single-label",
        ),
        # a language model's token labels to a sequence classifier: "Expected input batch_size (4) to match target"
        (TokenRows(32, length=4).rows, None, r"labels of shape \(\d+, \d+\) .* one integer class per row"),
    ],
    ids=["float_ids", "ids_to_multi_label", "float_to_single_label", "token_labels"],
)
def test_classification_labels_the_head_cannot_take_are_named(tmp_path, labels, problem_type, message):
    if isinstance(labels[0], list):  # ragged token rows: pad them to one length
        labels = [row + [0] * (10 - len(row)) for row in labels]
    trainer = _classifier_trainer(tmp_path, labels, problem_type)
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0


def test_int32_class_labels_train(tmp_path):
    # numpy's int32 labels: F.cross_entropy wanted int64 ("expected target dtype to be Long or Byte, but got Int")
    trainer = _classifier_trainer(tmp_path, [i % 3 for i in range(32)], dtype=torch.int32)
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_batch_without_labels_says_which_collator_makes_them(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0)
    trainer.data_collator = lambda rows: {k: v for k, v in pad_collate(rows).items() if k != "labels"}
    with pytest.raises(
        ValueError,
        match=r"no 'labels' \(its keys: \['attention_mask', 'input_ids'\]\).*DataCollatorForLanguageModeling",
    ):
        trainer.train()


def test_a_dataset_dict_is_refused_naming_its_splits(tmp_path):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": TokenRows(32).rows})})
    with pytest.raises(
        ValueError, match=r"train_dataset is a DatasetDict of splits \['train'\].*dataset\['train'\]"
    ):
        make_trainer(tmp_path, dataset=splits, noise_multiplier=1.0)  # was: "exceeds the 1 training examples"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: setattr(t.args, "max_steps", 6), r"args\.max_steps changed from 2 to 6"),
        (
            lambda t: setattr(t.args, "per_sample_max_grad_norm", 100.0),
            r"args\.per_sample_max_grad_norm changed",
        ),
        (
            lambda t: setattr(t.args, "noise_multiplier", 0.01),
            r"args\.noise_multiplier changed from 1\.0 to 0\.01",
        ),
        (
            lambda t: setattr(t.args, "gradient_accumulation_steps", 4),
            r"args\.gradient_accumulation_steps changed",
        ),
        (
            lambda t: setattr(t, "train_dataset", TokenRows(16)),
            r"train_dataset was replaced",
        ),  # was: IndexError
        (
            lambda t: setattr(t, "train_dataset", TokenRows(400)),
            r"train_dataset was replaced",
        ),  # trained 32 rows
    ],
    ids=["max_steps", "clip_norm", "sigma", "accumulation", "smaller_dataset", "larger_dataset"],
)
def test_arguments_or_dataset_changed_after_the_trainer_was_built_are_refused(tmp_path, change, message):
    # each was ignored (the plan, the sampler and σ are fixed at __init__) or failed deep in the loader
    trainer = make_trainer(tmp_path, noise_multiplier=1.0)
    change(trainer)
    with pytest.raises(ValueError, match=message + r".*(before building|when building) the DPTrainer"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: setattr(t, "model", models.gpt2()), r"trainer\.model was replaced"),  # trained noise only
        (
            lambda t: t.model.transformer.h[0].requires_grad_(True),
            r"trainable parameters changed .*transformer\.h\.0",
        ),
        (
            lambda t: t.model.transformer.h[1].requires_grad_(False),
            r"trainable parameters changed",
        ),  # RuntimeError
    ],
    ids=["model_replaced", "layer_unfrozen", "layer_frozen"],
)
def test_a_model_changed_after_the_trainer_was_built_is_refused(tmp_path, change, message):
    # a layer unfrozen after __init__ had no clipping hooks: it received the noise and no gradient
    model = models.gpt2()
    model.transformer.h[0].requires_grad_(False)
    trainer = make_trainer(tmp_path, model=model, noise_multiplier=1.0)
    change(trainer)
    with pytest.raises(ValueError, match=message + r".*(before building|when building) the DPTrainer"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("in_place", [False, True], ids=["torch.compile", "model.compile"])
def test_a_compiled_model_is_refused_like_torch_compile(tmp_path, in_place):
    # wrapped: a TypeError from OptimizedModule.__len__ in the step; compiled in place (inductor): a RuntimeError
    # about donated buffers from the clipping's backward
    model = models.gpt2()
    if in_place:
        model.compile(backend="eager")
    else:
        model = torch.compile(model, backend="eager")
    with pytest.raises(
        ValueError, match=r"the model was compiled with torch\.compile.*pass the model uncompiled"
    ):
        make_trainer(tmp_path, model=model, noise_multiplier=1.0)


def test_a_model_without_a_task_head_is_named(tmp_path):
    # AutoModel instead of AutoModelForCausalLM: a KeyError 'logits' from the model's output class
    bare = transformers.GPT2Model(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=models.VOCAB)
    )
    trainer = make_trainer(tmp_path, model=bare, noise_multiplier=1.0, remove_unused_columns=False)
    with pytest.raises(
        ValueError, match=r"GPT2Model returns no logits \(its outputs: \['last_hidden_state'.*not AutoModel"
    ):
        trainer.train()
    assert trainer.state.global_step == 0


def test_records_packed_for_an_encoder_decoder_model_are_refused(tmp_path):
    rows = TokenRows(32).rows
    data = datasets.Dataset.from_dict({"input_ids": rows, "labels": [row[:3] for row in rows]})
    trainer = make_trainer(tmp_path, dataset=data, model=models.t5(), noise_multiplier=1.0)
    trainer.data_collator = transformers.DataCollatorWithFlattening()
    with pytest.raises(
        ValueError, match=r"records packed into rows .* T5ForConditionalGeneration, an encoder-decoder"
    ):
        trainer.train()  # was: a shape error in PrivacyUnits.mean_over_tokens
    assert trainer.state.global_step == 0
