"""Drop-in fidelity: every TrainingArguments field and Trainer entry point is honoured under DP or refused.

Each flag a Trainer user passes must mean what it meant, or stop the run before training in one line.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import warnings

import pytest
import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import LabelSmoother

from hf_dp import DPTrainer, compat
from hf_dp.data import dp_dataloader
from hf_dp.losses import per_example_loss
from hf_dp.optim.registry import decay_groups
from tests import models
from tests.trainer_utils import (
    TokenRows,
    make_args,
    make_trainer,
    pad_collate,
    sampled_logical_batches,
    snapshot,
)

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "trainer-arguments.md"


def test_every_training_arguments_field_has_a_policy_and_a_docs_row():
    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    assert fields - set(compat.FIELD_POLICIES) == set(), (
        "classify the new TrainingArguments fields in hf_dp.compat"
    )
    assert set(compat.FIELD_POLICIES) - fields == set(), "hf_dp.compat lists fields TrainingArguments lacks"
    table = DOCS.read_text()
    missing = sorted(name for name in fields if f"`{name}`" not in table)
    assert missing == [], f"docs/trainer-arguments.md lacks {missing}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"torch_compile": True}, "torch_compile=True"),
        ({"torch_compile_mode": "max-autotune"}, "torch_compile=True"),
        ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='group_by_length'"),
        ({"data_seed": 3}, "data_seed=3 .* insecure_dp_seed"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size=True"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha=5.0"),
        ({"use_liger_kernel": True}, "use_liger_kernel=True"),
        ({"optim_args": "a=1"}, "put the options in dp_optimizer_kwargs"),
        ({"optim_target_modules": ["q"]}, "optim_target_modules"),
        ({"optim": "adafactor", "dp_optimizer": None}, "optim='adafactor' has no DP version"),
        ({"optim": "sgd", "dp_optimizer": "adam"}, "name different rules"),
        ({"adam_beta1": 0.8, "dp_optimizer": "sgd"}, "dp_optimizer='sgd' takes no 'betas'"),
        ({"adam_epsilon": 1e-6, "dp_optimizer_kwargs": {"eps": 1e-7}}, "disagree"),
    ],
)
def test_flags_dp_cannot_honour_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_args(tmp_path, noise_multiplier=1.0, **overrides)
    assert "\n" not in str(info.value)


def test_a_flag_without_effect_under_dp_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_dp.compat"):
        make_args(tmp_path, noise_multiplier=1.0, dataloader_drop_last=True)
    assert "dataloader_drop_last=True has no effect under DP" in caplog.text


def test_hf_optim_and_adam_settings_map_onto_the_dp_rule(tmp_path):
    sgd = make_trainer(tmp_path, noise_multiplier=1.0, dp_optimizer=None, optim="sgd")
    assert sgd.args.dp_optimizer == "sgd" and type(sgd.create_optimizer()) is torch.optim.SGD
    adamw = make_trainer(
        tmp_path, noise_multiplier=1.0, dp_optimizer=None, adam_beta1=0.8, adam_beta2=0.98, adam_epsilon=1e-6
    )
    optimizer = adamw.create_optimizer()
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.98) and group["eps"] == 1e-6
    assert adamw.privacy_report()["optimizer_kwargs"]["betas"] == (0.8, 0.98)
    bc = make_trainer(tmp_path, noise_multiplier=1.0, dp_optimizer="adam_bc", adam_beta2=0.95)
    assert bc.create_optimizer().param_groups[0]["betas"] == (0.9, 0.95)


def test_label_smoothing_is_applied_to_each_example_as_the_trainer_applies_it(tmp_path):
    """Our L_i against transformers' LabelSmoother run on example i alone (causal LM and classification)."""
    torch.manual_seed(0)
    smoother = LabelSmoother(epsilon=0.1)
    model = models.gpt2().eval()
    batch = pad_collate([TokenRows(3)[i] for i in range(3)])
    ours = per_example_loss(model, batch, label_smoothing=0.1)
    for i in range(3):
        row = {k: v[i : i + 1] for k, v in batch.items()}
        outputs = model(input_ids=row["input_ids"], attention_mask=row["attention_mask"])
        assert ours[i].item() == pytest.approx(
            smoother(outputs, row["labels"], shift_labels=True).item(), rel=1e-5
        )
    assert not torch.allclose(ours, per_example_loss(model, batch))

    classifier = models.bert_classifier().eval()
    batch = models.classification_batch(num_labels=3)
    ours = per_example_loss(classifier, batch, label_smoothing=0.2)
    smoother = LabelSmoother(epsilon=0.2)
    for i in range(len(ours)):
        row = {k: v[i : i + 1] for k, v in batch.items()}
        logits = classifier(**{k: v for k, v in row.items() if k != "labels"}).logits
        assert ours[i].item() == pytest.approx(smoother({"logits": logits}, row["labels"]).item(), rel=1e-5)


def test_label_smoothing_changes_the_trained_model(tmp_path):
    runs = {}
    for factor in (0.0, 0.1):
        torch.manual_seed(0)
        trainer = make_trainer(
            tmp_path / str(factor), noise_multiplier=0.0, label_smoothing_factor=factor, insecure_dp_seed=1
        )
        trainer.train()
        runs[factor] = snapshot(trainer.model)["transformer.wte.weight"]
    assert not torch.allclose(runs[0.0], runs[0.1])


def test_eval_and_predict_only_runs_need_no_train_set_nor_budget(tmp_path):
    model = models.gpt2()
    rows = TokenRows(6)
    trainer = DPTrainer(
        model=model,
        args=make_args(tmp_path, per_device_eval_batch_size=3),  # neither target_epsilon nor noise_multiplier
        eval_dataset=rows,
        data_collator=pad_collate,
        compute_metrics=lambda prediction: {"rows": float(len(prediction.predictions))},
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    )
    metrics = trainer.evaluate()
    assert metrics["eval_rows"] == 6.0 and metrics["eval_loss"] > 0 and "epsilon" not in metrics
    assert trainer.predict(rows).predictions.shape[0] == 6
    with pytest.raises(ValueError, match="needs a train_dataset") as info:
        trainer.train()
    assert "\n" not in str(info.value)


def test_train_returns_the_guarantee_in_its_metrics(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0, max_steps=3)
    metrics = trainer.train().metrics
    assert metrics["epsilon"] == trainer.get_epsilon() and 0 < metrics["epsilon"] < float("inf")
    assert metrics["delta"] == trainer.target_delta and metrics["noise_multiplier"] == 1.0
    assert metrics["privacy_unit"] == "example" and metrics["dp_steps"] == 3


def test_the_logged_loss_is_the_mean_loss_of_the_drawn_batch(tmp_path):
    """lr = 0 keeps the model fixed, so each logged loss must equal the mean L_i over the batch the sampler drew."""
    dataset = TokenRows(32)
    trainer = make_trainer(tmp_path, dataset=dataset, noise_multiplier=1.0, learning_rate=0.0, max_steps=4)
    model = trainer.model
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    model.eval()
    with torch.no_grad():
        expected = [
            per_example_loss(model, pad_collate([dataset[i] for i in batch])).mean().item() if batch else 0.0
            for batch in sampled_logical_batches(trainer, 4)
        ]
    assert logged == pytest.approx(expected, rel=1e-4)


def _trained_weights(trainer: DPTrainer) -> torch.Tensor:
    trainer.train()
    return snapshot(trainer.model)["transformer.wte.weight"]


def test_model_init_trains_the_fresh_model_with_its_clipping_hooks(tmp_path):
    def model_init():
        torch.manual_seed(3)
        return models.gpt2()

    common = dict(noise_multiplier=0.7, insecure_dp_seed=5, per_sample_max_grad_norm=0.05)
    direct = make_trainer(tmp_path / "a", model=model_init(), **common)
    fresh = DPTrainer(
        model_init=model_init,
        args=make_args(tmp_path / "b", **common),
        train_dataset=TokenRows(32),
        data_collator=pad_collate,
    )
    assert torch.equal(_trained_weights(direct), _trained_weights(fresh))


def test_an_optimizer_passed_in_receives_the_privatised_gradient(tmp_path):
    common = dict(noise_multiplier=0.7, insecure_dp_seed=5, learning_rate=0.5)
    torch.manual_seed(3)
    reference = _trained_weights(make_trainer(tmp_path / "a", dp_optimizer="sgd", **common))

    torch.manual_seed(3)
    model = models.gpt2()
    groups = decay_groups(
        model, Trainer.get_decay_parameter_names(None, model), 0.0
    )  # the noise follows this order
    passed = DPTrainer(
        model=model,
        args=make_args(tmp_path / "b", **common),
        train_dataset=TokenRows(32),
        data_collator=pad_collate,
        optimizers=(torch.optim.SGD(groups, lr=0.5), None),
    )
    assert torch.equal(reference, _trained_weights(passed))
    assert passed.privacy_report()["optimizer"] == "torch.optim.sgd.SGD"
    assert passed.privacy_report()["optimizer_kwargs"] == {}

    torch.manual_seed(3)
    by_class = DPTrainer(
        model=models.gpt2(),
        args=make_args(tmp_path / "c", **common),
        train_dataset=TokenRows(32),
        data_collator=pad_collate,
        optimizer_cls_and_kwargs=(torch.optim.SGD, {"momentum": 0.0}),
    )
    assert torch.equal(reference, _trained_weights(by_class))
    assert (by_class.privacy_report()["optimizer"], by_class.privacy_report()["optimizer_kwargs"]) == (
        "torch.optim.sgd.SGD",
        {"momentum": 0.0},
    )


def test_hyperparameter_search_and_a_batch_loss_function_are_refused(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="Papernot & Steinke"):
        trainer.hyperparameter_search()
    with pytest.raises(ValueError, match="override compute_per_example_loss"):
        DPTrainer(
            model=models.gpt2(),
            args=make_args(tmp_path, noise_multiplier=1.0),
            train_dataset=TokenRows(8),
            data_collator=pad_collate,
            compute_loss_func=lambda outputs, labels, num_items_in_batch: outputs.loss,
        )


def test_data_loader_options_reach_the_dp_loader(tmp_path):
    trainer = make_trainer(
        tmp_path,
        noise_multiplier=1.0,
        dataloader_num_workers=2,
        dataloader_prefetch_factor=3,
        dataloader_persistent_workers=True,
        dataloader_pin_memory=False,
    )
    loader = dp_dataloader(
        trainer.train_dataset, pad_collate, plan=trainer.privacy_plan, sampling_key=1, args=trainer.args
    )
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers, loader.pin_memory) == (
        2,
        3,
        True,
        False,
    )
