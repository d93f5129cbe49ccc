"""A run_clm.py-style script with only the class swap (examples/run_clm_dp.py), end to end as a user runs it:
train and evaluate, then evaluate the saved model alone; the result files carry the guarantee."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "run_clm_dp.py"
TINY_LLAMA = (
    "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2"
)


def run(*flags: str) -> None:
    common = [
        "--use_cpu",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--per_device_eval_batch_size",
        "8",
    ]
    subprocess.run([sys.executable, str(SCRIPT), *flags, *common], check=True, capture_output=True, text=True)


def test_train_then_eval_only_with_the_class_swap(tmp_path, shared_data):
    records = tmp_path / "records.csv"
    records.write_text("".join((shared_data / "e2e" / "trainset.csv").open().readlines()[:301]))
    tokenizer = str(shared_data / "tokenizers" / "gpt2")
    trained = tmp_path / "trained"
    run(
        "--model_type",
        "llama",
        "--config_overrides",
        TINY_LLAMA,
        "--tokenizer_name",
        tokenizer,
        "--train_file",
        str(records),
        "--text_column_name",
        "ref",
        "--do_train",
        "--do_eval",
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "16",
        "--target_epsilon",
        "3",
        "--output_dir",
        str(trained),
    )
    train = json.loads((trained / "train_results.json").read_text())
    everything = json.loads((trained / "all_results.json").read_text())
    assert 0 < train["epsilon"] <= 3 and train["privacy_unit"] == "example" and train["dp_steps"] == 3
    assert train["delta"] < 1 / train["train_samples"] and train["noise_multiplier"] > 0
    assert everything["epsilon"] == train["epsilon"] and everything["eval_loss"] > 0

    evaluated = tmp_path / "evaluated"
    run(
        "--model_name_or_path",
        str(trained),
        "--validation_file",
        str(records),
        "--text_column_name",
        "ref",
        "--do_eval",
        "--max_eval_samples",
        "16",
        "--output_dir",
        str(evaluated),
    )
    metrics = json.loads((evaluated / "eval_results.json").read_text())
    assert metrics["eval_samples"] == 16 and metrics["eval_loss"] > 0 and "epsilon" not in metrics
