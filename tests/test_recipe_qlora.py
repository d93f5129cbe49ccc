"""``--load_in_4bit`` (QLoRA) in the SFT, DPO, table-to-text and GLUE recipes: a pretrained base loaded in
bitsandbytes nf4 with double quantisation, frozen, LoRA adapters (float32) trained under DP; one-line refusals
where it cannot apply. Toy size on real data: one step each."""

from __future__ import annotations

import math
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from recipes import dpo, glue, sft, table2text
from recipes.common import shared_data_dir

pytestmark = pytest.mark.slow  # recipe runs
GPT2_TOKENIZER = str(shared_data_dir() / "tokenizers" / "gpt2")
ONE_STEP = ["--max_steps", "1", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"]
CHAT = [*ONE_STEP, "--max_train_samples", "16", "--max_eval_samples", "2", "--max_length", "64"]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A tiny pretrained Llama, vocabulary of the chat tokenizer."""
    tokenizer = sft.load_chat_tokenizer(sft.ModelArguments(tokenizer_name=GPT2_TOKENIZER))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _qlora_trained(trainer, record: dict) -> None:
    quantized = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized and all(m.weight.quant_state.quant_type == "nf4" for m in quantized)
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or "modules_to_save" in n for n in trained), sorted(trained)
    assert all(p.dtype == torch.float32 for p in trained.values())  # TRL's bf16 cast undone under DP
    assert 0 < record["epsilon"] < math.inf


@pytest.mark.parametrize("recipe", [sft, dpo], ids=["sft", "dpo"])
def test_chat_recipes_train_lora_on_a_4bit_base(recipe, llama_folder, shared_data, tmp_path):
    budget = ["--noise_multiplier", "1.0"] if recipe is dpo else ["--target_epsilon", "3"]
    trainer, record = recipe.run(
        [*CHAT, *budget, "--model_name_or_path", str(llama_folder), "--tokenizer_name", GPT2_TOKENIZER,
         "--lora", "--load_in_4bit", "--output_dir", str(tmp_path), "--results_json", str(tmp_path / "r.json")]
    )  # fmt: skip
    _qlora_trained(trainer, record)


def test_table2text_trains_lora_on_a_4bit_gpt2(shared_data, tmp_path):
    folder = tmp_path / "gpt2"
    tokenizer = table2text.load_tokenizer(table2text.ModelArguments(tokenizer_name=GPT2_TOKENIZER))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=128)
    GPT2LMHeadModel(config).save_pretrained(folder)
    trainer, record = table2text.run(
        [*ONE_STEP, "--max_train_samples", "16", "--max_eval_samples", "1", "--max_seq_length", "64",
         "--num_beams", "1", "--max_new_tokens", "4", "--model_name_or_path", str(folder), "--tokenizer_name",
         GPT2_TOKENIZER, "--use_lora", "--load_in_4bit", "--output_dir", str(tmp_path / "out"),
         "--results_json", str(tmp_path / "r.json")]
    )  # fmt: skip
    _qlora_trained(trainer, record)


def test_glue_trains_lora_and_a_float32_head_on_a_4bit_minilm(shared_data, tmp_path):
    trainer, record = glue.run(
        ["--task_name", "sst2", *ONE_STEP, "--max_train_samples", "16", "--max_eval_samples", "8",
         "--use_lora", "--load_in_4bit", "--output_dir", str(tmp_path), "--results_json", str(tmp_path / "r.json")]
    )  # fmt: skip
    _qlora_trained(trainer, record)
    heads = [m for n, m in trainer.model.named_modules() if n.endswith("modules_to_save.default")]
    assert heads and not any(isinstance(m, bnb.nn.Linear4bit) for h in heads for m in h.modules())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--no_lora", "--load_in_4bit"], "cannot be trained: add --use_lora"),
        (["--from_scratch", "--load_in_4bit"], "quantises a pretrained base: drop --from_scratch"),
        (["--lora", "--load_in_4bit", "--bnb_4bit_quant_type", "int4"], "use nf4 or fp4"),
    ],
)
def test_load_in_4bit_where_it_cannot_apply_is_one_line(flags, message, shared_data, tmp_path):
    with pytest.raises(ValueError, match=message) as error:
        sft.run([*CHAT, *flags, "--output_dir", str(tmp_path)])
    assert "\n" not in str(error.value)
