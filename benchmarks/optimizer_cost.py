"""Per-step cost of each DP optimizer against its base, through ``DPTrainer``, in interleaved rounds.

One step = ``DPTrainer.train_one_step`` (public: per-example clipping as the optimizer's plan asks, one or
two gradient evaluations, ℓ2 or scaled geometry; the release, noise added and accounted; the update rule;
``zero_grad``), on a tied GPT-2-shaped model (random weights, a fixed random token batch, fp32, σ = 1,
C = 1, ghost clipping). The pairs and the bars they are held to:

- ``disk_single`` vs ``adamw``: DiSK with γ = (1−κ)/κ (κ = 0.7), so c = 1 and each step evaluates the
  gradient once, at θ + γd; bar ≤ 1.1×.
- ``disk`` vs ``adamw``: DiSK at its default κ = 0.7, γ = 0.5, two evaluations per step; bar ≤ 2.1×.
- ``doppler`` vs ``sgd`` (first-order filter ver.1), ``stp`` (dense scale) and ``stp_factored`` (rank-1
  scale, ghost-compatible: our extension) vs ``adam``, ``dp2_adaptive`` vs ``sgd`` (DP²'s adaptive phase,
  clipping in the scaled geometry; its SGD phase is plain DP-SGD), ``adam_bc`` vs ``adam``: no bar.

Every round runs every variant once, in an order that rotates every round; the machine is shared, so the
ratios reported are the median of per-round PAIRED ratios and the ratio of minimum times. The first
``WARMUP_STEPS`` steps are not timed (DPTrainer checks its engine against autograd on the first; DiSK's
first step has d = 0 and evaluates once; DP² is in its adaptive phase from step 2 on).

    python benchmarks/optimizer_cost.py [--layers 4 --width 256 --heads 4 --vocab 16384 --seq 128 --batch 16
                                         --rounds 8 --threads 1 --out benchmarks/results/optimizer_cost.json]

    # the DiSK bars at GPT-2-small width (benchmarks/results/optimizer_cost_disk_gpt2_width.json)
    python benchmarks/optimizer_cost.py --variants adamw disk_single disk --width 768 --heads 12 --layers 2 \
        --vocab 50257 --batch 8 --rounds 8 --out benchmarks/results/optimizer_cost_disk_gpt2_width.json
    # ... and at full GPT-2 small (benchmarks/results/optimizer_cost_disk_gpt2_small.json; with
    # HF_DP_KEEP_CPU_HEAP=0 in front, glibc's default allocator: ..._heap_not_kept.json)
    python benchmarks/optimizer_cost.py --variants adamw disk_single disk --width 768 --heads 12 --layers 12 \
        --vocab 50257 --batch 4 --rounds 5 --out benchmarks/results/optimizer_cost_disk_gpt2_small.json
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # measure this checkout's hf_dp, whatever is installed
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks import _timing  # noqa: E402  (sets the offline environment first)

# isort: split

import torch  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments, cpu_heap  # noqa: E402
from hf_dp.clipping.plan import HasStepPlan, StepPlan  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "optimizer_cost.json"
WARMUP_STEPS = 3
KAPPA = 0.7

# name -> (dp_optimizer, dp_optimizer_kwargs)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("sgd", {}),
    "adam": ("adam", {}),
    "adamw": ("adamw", {}),
    "disk_single": ("disk", {"kappa": KAPPA, "gamma": (1 - KAPPA) / KAPPA, "base": "adamw"}),
    "disk": ("disk", {"kappa": KAPPA, "gamma": 0.5, "base": "adamw"}),
    "doppler": ("doppler", {"base": "sgd", "filter": "first_order_v1"}),
    "stp": ("stp", {"factored": False}),
    "stp_factored": ("stp", {"factored": True}),
    "dp2_adaptive": ("dp2", {"sgd_steps": 1, "adaptive_steps": 10**9, "adaptive_clip_norm": 1.0}),
    "adam_bc": ("adam_bc", {}),
}
# (variant, base, bar on the step-time ratio or None)
PAIRS: tuple[tuple[str, str, float | None], ...] = (
    ("disk_single", "adamw", 1.1),
    ("disk", "adamw", 2.1),
    ("doppler", "sgd", None),
    ("stp", "adam", None),
    ("stp_factored", "adam", None),
    ("dp2_adaptive", "sgd", None),
    ("adam_bc", "adam", None),
)


@dataclass
class Config:
    layers: int = 4
    width: int = 256
    heads: int = 4
    vocab: int = 16384
    seq: int = 128
    batch: int = 16
    rounds: int = 8
    threads: int = 1
    seed: int = 0


def build_variant(
    name: str, cfg: Config, base: GPT2LMHeadModel, batch: dict[str, torch.Tensor]
) -> _timing.Variant:
    """A DPTrainer with ``name``'s optimizer on a copy of ``base``."""
    dp_optimizer, kwargs = VARIANTS[name]
    tmp = tempfile.TemporaryDirectory(prefix="hf_dp_optimizer_cost_")
    args = DPTrainingArguments(
        output_dir=tmp.name,
        noise_multiplier=1.0,
        per_sample_max_grad_norm=1.0,
        per_device_train_batch_size=cfg.batch,
        learning_rate=1e-4,
        weight_decay=0.0,
        dp_optimizer=dp_optimizer,
        dp_optimizer_kwargs=kwargs,
        seed=cfg.seed,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
    )
    row = {"input_ids": batch["input_ids"][0], "labels": batch["labels"][0]}
    trainer = DPTrainer(model=copy.deepcopy(base), args=args, train_dataset=[row] * (100 * cfg.batch))
    trainer.create_optimizer()
    # public: every micro-batch's DP backward, the release (noise added and accounted), the update
    return _timing.Variant(name, step=lambda: trainer.train_one_step([batch]), keep=[tmp, trainer])


def record_plan(variant: _timing.Variant) -> None:
    """What the optimizer's plan asks of the next step (a pure read of its state)."""
    optimizer = variant.keep[1].optimizer
    plan = optimizer.plan_step(1.0) if isinstance(optimizer, HasStepPlan) else StepPlan(clip_norm=1.0)
    variant.info.update(evaluations_per_step=len(plan.evaluations), scaled_clipping=bool(plan.clip_scale))


def summarise(variants: dict[str, _timing.Variant]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    per_variant = {}
    for name, v in variants.items():
        v.info.setdefault("evaluations_per_step", None)
        v.info.setdefault("scaled_clipping", None)
        per_variant[name] = {
            "dp_optimizer": VARIANTS[name][0],
            "dp_optimizer_kwargs": VARIANTS[name][1],
            **_timing.timing_summary(v),
        }
    pairs = []
    for variant, base, bar in PAIRS:
        if variant not in variants or base not in variants:
            continue
        r = _timing.paired_ratios(variants[variant].times, variants[base].times)
        entry: dict[str, Any] = {"variant": variant, "base": base, "bar": bar, "ratio": r}
        if r is not None and bar is not None:
            entry["meets_bar_paired_median"] = r["paired_median"] <= bar
            entry["meets_bar_min_time"] = r["min_time"] <= bar
        pairs.append(entry)
    return per_variant, pairs


def run_in_process(names: list[str], cfg: Config) -> tuple[dict[str, _timing.Variant], list[list[str]]]:
    """All variants built in this process, warmed up, then timed one step each per round."""
    base = _timing.tied_gpt2(cfg.layers, cfg.width, cfg.heads, cfg.vocab, cfg.seq, cfg.seed)
    batch = _timing.token_batch(cfg.batch, cfg.seq, cfg.vocab, cfg.seed)
    variants = {n: _timing.build(n, lambda n=n: build_variant(n, cfg, base, batch)) for n in names}
    return variants, _timing.interleaved(variants, cfg.rounds, WARMUP_STEPS, before=record_plan)


def run_isolated(names: list[str], cfg: Config) -> tuple[dict[str, _timing.Variant], list[list[str]]]:
    """Each (round, variant) in a fresh process (build, warm up, time one step), as a user runs one optimizer:
    no variant inherits another's allocator heap or caches. The rounds still interleave the variants, so a
    change of machine speed hits all of them alike."""
    variants = {name: _timing.Variant(name) for name in names}
    orders = _timing.rotations(list(variants), cfg.rounds)
    flags = [f"--{k}={v}" for k, v in asdict(cfg).items() if k != "rounds"]
    with tempfile.TemporaryDirectory() as tmp:
        for r, order in enumerate(orders):
            for name in order:
                out = Path(tmp) / f"{name}.json"
                command = [
                    sys.executable,
                    __file__,
                    *flags,
                    "--rounds=1",
                    "--variants",
                    name,
                    "--out",
                    str(out),
                ]
                subprocess.run(command, check=True, capture_output=True)
                child, variant = json.loads(out.read_text())["times"][name], variants[name]
                variant.times.append(child["times_s"][0])
                variant.info.update(
                    evaluations_per_step=child["evaluations_per_step"],
                    scaled_clipping=child["scaled_clipping"],
                )
                variant.error = variant.error or child["error"]
            _timing.print_round(r, cfg.rounds, order, variants)
    return variants, orders


def print_table(result: dict[str, Any]) -> None:
    print(f"\nstep time, {result['config']}")
    print(f"{'variant':<14}{'median s':>10}{'min s':>9}{'evals':>6}{'scaled':>7}  error")
    for name, t in result["times"].items():
        print(
            f"{name:<14}{_timing.fmt(t['median_s']):>10}{_timing.fmt(t['min_s']):>9}"
            f"{_timing.fmt(t['evaluations_per_step'], 'd'):>6}"
            f"{str(t['scaled_clipping']):>7}  {t['error'] or ''}"
        )
    print(f"\n{'variant / base':<28}{'paired median':>14}{'min-time':>10}{'bar':>6}")
    for p in result["pairs"]:
        r = p["ratio"] or {}
        print(
            f"{p['variant'] + ' / ' + p['base']:<28}{_timing.fmt(r.get('paired_median'), '.2f'):>14}"
            f"{_timing.fmt(r.get('min_time'), '.2f'):>10}{_timing.fmt(p['bar'], '.1f'):>6}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in asdict(Config()).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="toy model, 1 round (the smoke test)")
    parser.add_argument(
        "--isolated", action="store_true", help="time each (round, variant) in a fresh process"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = Config(**{name: getattr(args, name) for name in asdict(Config())})
    if args.quick:
        cfg = Config(layers=1, width=32, heads=2, vocab=128, seq=16, batch=4, rounds=1, threads=1)
    torch.set_num_threads(cfg.threads)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*bos_token_id.*")
    load_before = list(os.getloadavg())
    variants, orders = (run_isolated if args.isolated else run_in_process)(args.variants, cfg)
    per_variant, pairs = summarise(variants)
    result = {
        "benchmark": "optimizer_cost",
        "date": _dt.date.today().isoformat(),
        "config": {
            **asdict(cfg),
            "dtype": "float32",
            "clipping_mode": "ghost",
            "noise_multiplier": 1.0,
            "per_sample_max_grad_norm": 1.0,
            "warmup_steps": WARMUP_STEPS,
            "tied_embeddings": True,
            "isolated_processes": args.isolated,
        },
        "environment": _timing.environment(
            load_average_at_start=load_before,
            cpu_heap_kept=cpu_heap.is_kept(),  # DPTrainer keeps it once DiSK evaluates twice (on CPU)
        ),
        "round_orders": orders,
        "times": per_variant,
        "pairs": pairs,
    }
    _timing.write_result(args.out, result)
    print_table(result)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
