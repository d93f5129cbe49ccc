"""Time one full training step (forward, backward, optimizer step, zero_grad) for four variants.

Variants, all on the same tied GPT-2-shaped model (random weights, random token batch, every label
valid, fp32, AdamW, 2 threads):

- ``non_private``: a stock ``transformers.Trainer``'s ``training_step`` (the model's own loss) + step;
- ``dp_ghost`` / ``dp_per_sample``: ``hf_dp.DPTrainer`` (σ = 1, C = 1) ``training_step`` + step;
- ``opacus_ghost``: Opacus ghost ("fast gradient") clipping, on an UNTIED copy of the model with explicit
  (B, T) position_ids (Opacus ghost mode refuses tied embeddings and breaks on broadcast position_ids).

The machine jumps between speed regimes, so each round runs every variant once, in an order that rotates
every round, and the ratios reported are medians of per-round PAIRED ratios (and ratios of minimum times).
Peak memory is measured per variant in its own subprocess (``--memory-only VARIANT``).

    python benchmarks/step_speed.py [--layers 6 --width 512 --heads 8 --vocab 16384 --seq 128 --batch 16
                                     --rounds 6 --out benchmarks/results/step_speed.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The repository root first, so the script measures this checkout's hf_dp even without an up-to-date
# editable install (a stale one once resolved hf_dp to an empty namespace package).
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import _timing  # noqa: E402  (sets the offline environment first)
from benchmarks._memory import LAUNCHER, reset_peak_rss, vm_hwm_kb  # noqa: E402
from benchmarks._timing import Variant, fmt, gpt2_config  # noqa: E402

# isort: split

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from transformers import GPT2LMHeadModel, Trainer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402

VARIANTS = ("non_private", "dp_ghost", "dp_per_sample", "opacus_ghost")
DP_VARIANTS = ("dp_ghost", "dp_per_sample")
BASELINES = ("non_private", "opacus_ghost")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "step_speed.json"
MEMORY_MARKER = "STEP_SPEED_MEMORY_JSON "
NUM_THREADS = 2
WARMUP_STEPS = 2
MEMORY_WARMUP_STEPS = 1
MEMORY_STEPS = 2
IGNORE_INDEX = -100

NOTES = [
    "One step = forward + backward + optimizer.step() + optimizer.zero_grad() on one batch of `batch` examples.",
    "non_private: stock transformers.Trainer.training_step (the model's own token-mean loss; "
    "current_gradient_accumulation_steps set to 1, as Trainer.train() would) with "
    "optim='adamw_torch' (plain torch.optim.AdamW, the same update rule the DP variants use; the Trainer's "
    "default would be fused AdamW).",
    "dp_ghost / dp_per_sample: hf_dp.DPTrainer.train_one_step on the batch (all B examples real), i.e. "
    "the DP backward, the release (noise sigma=1.0, C=1.0, division by the expected batch size B, one accounted "
    "step), the AdamW update and zero_grad. "
    "DPTrainer verifies its engine against autograd on its first training_step only; that step is a warm-up "
    "step here and is never timed.",
    "opacus_ghost: Opacus PrivacyEngine.make_private(grad_sample_mode='ghost') on a COPY of the model built with "
    "tie_word_embeddings=False (lm_head initialised from wte; Opacus ghost mode refuses tied parameters), so it "
    "has vocab*width more trainable parameters than the others, and called with explicit (B, T) position_ids "
    "(HF GPT-2's broadcast (1, T) position_ids break Opacus ghost mode). Loss: the returned criterion "
    "(CrossEntropyLoss, reduction mean, ignore_index -100) on the flattened (B*T, V) logits against labels "
    "shifted left and padded with -100, with shape=(B, T, V), i.e. the per-example mean of next-token CE, "
    "the same per-example loss as hf_dp. loss.backward() runs Opacus' two backward passes. Opacus has no "
    "norm rule for HF Conv1D, so those layers fall back to functorch per-sample gradients.",
    "Paired ratio: the median over rounds of time(variant)/time(baseline) measured in the same round; "
    "min-time ratio: min time(variant) / min time(baseline). Throughput ratio = 1 / step-time ratio.",
    "Memory: each variant in its own subprocess (build, warm up 1 step, run 2 steps), started through a tiny "
    "launcher process because Linux carries the parent's peak RSS across fork+exec into the child's "
    "ru_maxrss (started directly, every child reported the timing process's own peak). ru_maxrss_mb is the "
    "process peak including imports, model build and the warm-up step (for DPTrainer that is the step that "
    "also verifies the engine against autograd); peak_rss_vmhwm_mb is the same peak read from "
    "/proc/self/status (a cross-check); steady_peak_rss_mb is VmHWM after resetting it "
    "(/proc/self/clear_refs) once the warm-up step is done, i.e. the peak of the 2 steady-state steps only.",
]


@dataclass
class Config:
    layers: int = 6
    width: int = 512
    heads: int = 8
    vocab: int = 16384
    seq: int = 128
    batch: int = 16
    rounds: int = 6
    seed: int = 0


# ---- model, batch, variants ----------------------------------------------------------------------------


def build_model(cfg: Config) -> GPT2LMHeadModel:
    return _timing.tied_gpt2(cfg.layers, cfg.width, cfg.heads, cfg.vocab, cfg.seq, cfg.seed)


def make_batch(cfg: Config) -> dict[str, torch.Tensor]:
    return _timing.token_batch(cfg.batch, cfg.seq, cfg.vocab, cfg.seed)


def _dummy_dataset(cfg: Config) -> list[dict[str, torch.Tensor]]:
    row = {
        "input_ids": torch.zeros(cfg.seq, dtype=torch.long),
        "labels": torch.zeros(cfg.seq, dtype=torch.long),
    }
    return [row] * (100 * cfg.batch)


def _trainer_args(cfg: Config, tmpdir: str, **privacy) -> DPTrainingArguments:
    return DPTrainingArguments(
        output_dir=tmpdir,
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=cfg.batch,
        seed=cfg.seed,
        save_strategy="no",
        logging_strategy="no",
        **privacy,
    )


def _trainer_step(trainer: Trainer, model: torch.nn.Module, batch: dict) -> Callable[[], float]:
    def step() -> float:
        loss = trainer.training_step(model, batch)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return step


def build_non_private(cfg: Config, base: GPT2LMHeadModel, batch: dict) -> Variant:
    tmpdir = tempfile.TemporaryDirectory(prefix="step_speed_")
    model = copy.deepcopy(base)
    args = _trainer_args(cfg, tmpdir.name, disable_dp=True, optim="adamw_torch")
    trainer = Trainer(model=model, args=args, train_dataset=_dummy_dataset(cfg))
    trainer.create_optimizer()
    # Set by Trainer.train() for each accumulation window; training_step divides the loss by it.
    trainer.current_gradient_accumulation_steps = 1
    model_batch = dict(batch)
    variant = Variant("non_private", step=_trainer_step(trainer, model, model_batch), keep=[tmpdir, trainer])
    variant.notes.append(
        f"optimizer: {type(trainer.optimizer).__name__} {_optimizer_defaults(trainer.optimizer)}"
    )
    return variant


def build_dp(cfg: Config, base: GPT2LMHeadModel, batch: dict, mode: str) -> Variant:
    tmpdir = tempfile.TemporaryDirectory(prefix="step_speed_")
    model = copy.deepcopy(base)
    args = _trainer_args(
        cfg,
        tmpdir.name,
        noise_multiplier=1.0,
        per_sample_max_grad_norm=1.0,
        clipping_mode=mode,
        dp_optimizer="adamw",
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=_dummy_dataset(cfg))
    trainer.create_optimizer()
    if trainer.expected_batch_size != cfg.batch:
        raise RuntimeError(f"DPTrainer expected batch {trainer.expected_batch_size} != {cfg.batch}")
    # public: the DP backward, the release (noise added and accounted), the update, zero_grad
    variant = Variant(f"dp_{mode}", step=lambda: trainer.train_one_step([batch]), keep=[tmpdir, trainer])
    variant.notes.append(
        f"optimizer: {type(trainer.optimizer).__name__} {_optimizer_defaults(trainer.optimizer)}"
    )
    return variant


def build_opacus(cfg: Config, base: GPT2LMHeadModel, batch: dict) -> Variant:
    from opacus import PrivacyEngine

    torch.manual_seed(cfg.seed)
    model = (
        GPT2LMHeadModel(gpt2_config(cfg.layers, cfg.width, cfg.heads, cfg.vocab, cfg.seq, tied=False))
        .float()
        .train()
    )
    if model.lm_head.weight is model.transformer.wte.weight:
        raise RuntimeError("tie_word_embeddings=False did not untie lm_head from wte")
    state = {k: v for k, v in base.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(
            f"copying weights into the untied model: missing {missing}, unexpected {unexpected}"
        )
    with torch.no_grad():
        model.lm_head.weight.copy_(base.transformer.wte.weight)
    # The Trainers' AdamW hyper-parameters. (No TrainingArguments here: building one resets the accelerate
    # state that the already-built Trainers use.)
    defaults = {
        k: DPTrainingArguments.__dataclass_fields__[k].default for k in ("learning_rate", "weight_decay")
    }
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=defaults["learning_rate"], weight_decay=defaults["weight_decay"]
    )
    loader = DataLoader(TensorDataset(torch.zeros(100 * cfg.batch, 1)), batch_size=cfg.batch)
    engine = PrivacyEngine()
    dp_model, dp_optimizer, criterion, _ = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
        criterion=torch.nn.CrossEntropyLoss(reduction="mean", ignore_index=IGNORE_INDEX),
        loss_reduction="mean",
    )
    if dp_optimizer.expected_batch_size != cfg.batch:
        raise RuntimeError(f"Opacus expected batch {dp_optimizer.expected_batch_size} != {cfg.batch}")
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    position_ids = torch.arange(cfg.seq).unsqueeze(0).repeat(cfg.batch, 1)  # (B, T), not broadcast
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()  # next-token targets

    def step() -> float:
        dp_model.train()
        logits = dp_model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        loss = criterion(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), shape=logits.shape)
        loss.backward()
        dp_optimizer.step()
        dp_optimizer.zero_grad(set_to_none=True)
        return loss.item()

    variant = Variant("opacus_ghost", step=step, keep=[engine, dp_model, dp_optimizer, criterion])
    variant.notes.append(f"optimizer: {type(optimizer).__name__} {_optimizer_defaults(optimizer)}")
    variant.notes.append(
        "untied copy (tie_word_embeddings=False) with explicit (B, T) position_ids; "
        f"{sum(p.numel() for p in model.parameters())} trainable parameters vs "
        f"{sum(p.numel() for p in base.parameters())} in the tied model"
    )
    return variant


BUILDERS: dict[str, Callable[[Config, GPT2LMHeadModel, dict], Variant]] = {
    "non_private": build_non_private,
    "dp_ghost": lambda cfg, base, batch: build_dp(cfg, base, batch, "ghost"),
    "dp_per_sample": lambda cfg, base, batch: build_dp(cfg, base, batch, "per_sample"),
    "opacus_ghost": build_opacus,
}


def _optimizer_defaults(optimizer: torch.optim.Optimizer) -> dict:
    keys = ("lr", "betas", "eps", "foreach", "fused")
    found = {k: optimizer.defaults.get(k) for k in keys if k in optimizer.defaults}
    found["group_weight_decays"] = [g.get("weight_decay") for g in optimizer.param_groups]
    return found


def build_variant(name: str, cfg: Config, base: GPT2LMHeadModel, batch: dict) -> Variant:
    return _timing.build(name, lambda: BUILDERS[name](cfg, base, batch))


# ---- statistics -----------------------------------------------------------------------------------------


def _ratios(times: dict[str, list[float | None]], num: str, den: str) -> dict | None:
    ratios = _timing.paired_ratios(times.get(num, []), times.get(den, []))
    if ratios is None:
        return None
    return {
        **ratios,
        "throughput_paired": 1.0 / ratios["paired_median"],
        "throughput_min_time": 1.0 / ratios["min_time"],
    }


def summarise(variants: dict[str, Variant]) -> tuple[dict, dict]:
    per_variant, times = {}, {}
    for name, v in variants.items():
        times[name] = v.times
        per_variant[name] = {**_timing.timing_summary(v), "notes": v.notes}
    ratios = {}
    for num in (*DP_VARIANTS, "opacus_ghost"):
        for den in BASELINES:
            if num != den and num in variants and den in variants:
                ratios.setdefault(num, {})[f"vs_{den}"] = _ratios(times, num, den)
    return per_variant, ratios


# ---- memory ---------------------------------------------------------------------------------------------


def memory_only(name: str, cfg: Config) -> dict:
    """Build one variant, warm up, run MEMORY_STEPS steps; peak RSS of this process (MB)."""
    result: dict = {"variant": name}
    base, batch = build_model(cfg), make_batch(cfg)
    variant = build_variant(name, cfg, base, batch)
    del base
    for _ in range(MEMORY_WARMUP_STEPS):
        _timing.time_step(variant)
    hwm = vm_hwm_kb()
    result["peak_rss_vmhwm_mb"] = hwm / 1024 if hwm is not None else None  # so far; updated below
    reset = reset_peak_rss()
    for _ in range(MEMORY_STEPS):
        _timing.time_step(variant)
    result["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    hwm = vm_hwm_kb()
    result["steady_peak_rss_mb"] = hwm / 1024 if reset and hwm is not None else None
    if hwm is not None and result["peak_rss_vmhwm_mb"] is not None:
        result["peak_rss_vmhwm_mb"] = max(result["peak_rss_vmhwm_mb"], hwm / 1024)
    result["error"] = variant.error
    return result


def measure_memory(name: str, cfg: Config, timeout: float = 1800) -> dict:
    child = [sys.executable, str(Path(__file__).resolve()), "--memory-only", name, *_config_argv(cfg)]
    cmd = [sys.executable, "-c", LAUNCHER, *child]  # a fresh peak-RSS count (benchmarks/_memory.py)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"memory subprocess timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MEMORY_MARKER):
            return json.loads(line[len(MEMORY_MARKER) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"variant": name, "error": f"memory subprocess exited {proc.returncode}: " + " | ".join(tail)}


def _config_argv(cfg: Config) -> list[str]:
    return [
        *("--layers", str(cfg.layers), "--width", str(cfg.width), "--heads", str(cfg.heads)),
        *("--vocab", str(cfg.vocab), "--seq", str(cfg.seq), "--batch", str(cfg.batch)),
        *("--rounds", str(cfg.rounds), "--seed", str(cfg.seed)),
    ]


def memory_ratios(memory: dict[str, dict]) -> dict:
    out: dict = {}
    for key in ("ru_maxrss_mb", "peak_rss_vmhwm_mb", "steady_peak_rss_mb"):
        reference = memory.get("non_private", {})
        ref = None if reference.get("error") else reference.get(key)
        for name, m in memory.items():
            value = m.get(key)
            ratio = value / ref if ref and value and not m.get("error") else None
            out.setdefault(name, {})[key.replace("_mb", "_vs_non_private")] = ratio
    return out


# ---- entry point ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--memory-variants",
        nargs="*",
        choices=VARIANTS,
        default=None,
        help="variants whose peak memory to measure (default: all timed variants)",
    )
    p.add_argument("--memory-only", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def print_table(result: dict) -> None:
    times, ratios, memory = result["times"], result["ratios"], result.get("memory_ratios", {})
    print(f"\nstep time, {result['config']}")
    print(f"{'variant':<15}{'median s':>10}{'min s':>10}{'peak MB':>10}{'peak/np':>9}  error")
    for name, t in times.items():
        mem = result.get("memory", {}).get(name, {})
        print(
            f"{name:<15}{fmt(t['median_s']):>10}{fmt(t['min_s']):>10}{fmt(mem.get('ru_maxrss_mb'), '.0f'):>10}"
            f"{fmt(memory.get(name, {}).get('ru_maxrss_vs_non_private'), '.2f'):>9}  {t['error'] or ''}"
        )
    print(f"\n{'ratio (step time)':<30}{'paired median':>15}{'min-time':>10}{'throughput':>12}")
    for num, by_den in ratios.items():
        for den, r in by_den.items():
            label = f"{num} {den}"
            if r is None:
                print(f"{label:<30}{'-':>15}{'-':>10}{'-':>12}")
            else:
                print(
                    f"{label:<30}{r['paired_median']:>15.2f}{r['min_time']:>10.2f}{r['throughput_paired']:>12.2f}"
                )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = Config(
        args.layers, args.width, args.heads, args.vocab, args.seq, args.batch, args.rounds, args.seed
    )
    torch.set_num_threads(NUM_THREADS)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*bos_token_id.*")

    if args.memory_only:
        result = memory_only(args.memory_only, cfg)
        print(MEMORY_MARKER + json.dumps(result), flush=True)
        return result

    load_before = list(os.getloadavg())
    base, batch = build_model(cfg), make_batch(cfg)
    variants = {name: build_variant(name, cfg, base, batch) for name in args.variants}
    del base
    orders = _timing.interleaved(variants, cfg.rounds, WARMUP_STEPS)
    per_variant, ratios = summarise(variants)
    for v in variants.values():
        v.keep.clear()
        v.step = None
    variants.clear()

    memory_names = args.memory_variants if args.memory_variants is not None else list(args.variants)
    memory = {name: measure_memory(name, cfg) for name in memory_names}

    result = {
        "benchmark": "step_speed",
        "config": {
            **cfg.__dict__,
            "threads": NUM_THREADS,
            "dtype": "float32",
            "optimizer": "AdamW",
            "noise_multiplier": 1.0,
            "per_sample_max_grad_norm": 1.0,
            "warmup_steps": WARMUP_STEPS,
            "tied_embeddings": True,
        },
        "environment": _timing.environment(load_average_at_start=load_before),
        "round_orders": orders,
        "times": per_variant,
        "ratios": ratios,
        "memory": memory,
        "memory_ratios": memory_ratios(memory),
        "notes": NOTES,
    }
    _timing.write_result(args.out, result)
    print_table(result)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
