"""Causal-LM fine-tuning in the style of transformers' ``examples/pytorch/language-modeling/run_clm.py``,
with the two swaps that make it private:

    TrainingArguments → DPTrainingArguments        Trainer → DPTrainer

Everything else is what a run_clm user already writes: ``HfArgumentParser``, ``--do_train`` / ``--do_eval``,
``train_results.json`` / ``eval_results.json`` / ``all_results.json`` (the train metrics carry ε, δ, σ, the
privacy unit and the steps). One record (one line of a text file, one row of a CSV/JSON file) is one training
example, truncated to ``--block_size`` tokens: the guarantee is per record. (run_clm's ``group_texts`` would
concatenate records into blocks, which would make the guarantee per block.)

    python examples/run_clm_dp.py --model_type llama --config_overrides hidden_size=64,num_hidden_layers=2 \\
        --tokenizer_name ../shared/data/tokenizers/gpt2 --train_file ../shared/data/e2e/trainset.csv \\
        --text_column_name ref --do_train --do_eval --max_steps 20 --target_epsilon 8 --output_dir out
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
)

from hf_dp import DPTrainer, DPTrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "A Hub id or a local folder."})
    model_type: str | None = field(default=None, metadata={"help": "Train from scratch: a model type."})
    config_overrides: str | None = field(default=None, metadata={"help": "From scratch: 'n_embd=10,...'."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "A Hub id or a local folder."})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "A .txt, .csv or .json(l) file."})
    validation_file: str | None = field(
        default=None, metadata={"help": "Default: the last rows of train_file."}
    )
    text_column_name: str = field(default="text", metadata={"help": "The column holding the text."})
    block_size: int = field(
        default=64, metadata={"help": "Tokens per record (longer records are truncated)."}
    )
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    validation_split_percentage: int = field(default=5)


def load_raw(data_args: DataTrainingArguments):
    files = {"train": data_args.train_file} if data_args.train_file else {}
    if data_args.validation_file:
        files["validation"] = data_args.validation_file
    if not files:
        raise ValueError("give --train_file or --validation_file")
    extension = next(iter(files.values())).rsplit(".", 1)[-1]
    raw = load_dataset({"txt": "text", "jsonl": "json"}.get(extension, extension), data_files=files)
    if "validation" not in raw and "train" in raw:
        split = raw["train"].train_test_split(test_size=data_args.validation_split_percentage / 100, seed=0)
        raw["train"], raw["validation"] = split["train"], split["test"]
    return raw


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, DPTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or "<|endoftext|>"
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    else:
        config = CONFIG_MAPPING[model_args.model_type]()
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        config.vocab_size = len(tokenizer)
        config.pad_token_id = tokenizer.pad_token_id
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_dict()))

    raw = load_raw(data_args)
    column = data_args.text_column_name

    def tokenize(rows):
        return tokenizer(rows[column], truncation=True, max_length=data_args.block_size)

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw[next(iter(raw))].column_names)
    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = tokenized["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        eval_dataset = tokenized["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )

    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 700))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    sys.exit(main())
