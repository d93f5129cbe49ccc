"""recipes/table2text.py: data format, metrics on known cases, and E2E / DART end to end at toy size on
real data."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from recipes import table2text as t2t
from tests.benchmark_scripts import load_benchmark

TINY_GPT2 = '{"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 96}'
TOY = [
    "--from_scratch", "--model_config", TINY_GPT2,
    "--max_train_samples", "32",
    "--max_eval_samples", "2",
    "--max_seq_length", "64",
    "--max_steps", "2",
    "--per_device_train_batch_size", "4",
    "--gradient_accumulation_steps", "2",
    "--logging_steps", "1",
    "--num_beams", "2",
    "--max_new_tokens", "8",
]  # fmt: skip
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
FINAL_LINE = re.compile(r"(E2E|DART) test: (.*)  at epsilon (\S+) \(delta \S+, 2 steps\)")


def test_e2e_tables_are_linearised_like_the_prefix_tuning_data(shared_data):
    """Every test MR equals the table of the same row of the prefix-tuning file (which is word-tokenised)."""
    with open(shared_data / "e2e" / "testset_w_refs.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    lines = (
        (shared_data / "e2e" / "prefix_tuning_format" / "src1_test.txt")
        .read_text(encoding="utf-8")
        .splitlines()
    )
    assert len(rows) == len(lines) == 4693

    def squeeze(text: str) -> str:
        return "".join(text.split())

    for row, line in zip(rows, lines, strict=True):
        assert squeeze(t2t.linearize_e2e(row["mr"])) == squeeze(line.split("||")[0])
    assert t2t.linearize_e2e("name[The Eagle], eatType[coffee shop], familyFriendly[yes]") == (
        "name : The Eagle | Type : coffee shop | family friendly : yes"
    )


def test_references_are_grouped_per_table(shared_data):
    e2e = t2t.read_e2e(shared_data / "e2e" / "testset_w_refs.csv")
    assert len(e2e) == 630 and sum(len(g.references) for g in e2e) == 4693
    dart_train = t2t.read_dart_json(shared_data / "dart" / "dart-v1.1.1-full-dev.json")
    assert len(dart_train) == 2768 and sum(len(g.references) for g in dart_train) == 6980
    dart_test = t2t.read_dart_xml(shared_data / "dart" / "dart-v1.1.1-full-test.xml")
    assert len(dart_test) == 5097 and all(g.references for g in dart_test)
    assert dart_test[0].table.startswith("Hawaii Five-O : NOTES : Episode: The Flight of the Jewels | ")


def test_heldout_split_spans_the_file_and_is_never_trained_on(shared_data):
    """--eval_split heldout: every len/N-th table of the training file, all rows of a repeated table left out
    of training; the other splits unchanged; a misplaced flag refused."""
    table = lambda name: t2t.TableGroup(name, [f"{name}."])  # noqa: E731
    kept, held = t2t.hold_out([table(n) for n in "ABCADE"], 3)
    assert [g.table for g in held] == ["A", "C", "D"] and [g.table for g in kept] == ["B", "E"]
    train, evaluation, split = t2t.load_data(t2t.DataArguments(dataset="dart", eval_split="heldout"))
    everything = t2t.read_dart_json(shared_data / "dart" / "dart-v1.1.1-full-dev.json")
    assert split == "heldout" and len(evaluation) == t2t.DEFAULT_HELDOUT_TABLES
    assert evaluation[0] == everything[0] and evaluation[-1] == everything[99 * (len(everything) // 100)]
    held_tables = {g.table for g in evaluation}
    assert not held_tables & {g.table for g in train}
    assert len(train) == sum(g.table not in held_tables for g in everything) < len(everything) - 100
    train, evaluation, _ = t2t.load_data(
        t2t.DataArguments(dataset="e2e", eval_split="heldout", heldout_tables=7)
    )
    assert len(evaluation) == 7 and len(train) + 7 == len(t2t.read_e2e(shared_data / "e2e" / "trainset.csv"))
    for bad, message in [
        ({"dataset": "e2e", "heldout_tables": 7}, "--heldout_tables sizes --eval_split heldout"),
        ({"dataset": "dart", "eval_split": "dev"}, "DART --eval_split is one of test, heldout"),
        (
            {"dataset": "e2e", "eval_split": "heldout", "heldout_tables": 0},
            "--heldout_tables must be between",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            t2t.load_data(t2t.DataArguments(**bad))


def test_loss_covers_only_the_text_and_its_end_token(shared_data):
    tokenizer = t2t.load_tokenizer(t2t.ModelArguments(from_scratch=True))
    assert len(tokenizer) == 50257 and tokenizer.eos_token == "<|endoftext|>"
    table, text = "name : Blue Spice | Type : coffee shop", "Blue Spice is a coffee shop."
    row = t2t.encode_pair(table, text, tokenizer, max_length=128)
    ids, labels = row["input_ids"], row["labels"]
    separator = ids.index(tokenizer.eos_token_id)
    assert all(label == -100 for label in labels[: separator + 1])
    assert labels[separator + 1 :] == ids[separator + 1 :] and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[: separator + 1]) == f" {table} <|endoftext|>"
    assert tokenizer.decode(labels[separator + 1 :]) == f" {text} <|endoftext|>"
    batch = t2t.PadCollator(tokenizer.pad_token_id)([row, t2t.encode_pair(table, "Short.", tokenizer, 128)])
    assert (batch["labels"][1][batch["attention_mask"][1] == 0] == -100).all()
    assert t2t.encode_pair(table, text, tokenizer, max_length=12)["input_ids"] == ids[:12]


def test_metrics_on_known_cases():
    references = [
        ["The Vaults is a pub near Café Adriatic.", "Near Café Adriatic is The Vaults, a pub."],
        ["Blue Spice is a coffee shop in the city centre."],
        ["Alimentum serves cheap Chinese food by the river."],
    ]
    perfect = t2t.text_metrics([refs[0] for refs in references], references)
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["rouge_l"] == pytest.approx(1.0)
    assert perfect["meteor"] == pytest.approx(1.0, abs=1e-3)
    assert perfect["nist"] > 3 and perfect["cider"] > 1
    empty = ["", "", ""]
    assert t2t.bleu(empty, references) == 0 and t2t.nist(empty, references) == 0
    assert t2t.rouge_l(empty, references) == 0


def _check_run(record: dict, out: str, results_path, metrics: tuple[str, ...], epsilon_bound: float) -> None:
    """Loss and ε in the training logs; the final line and the JSON carry the same finite metrics and ε."""
    assert "'loss'" in out and "'epsilon'" in out
    final = FINAL_LINE.search(out)
    assert final, out[-3000:]
    assert final.group(2) == t2t.format_metrics({name: record[name] for name in metrics})
    written = json.loads(results_path.read_text())
    for name in t2t.METRICS:
        assert (name in written) == (name in metrics)
    for name in metrics:
        assert (
            math.isfinite(written[name])
            and written[name] >= 0
            and written[name] == pytest.approx(record[name])
        )
    assert 0 < written["epsilon"] <= epsilon_bound
    assert float(final.group(3)) == pytest.approx(written["epsilon"], abs=1e-3)
    assert written["steps"] == 2 and written["eval_tables"] == 2 and len(written["examples"]) == 2


@pytest.mark.slow
def test_e2e_end_to_end_prints_and_writes_metrics_and_epsilon(shared_data, tmp_path, capsys):
    results = tmp_path / "e2e.json"
    trainer, record = t2t.run(
        [*TOY, "--no_lora", "--dataset", "e2e", "--target_epsilon", "3", "--output_dir", str(tmp_path),
         "--results_json", str(results)]
    )  # fmt: skip
    _check_run(record, capsys.readouterr().out, results, t2t.METRICS, epsilon_bound=3.0)
    assert record["num_train_examples"] == 32 and "before_training" not in record
    assert record["examples"][0]["table"].startswith("name : Blue Spice")


@pytest.mark.slow
def test_dart_with_lora_dp_sgd_and_rdp(shared_data, tmp_path, capsys):
    """DART, LoRA adapters only, DP-SGD, the RDP accountant and the metrics that need no Java; the model as loaded
    scored too."""
    results = tmp_path / "dart.json"
    trainer, record = t2t.run(
        [*TOY, "--dataset", "dart", "--use_lora", "--dp_optimizer", "sgd", "--learning_rate", "0.5",
         "--accountant", "rdp", "--metrics", "bleu,nist,rouge_l", "--output_dir", str(tmp_path),
         "--results_json", str(results), "--evaluate_before_training"]
    )  # fmt: skip
    out = capsys.readouterr().out
    _check_run(record, out, results, ("bleu", "nist", "rouge_l"), epsilon_bound=8.0)
    before = json.loads(results.read_text())["before_training"]
    assert set(before) == {"bleu", "nist", "rouge_l"} and all(
        math.isfinite(v) and v >= 0 for v in before.values()
    )
    assert f"DART test before training: BLEU {before['bleu']:.2f}" in out
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert trainer.args.dp_optimizer == "sgd" and "betas" not in trainer.optimizer.param_groups[0]
    assert record["examples"][0]["table"].startswith("Hawaii Five-O : NOTES")


@pytest.mark.slow
def test_tuning_script_runs_each_rate_once_and_chooses_the_highest_bleu(tmp_path):
    """benchmarks/table2text_tuning.py: one recipe run per rate on held-out tables, the highest BLEU chosen with
    its settings; a second call reads the kept results instead of training again."""
    tuning = load_benchmark("table2text_tuning")
    out = tmp_path / "tuning.json"
    argv = ["--dataset", "e2e", "--eval_split", "heldout", "--learning_rates", "1e-2", "1e-4",
            "--work", str(tmp_path), "--out", str(out), "--", *TOY]  # fmt: skip
    result = tuning.main(argv)
    assert json.loads(out.read_text()) == result and set(result["runs"]) == {"1e-2", "1e-4"}
    best = max(result["runs"].values(), key=lambda run: run["bleu"])
    assert (
        result["chosen_learning_rate"]
        == best["learning_rate"]
        == result["settings"]["training"]["learning_rate"]
    )
    assert all(
        run["eval_tables"] == 2 and run["steps"] == 2 and run["mean_words"] > 0
        for run in result["runs"].values()
    )
    kept = sorted(tmp_path.glob("e2e_heldout_lr*.json"))
    stamps = [path.stat().st_mtime_ns for path in kept]
    assert len(kept) == 2 and tuning.main(argv)["runs"] == result["runs"]
    assert [path.stat().st_mtime_ns for path in kept] == stamps


@pytest.mark.parametrize(
    "dataset, private, tuning",
    [
        ("e2e", True, "table2text_e2e_smollm2_tuning.json"),
        ("e2e", False, "table2text_e2e_smollm2_nodp_tuning.json"),
        ("dart", True, "table2text_dart_smollm2_tuning.json"),
        ("dart", False, "table2text_dart_smollm2_nodp_tuning.json"),
    ],
)
def test_learning_rate_defaults_are_the_ones_chosen_on_held_out_tables(dataset, private, tuning):
    """Each dataset, private or not, defaults to the rate its tuning run chose; a given rate wins."""
    chosen = json.loads((RESULTS / tuning).read_text())["chosen_learning_rate"]
    argv = ["--dataset", dataset, *([] if private else ["--disable_dp"])]
    assert t2t.parse_args(argv)[2].learning_rate == chosen
    assert t2t.parse_args([*argv, "--learning_rate", "3e-4"])[2].learning_rate == 3e-4
