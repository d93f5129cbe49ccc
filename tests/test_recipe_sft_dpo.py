"""recipes/sft.py and recipes/dpo.py: the E2E conversations and preference pairs, and each recipe end to end at
toy size on real data (printed loss and ε, the final line and the results file)."""

from __future__ import annotations

import ast
import json
import math
import re

import pytest

from recipes import dpo, sft

TINY_LLAMA = '{"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32}'
TOY = [
    "--from_scratch", "--model_config", TINY_LLAMA,
    "--max_train_samples", "48",
    "--max_eval_samples", "4",
    "--max_length", "96",
    "--max_steps", "2",
    "--per_device_train_batch_size", "4",
    "--gradient_accumulation_steps", "2",
    "--per_device_eval_batch_size", "4",
    "--logging_steps", "1",
]  # fmt: skip
SFT_LINE = re.compile(r"E2E chat SFT: dev loss (\S+) at epsilon (\S+) \(delta \S+, 2 steps\)")
DPO_LINE = re.compile(
    r"E2E DPO: dev reward accuracy (\S+) \(loss (\S+)\) at epsilon (\S+) \(delta \S+, 2 steps\)"
)


def logged(out: str) -> list[dict]:
    """The training logs the Trainer printed (one dict a line, values as strings)."""
    return [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{'loss'")]


def check(out: str, record: dict, results, epsilon_bound: float) -> dict:
    logs = logged(out)
    assert len(logs) == 2 and all(
        math.isfinite(float(log["loss"])) and float(log["epsilon"]) > 0 for log in logs
    )
    written = json.loads(results.read_text())
    assert (
        written["steps"] == 2 and math.isfinite(written["train_loss"]) and math.isfinite(written["eval_loss"])
    )
    assert 0 < written["epsilon"] <= epsilon_bound
    assert (
        written["epsilon"]
        == pytest.approx(record["epsilon"])
        == pytest.approx(float(logs[-1]["epsilon"]), abs=1e-3)
    )
    return written


def test_e2e_conversations_and_preference_pairs(shared_data):
    rows = sft.read_e2e_rows(shared_data / "e2e" / "trainset.csv", 40)
    assert len(rows) == 40 and rows[0]["mr"].startswith("name[The Vaults]")
    chat = sft.conversation(rows[0])["messages"]
    assert [m["role"] for m in chat] == ["user", "assistant"]
    assert rows[0]["mr"] in chat[0]["content"] and chat[1]["content"] == rows[0]["ref"]
    pairs = dpo.preference_pairs(rows)
    mrs = list(dict.fromkeys(row["mr"] for row in rows))
    assert len(pairs) == len(mrs) and len(dpo.preference_pairs(rows, 3)) == 3
    for k, pair in enumerate(pairs):
        refs = {row["ref"] for row in rows if row["mr"] == mrs[k]}
        assert mrs[k] in pair["prompt"][0]["content"]
        assert pair["chosen"][0]["content"] in refs and pair["rejected"][0]["content"] not in refs
    tokenizer = sft.load_chat_tokenizer(sft.ModelArguments(from_scratch=True))
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert text == f"User: {chat[0]['content']}\nAssistant: {rows[0]['ref']}<|endoftext|>"
    masks = tokenizer.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    trained = [t for t, m in zip(masks["input_ids"], masks["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(trained) == f" {rows[0]['ref']}<|endoftext|>"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--no_lora"], ["--lora", "--packing"]], ids=["full", "lora_packed"])
def test_sft_recipe_end_to_end(extra, shared_data, tmp_path, capsys):
    results = tmp_path / "sft.json"
    trainer, record = sft.run(
        [*TOY, *extra, "--target_epsilon", "3", "--output_dir", str(tmp_path), "--results_json", str(results)]
    )
    out = capsys.readouterr().out
    final = SFT_LINE.search(out)
    assert final, out[-3000:]
    written = check(out, record, results, epsilon_bound=3.0)
    assert float(final.group(1)) == pytest.approx(written["eval_loss"], abs=1e-4)
    assert written["privacy_unit"] == "example" and written["num_train_examples"] == 48
    assert written["settings"]["training"]["assistant_only_loss"] is True
    assert trainer.args.packing is ("--packing" in extra)
    if "--lora" in extra:
        assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--no_lora"], ["--lora"]], ids=["full_with_reference_copy", "lora"])
def test_dpo_recipe_end_to_end(extra, shared_data, tmp_path, capsys):
    results = tmp_path / "dpo.json"
    trainer, record = dpo.run(
        [
            *TOY,
            *extra,
            "--noise_multiplier",
            "1.0",
            "--output_dir",
            str(tmp_path),
            "--results_json",
            str(results),
        ]
    )
    out = capsys.readouterr().out
    final = DPO_LINE.search(out)
    assert final, out[-3000:]
    written = check(out, record, results, epsilon_bound=20.0)
    assert written["noise_multiplier"] == 1.0 and 0 <= written["eval_reward_accuracy"] <= 1
    assert float(final.group(1)) == pytest.approx(written["eval_reward_accuracy"], abs=1e-4)
    assert written["privacy_unit"] == "pair" and trainer.privacy_report()["unit"] == "pair"
    lora = "--lora" in extra
    assert written["reference"] == ("adapters disabled" if lora else "frozen copy")
    assert (trainer.ref_model is None) == lora
