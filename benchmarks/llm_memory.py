"""Peak memory and step time of private LLM fine-tuning, with and without activation checkpointing.

What it measures. A Llama-shaped model (``LlamaConfig``: by default 8 layers, hidden 512, intermediate 1408,
8 heads, 2 KV heads (GQA), vocab 32000, untied head, random weights) trains one logical batch of B random
sequences of T tokens (labels = input ids) per step, for every setting of

    T (--seq-lens, default 512 1024 2048) x tuning {full, lora (peft r=8, target_modules="all-linear")}
    x precision {fp32, bf16 (bf16=True: autocast, fp32 weights)} x activation checkpointing {off, on}.

Side by side in each setting (``--variants``):

- ``stock``: ``transformers.Trainer.training_step`` (the model's own loss) + ``optimizer.step()``;
- ``dp_off``: ``hf_dp.DPTrainer`` with ``disable_dp=True`` through ``train_one_step`` (no clipping, no noise);
- ``dp``: ``hf_dp.DPTrainer`` (sigma = 1, C = 1) through ``train_one_step``: clipping, noise, accounting;
- ``dp_chained`` (only when asked for): ``dp`` with the weighted pass's body back-propagated through the layers as
  one chain (replayed) instead of layer by layer (hf_dp/clipping/layerwise.py): what the layer-by-layer pass buys;
- ``opacus``: Opacus ghost clipping (``make_private(grad_sample_mode="ghost", poisson_sampling=False)``) in a
  plain loop: per-example next-token losses (``reduction="none"``) fed to ``DPTensorFastGradientClipping``.

Every variant uses torch AdamW with the Trainer's default hyper-parameters. The Trainer variants are prepared as
``Trainer.train()`` would prepare them (checkpointing enabled on the model with the arguments' kwargs, non-reentrant
by default; the model passed through ``accelerator.prepare_model``, which installs the bf16 autocast). The stock
Trainer and Opacus get the DPTrainer's collated batch (its ``data_collator`` on the first B rows of a dataset of
100 x B random rows). A variant that is refused or fails records its error's first line; the others go on.

- Peak memory: each variant in its own subprocess (started through step_speed.py's launcher, so it does not
  inherit this process's peak): build, one warm-up step, then the peak of two steps. CPU: the process's peak
  RSS (VmHWM reset through /proc/self/clear_refs after the warm-up), with glibc told to mmap every block of
  64 KiB or more so that freed tensors leave the RSS (``--malloc-default`` keeps glibc's defaults, as
  step_speed.py does); CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
- Step time: all variants of a setting in this process, one warm-up step each, then ``--rounds`` rounds of one
  step per variant in rotated order (benchmarks/_timing.py); min and median, and paired-median and min-time
  ratios against the stock Trainer of the same setting (and DP vs dp_off, DP vs Opacus).

Writes ``--out`` (JSON: every number, the environment) and the same name with ``.md`` (a table per setting,
the issue's bars as met / not met). Run it on an otherwise idle machine:

    .venv/bin/python benchmarks/llm_memory.py                       # the full grid (hours on 2 CPU cores)
    .venv/bin/python benchmarks/llm_memory.py --settings 'full-*-T512' --rounds 3
    .venv/bin/python benchmarks/llm_memory.py --device cuda --batch 4
    .venv/bin/python benchmarks/llm_memory.py --hidden 256 --intermediate 704 --vocab 16000 --seq-lens 1024 --batch 4
    .venv/bin/python benchmarks/llm_memory.py --quick --out /tmp/llm_memory_quick.json   # smoke test
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The repository root first, so that the script measures this checkout's hf_dp (and this benchmarks package,
# not the one Opacus installs into site-packages).
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import _llama, _timing  # noqa: E402  (_timing sets the offline environment first)
from benchmarks._llama import (  # noqa: E402
    CKPT_ARG,
    DATASET_BATCHES,
    MAX_GRAD_NORM,
    NOISE_MULTIPLIER,
    Shape,
)
from benchmarks._memory import LAUNCHER, reset_peak_rss, vm_hwm_kb  # noqa: E402
from benchmarks._timing import Variant, first_line, fmt  # noqa: E402

# isort: split

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_dp import DPTrainingArguments  # noqa: E402

VARIANTS = ("stock", "dp_off", "dp", "opacus", "dp_chained", "dp_groupwise")
DEFAULT_VARIANTS = ("stock", "dp_off", "dp", "opacus")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "llm_memory.json"
MEMORY_MARKER = "LLM_MEMORY_JSON "
LORA_R = 8
WARMUP_STEPS = (
    1  # DPTrainer verifies its engine against autograd on its first step: never timed, never peaked
)
MEMORY_STEPS = 2
# Every block of 64 KiB or more gets its own mmap (unmapped when freed), the heap top is trimmed: the RSS then
# follows the live tensors instead of what glibc keeps after the warm-up step.
TIGHT_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
# The issue's bars. Checkpointing on: DP peak / non-private peak and DP time / non-private time.
CKPT_PEAK_BAR = 1.1
CKPT_TIME_BARS = {"full": 1.6, "lora": 1.3}
# Checkpointing off, full fine-tuning at T = 2048: DP peak / non-private peak.
NO_CKPT_PEAK_BAR = {"tuning": "full", "seq": 2048, "limit": 1.0}
# The ratios reported for each setting: (numerator, denominator).
RATIO_PAIRS = (
    ("dp", "stock"),
    ("dp_off", "stock"),
    ("opacus", "stock"),
    ("dp", "dp_off"),
    ("dp", "opacus"),
    ("dp_chained", "stock"),
    ("dp", "dp_chained"),
)
QUICK_SHAPE = Shape(layers=2, hidden=64, intermediate=176, heads=4, kv_heads=2, vocab=1000)
QUICK_SEQ = 64


@dataclass(frozen=True)
class Setting:
    """One cell of the grid; its variants are compared with each other."""

    tuning: str  # "full" or "lora"
    precision: str  # "fp32" or "bf16" (autocast, fp32 weights)
    checkpointing: bool
    seq: int
    batch: int
    shape: Shape
    micro_batches: int = 1  # per step (gradient accumulation), B sequences each

    @property
    def name(self) -> str:
        name = f"{self.tuning}-{self.precision}-{'ckpt' if self.checkpointing else 'nockpt'}-T{self.seq}"
        return name if self.micro_batches == 1 else f"{name}-M{self.micro_batches}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Setting:
        fields = json.loads(text)
        return cls(**{**fields, "shape": Shape(**fields["shape"])})


def grid(seq_lens: list[int], batch: int, shape: Shape, micro_batches: int = 1) -> list[Setting]:
    """Every setting, grouped by T, checkpointing off and on next to each other."""
    return [
        Setting(tuning, precision, ckpt, seq, batch, shape, micro_batches)
        for seq in seq_lens
        for tuning in ("full", "lora")
        for precision in ("fp32", "bf16")
        for ckpt in (False, True)
    ]


# ---- model, data, variants ------------------------------------------------------------------------------


def build_model(s: Setting, device: str) -> nn.Module:
    """The seeded random Llama (fp32 weights, drawn on the CPU: the same on every device), LoRA-wrapped for
    ``lora``; the same weights in every variant."""
    return _llama.build_llama(s.shape, s.seq, device, s.tuning, lora_r=LORA_R, init_on_device=False)


def make_rows(s: Setting) -> list[dict[str, torch.Tensor]]:
    """N = 100 x B examples of T random token ids, labels = input ids (every token a target)."""
    return _llama.token_rows(DATASET_BATCHES * s.batch, s.seq, s.shape.vocab)


def _args(
    cls: type[TrainingArguments], s: Setting, device: str, folder: str, **extra: Any
) -> TrainingArguments:
    return _llama.training_args(
        cls,
        device,
        folder,
        per_device_train_batch_size=s.batch,
        gradient_accumulation_steps=s.micro_batches,
        bf16=s.precision == "bf16",
        optim="adamw_torch",  # plain torch AdamW: the update rule of every variant
        **{CKPT_ARG: s.checkpointing},
        **extra,
    )


def build_stock(s: Setting, rows: list[dict], device: str) -> Variant:
    folder = tempfile.TemporaryDirectory(prefix="llm_memory_")
    args = _args(TrainingArguments, s, device, folder.name)
    step, trainer, model = _llama.stock_step(
        build_model(s, device), args, rows, s.batch, s.micro_batches, device
    )
    variant = Variant("stock", step=step, keep=[folder, trainer])
    _llama.model_info(model, variant.info)
    return variant


def build_dp(
    s: Setting, rows: list[dict], device: str, private: bool, chained: bool = False, groupwise: bool = False
) -> Variant:
    """DPTrainer's step; ``chained``: the layers below the tail chained (replayed) after the first step;
    ``groupwise``: clipping_groups="layer", each group clipped and summed in the one backward."""
    folder = tempfile.TemporaryDirectory(prefix="llm_memory_")
    privacy: dict[str, Any] = (
        {"noise_multiplier": NOISE_MULTIPLIER, "per_sample_max_grad_norm": MAX_GRAD_NORM}
        if private
        else {"disable_dp": True}
    )
    if groupwise:
        privacy["clipping_groups"] = "layer"
    args = _args(DPTrainingArguments, s, device, folder.name, dp_optimizer="adamw", **privacy)
    trainer, batches = _llama.dp_trainer(build_model(s, device), args, rows, s.batch, s.micro_batches, device)
    model = trainer.model_wrapped
    name = "dp_chained" if chained else "dp_groupwise" if groupwise else "dp" if private else "dp_off"

    if chained and trainer.dp.clipping is not None:
        trainer.dp.clipping.force(
            layerwise=False
        )  # the first step still checks; later steps chain the layers

    def step() -> float:
        loss = trainer.train_one_step(batches)
        # how many checkpointed layers the checked tail reaches down over (docs/clipping.md)
        calibration = getattr(trainer.dp.clipping, "calibration", None)
        variant.info["tail_layers"] = None if calibration is None else calibration.tail_layers
        variant.info["layerwise"] = None if calibration is None else calibration.layerwise
        return loss

    variant = Variant(name, step=step, keep=[folder, trainer])
    _llama.model_info(model, variant.info)
    strategy = trainer.dp.clipping
    variant.info["clipping_strategy"] = type(strategy).__name__ if strategy is not None else None
    variant.info["norms_in_backward"] = getattr(strategy, "norms_in_backward", None)
    return variant


def build_opacus(s: Setting, rows: list[dict], device: str) -> Variant:
    if s.micro_batches > 1:
        raise ValueError("the opacus variant takes one micro-batch a step: leave --micro-batches at 1")
    model = build_model(s, device)
    step, keep = _llama.opacus_step(model, rows, s.batch, device, s.checkpointing, bf16=s.precision == "bf16")
    variant = Variant("opacus", step=step, keep=keep)
    _llama.model_info(model, variant.info)
    return variant


BUILDERS: dict[str, Callable[[Setting, list[dict], str], Variant]] = {
    "stock": build_stock,
    "dp_off": lambda s, rows, device: build_dp(s, rows, device, private=False),
    "dp": lambda s, rows, device: build_dp(s, rows, device, private=True),
    "opacus": build_opacus,
    "dp_chained": lambda s, rows, device: build_dp(s, rows, device, private=True, chained=True),
    "dp_groupwise": lambda s, rows, device: build_dp(s, rows, device, private=True, groupwise=True),
}


def build_variant(name: str, s: Setting, rows: list[dict], device: str) -> Variant:
    return _timing.build(name, lambda: BUILDERS[name](s, rows, device))


# ---- memory ---------------------------------------------------------------------------------------------


def _vm_rss_mb() -> float | None:
    try:
        match = re.search(r"VmRSS:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(match.group(1)) / 1024 if match else None


def memory_only(name: str, s: Setting, device: str) -> dict[str, Any]:
    """One variant in this process: build, warm-up step, then the peak (MB) of ``MEMORY_STEPS`` steps."""
    from hf_dp import cpu_heap

    result: dict[str, Any] = {"variant": name, "rss_after_imports_mb": _vm_rss_mb()}
    variant = build_variant(name, s, make_rows(s), device)
    result["rss_after_build_mb"] = _vm_rss_mb()
    for _ in range(WARMUP_STEPS):
        _timing.time_step(variant, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result["cuda_allocated_before_steps_mb"] = torch.cuda.memory_allocated() / 2**20
    result["rss_before_steps_mb"] = _vm_rss_mb()
    reset = reset_peak_rss()
    for _ in range(MEMORY_STEPS):
        _timing.time_step(variant, device=device)
    hwm = vm_hwm_kb()
    result["steady_peak_rss_mb"] = hwm / 1024 if reset and hwm is not None else None
    result["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["hwm_reset"] = reset
    if device == "cuda":
        result["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        result["cuda_max_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
        result["peak_mb"] = result["cuda_max_allocated_mb"]
        result["peak_source"] = "torch.cuda.max_memory_allocated over the steady steps"
    else:
        result["peak_mb"] = result["steady_peak_rss_mb"]
        result["peak_source"] = "process peak RSS (VmHWM) over the steady steps"
    result["glibc_heap_kept_by_hf_dp"] = cpu_heap.is_kept()
    result["error"] = first_line(variant.error)
    result.update(variant.info)
    if variant.error is not None:
        result["peak_mb"] = None
    return result


def measure_memory(
    name: str, s: Setting, device: str, tight_malloc: bool, timeout: float = 3600
) -> dict[str, Any]:
    """``memory_only`` in a fresh process, started through ``LAUNCHER`` (a child started directly from this
    process would report this process's peak RSS as its own)."""
    child = [
        sys.executable,
        str(Path(__file__).resolve()),
        *("--memory-only", name, "--setting-json", s.to_json(), "--device", device),
    ]
    env = {**os.environ, **(TIGHT_MALLOC_ENV if tight_malloc and device == "cpu" else {})}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", LAUNCHER, *child],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"variant": name, "peak_mb": None, "error": f"memory subprocess timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MEMORY_MARKER):
            return json.loads(line[len(MEMORY_MARKER) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
    return {
        "variant": name,
        "peak_mb": None,
        "error": f"memory subprocess exited {proc.returncode}: {tail[0]}",
    }


# ---- one setting ----------------------------------------------------------------------------------------


def ratio(num: str, den: str, times: dict[str, dict], memory: dict[str, dict]) -> dict[str, Any] | None:
    """Peak ratio and step-time ratios (paired median over rounds, min / min) of ``num`` over ``den``."""
    if num not in times or den not in times:
        return None
    out: dict[str, Any] = {"peak": None, "time_paired_median": None, "time_min": None, "time_per_round": None}
    a, b = memory.get(num, {}).get("peak_mb"), memory.get(den, {}).get("peak_mb")
    if a and b:
        out["peak"] = a / b
    paired = _timing.paired_ratios(times[num]["times_s"], times[den]["times_s"])
    if paired is not None:
        out.update(
            time_paired_median=paired["paired_median"],
            time_min=paired["min_time"],
            time_per_round=paired["per_round"],
        )
    return out


def run_setting(
    s: Setting, variant_names: list[str], rounds: int, device: str, tight_malloc: bool
) -> dict[str, Any]:
    """Peak memory of each variant (subprocesses), then interleaved step times (this process)."""
    print(f"\n== {s.name} (B={s.batch})", flush=True)
    memory = {}
    for name in variant_names:
        memory[name] = measure_memory(name, s, device, tight_malloc)
        m = memory[name]
        print(f"memory {name}: peak {fmt(m.get('peak_mb'), '.0f')} MB {m.get('error') or ''}", flush=True)

    rows = make_rows(s)
    variants = {name: build_variant(name, s, rows, device) for name in variant_names}
    orders = _timing.interleaved(variants, rounds=rounds, warmup=WARMUP_STEPS, device=device)
    times = {}
    for name, v in variants.items():
        summary = _timing.timing_summary(v)
        summary["error"] = first_line(summary["error"])
        times[name] = summary
    for v in variants.values():  # free this setting's models before the next one
        v.keep.clear()
        v.step = None
    variants.clear()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    ratios = {f"{num}_vs_{den}": ratio(num, den, times, memory) for num, den in RATIO_PAIRS}
    return {
        "name": s.name,
        "setting": asdict(s),
        "round_orders": orders,
        "times": times,
        "memory": memory,
        "ratios": {k: v for k, v in ratios.items() if v is not None},
    }


# ---- across settings: checkpointing's effect, the issue's bars ------------------------------------------


def _min_s(result: dict, name: str) -> float | None:
    return result["times"].get(name, {}).get("min_s")


def checkpointing_effect(results: list[dict]) -> list[dict[str, Any]]:
    """Checkpointing on vs off for the same (tuning, precision, T): peak ratios (separate processes either
    way) and min-time ratios (NOT paired: the two settings ran at different times)."""
    by_key = {
        (
            r["setting"]["tuning"],
            r["setting"]["precision"],
            r["setting"]["seq"],
            r["setting"]["checkpointing"],
        ): r
        for r in results
    }
    out = []
    for (tuning, precision, seq, ckpt), on in by_key.items():
        off = by_key.get((tuning, precision, seq, False))
        if not ckpt or off is None:
            continue
        entry: dict[str, Any] = {"ckpt": on["name"], "nockpt": off["name"]}
        for num, den in (("dp", "stock"), ("stock", "stock"), ("dp", "dp")):
            a, b = on["memory"].get(num, {}).get("peak_mb"), off["memory"].get(den, {}).get("peak_mb")
            ta, tb = _min_s(on, num), _min_s(off, den)
            entry[f"{num}_ckpt_vs_{den}_nockpt"] = {
                "peak": a / b if a and b else None,
                "time_min_unpaired": ta / tb if ta and tb else None,
            }
        out.append(entry)
    return out


def _verdict(value: float | None, limit: float) -> str:
    return "not measured" if value is None else ("met" if value <= limit else "not met")


def bars(results: list[dict]) -> list[dict[str, Any]]:
    """The issue's bars against DP / stock Trainer of the same setting (time: the paired median)."""
    out = []
    for r in results:
        s, dp = r["setting"], r["ratios"].get("dp_vs_stock") or {}
        checks = []
        if s["checkpointing"]:
            checks.append(("DP peak / non-private peak, checkpointing on", "peak", CKPT_PEAK_BAR))
            checks.append(
                (
                    "DP time / non-private time, checkpointing on",
                    "time_paired_median",
                    CKPT_TIME_BARS[s["tuning"]],
                )
            )
        elif s["tuning"] == NO_CKPT_PEAK_BAR["tuning"] and s["seq"] == NO_CKPT_PEAK_BAR["seq"]:
            checks.append(
                ("DP peak / non-private peak, checkpointing off", "peak", NO_CKPT_PEAK_BAR["limit"])
            )
        for bar, key, limit in checks:
            value = dp.get(key)
            entry = {
                "setting": r["name"],
                "bar": bar,
                "limit": limit,
                "measured": value,
                "status": _verdict(value, limit),
            }
            if key == "time_paired_median":
                entry["measured_min_time"] = dp.get("time_min")
            out.append(entry)
    return out


# ---- report ---------------------------------------------------------------------------------------------


def _x(value: float | None) -> str:
    return fmt(value, ".2f")


def markdown(result: dict[str, Any]) -> str:
    env, cfg = result["environment"], result["config"]
    micro = f" x {cfg['micro_batches']} micro-batches a step" if cfg.get("micro_batches", 1) > 1 else ""
    shape = cfg["shape"]
    lines = [
        "# LLM memory path: DP vs non-private peak memory and step time (`benchmarks/llm_memory.py`)",
        "",
        f"Device: {env['device']} ({env['cpu_count']} cores, {env['threads']} torch threads); torch {env['torch']}, "
        f"transformers {env['transformers']}, peft {env['peft']}, opacus {env['opacus']}; hf_dp at {env['git_commit']}"
        f"{' (uncommitted changes)' if env['git_dirty'] else ''}; {env['date']}.",
        "",
        f"Model: Llama, {shape['layers']} layers, hidden {shape['hidden']}, intermediate {shape['intermediate']}, "
        f"{shape['heads']} heads, {shape['kv_heads']} KV heads, vocab {shape['vocab']}, untied head, fp32 weights; "
        f"batch {cfg['batch']} sequences of T random tokens{micro}; AdamW; DP: sigma {NOISE_MULTIPLIER}, C {MAX_GRAD_NORM}; "
        f"LoRA r={LORA_R} on all linear layers. {cfg['rounds']} timed round(s) after {WARMUP_STEPS} warm-up step(s).",
        "",
        f"Peak: {cfg['peak_definition']}. Non-private = the stock `transformers.Trainer` of the same setting. "
        "Time ratios: median over rounds of the ratio within a round (paired), and min / min.",
        "",
        "## The issue's bars",
        "",
        "| setting | bar | limit | measured | status |",
        "|---|---|---|---|---|",
    ]
    for b in result["bars"]:
        extra = f" (min/min {_x(b['measured_min_time'])})" if "measured_min_time" in b else ""
        lines.append(
            f"| {b['setting']} | {b['bar']} | ≤ {b['limit']} | {_x(b['measured'])}{extra} | {b['status']} |"
        )
    lines += ["", "## Settings"]
    for r in result["settings"]:
        lines += [
            "",
            f"### {r['name']}",
            "",
            "| variant | peak MB | median s | min s | first loss | error |",
            "|---|---|---|---|---|---|",
        ]
        for name, t in r["times"].items():
            m = r["memory"].get(name, {})
            error = t["error"] or m.get("error") or ""
            lines.append(
                f"| {name} | {fmt(m.get('peak_mb'), '.0f')} | {fmt(t['median_s'])} | {fmt(t['min_s'])} | "
                f"{fmt(t['first_loss'], '.4f')} | {error.replace('|', '/')} |"
            )
        lines += ["", "| ratio | peak | time (paired median) | time (min / min) |", "|---|---|---|---|"]
        for key, rt in r["ratios"].items():
            label = key.replace("_vs_", " / ")
            lines.append(
                f"| {label} | {_x(rt['peak'])} | {_x(rt['time_paired_median'])} | {_x(rt['time_min'])} |"
            )
    if result["checkpointing_effect"]:
        lines += [
            "",
            "## Checkpointing on vs off (same tuning, precision, T)",
            "",
            "Peaks from separate processes; times min / min of runs at different moments (not paired).",
            "",
            "| on / off | DP(on) / stock(off) peak | stock(on) / stock(off) peak | DP(on) / DP(off) peak | "
            "DP(on) / stock(off) time | stock(on) / stock(off) time |",
            "|---|---|---|---|---|---|",
        ]
        for e in result["checkpointing_effect"]:
            a, b, c = e["dp_ckpt_vs_stock_nockpt"], e["stock_ckpt_vs_stock_nockpt"], e["dp_ckpt_vs_dp_nockpt"]
            lines.append(
                f"| {e['ckpt']} / {e['nockpt']} | {_x(a['peak'])} | {_x(b['peak'])} | {_x(c['peak'])} | "
                f"{_x(a['time_min_unpaired'])} | {_x(b['time_min_unpaired'])} |"
            )
    return "\n".join(lines) + "\n"


def environment(device: str) -> dict[str, Any]:
    import accelerate
    import peft

    commit, dirty = _timing.git_state(_REPO_ROOT)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return _timing.environment(
        device=name,
        peft=peft.__version__,
        accelerate=accelerate.__version__,
        git_commit=commit,
        git_dirty=dirty,
    )


# ---- entry point ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches per step (gradient accumulation)"
    )
    p.add_argument(
        "--settings",
        nargs="+",
        default=None,
        help="names or shell patterns, e.g. full-fp32-ckpt-T512 'lora-*'",
    )
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    default = Shape()
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(default, name))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--quick", action="store_true", help="tiny model (2 x 64, vocab 1000), T 64, 1 round: a smoke test"
    )
    p.add_argument(
        "--malloc-default",
        action="store_true",
        help="memory subprocesses keep glibc's default malloc settings",
    )
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="JSON path; the table goes next to it as .md"
    )
    p.add_argument("--memory-only", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--setting-json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def select(args: argparse.Namespace) -> list[Setting]:
    chosen = Shape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab)
    shape, seq_lens = (QUICK_SHAPE, [QUICK_SEQ]) if args.quick else (chosen, args.seq_lens)
    settings = grid(seq_lens, args.batch, shape, args.micro_batches)
    if args.settings:
        settings = [s for s in settings if any(fnmatch.fnmatchcase(s.name, pat) for pat in args.settings)]
        if not settings:
            names = " ".join(s.name for s in grid(seq_lens, args.batch, shape, args.micro_batches))
            raise SystemExit(f"no setting matches {args.settings}; the grid: {names}")
    return settings


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*(use_cache|bos_token_id|gradient_checkpointing).*")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")

    if args.memory_only:
        result = memory_only(args.memory_only, Setting.from_json(args.setting_json), args.device)
        print(MEMORY_MARKER + json.dumps(result), flush=True)
        return None

    settings = select(args)
    rounds = 1 if args.quick else args.rounds
    tight = not args.malloc_default
    load_before = list(os.getloadavg())
    results: list[dict[str, Any]] = []
    for (
        setting
    ) in settings:  # the JSON and the table are rewritten after every setting: a run cut short keeps them
        results.append(run_setting(setting, args.variants, rounds, args.device, tight))
        result = report(args, settings, results, rounds, tight, load_before)
    print("\n" + markdown(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return result


def report(
    args: argparse.Namespace,
    settings: list[Setting],
    results: list[dict[str, Any]],
    rounds: int,
    tight: bool,
    load_before: list[float],
) -> dict[str, Any]:
    """The run's record so far, written to ``--out`` and its ``.md``."""
    peak_definition = (
        "torch.cuda.max_memory_allocated over 2 steps after a warm-up step, one process per variant"
        if args.device == "cuda"
        else "peak RSS of a process per variant over 2 steps after a warm-up step (VmHWM reset), "
        + ("glibc mmapping every block ≥ 64 KiB" if tight else "glibc defaults")
    )
    result = {
        "benchmark": "llm_memory",
        "config": {
            "shape": asdict(settings[0].shape),
            "seq_lens": sorted({s.seq for s in settings}),
            "batch": args.batch,
            "micro_batches": args.micro_batches,
            "rounds": rounds,
            "warmup_steps": WARMUP_STEPS,
            "memory_steps": MEMORY_STEPS,
            "variants": args.variants,
            "noise_multiplier": NOISE_MULTIPLIER,
            "per_sample_max_grad_norm": MAX_GRAD_NORM,
            "lora_r": LORA_R,
            "dataset_examples": f"{DATASET_BATCHES} x batch",
            "device": args.device,
            "quick": args.quick,
            "memory_malloc_env": TIGHT_MALLOC_ENV if tight and args.device == "cpu" else {},
            "peak_definition": peak_definition,
            "checkpointing_argument": CKPT_ARG,
        },
        "environment": environment(args.device) | {"load_average_at_start": load_before},
        "settings": results,
        "checkpointing_effect": checkpointing_effect(results),
        "bars": bars(results),
        "notes": [
            "stock: transformers.Trainer.training_step + AdamW step (optim adamw_torch); dp_off / dp: "
            "DPTrainer.train_one_step([batch]) (dp: noised and accounted release); opacus: make_private(ghost, "
            "poisson_sampling=False) + DPTensorFastGradientClipping on per-example losses (reduction='none').",
            "Trainer variants are prepared as Trainer.train() prepares them: checkpointing enabled on the model from "
            "the arguments, then accelerator.prepare_model (bf16 autocast). mlp_output_dtype records what autocast did.",
            "Bars compare dp with the stock Trainer of the same setting; time bars use the paired median.",
        ],
    }
    result["finished"] = len(results) == len(settings)
    _timing.write_result(args.out, result)
    args.out.with_suffix(".md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    main()
