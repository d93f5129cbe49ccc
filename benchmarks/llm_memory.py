"""Peak memory and step time of private LLM fine-tuning, with and without activation checkpointing.

A Llama-shaped model (default 8 layers × 512, intermediate 1408, 8 heads, 2 KV heads, vocab 32000, untied
head, random weights) trains one step on B random sequences of T tokens, per setting (T, full fine-tuning or
LoRA r = 8 on every linear layer, fp32 or bf16 autocast, checkpointing off or on). Variants, side by side:

- ``stock``: ``transformers.Trainer.training_step`` (the model's own loss) + AdamW step;
- ``dp_off``: ``DPTrainer(disable_dp=True)``, the same DP code path without clipping or noise;
- ``dp``: ``DPTrainer`` (σ = 1, C = 1, AdamW): per-example clipping, noise, accounting;
- ``opacus``: Opacus ghost clipping (``grad_sample_mode="ghost"``), per-example mean loss, same AdamW.

Step times: every variant of a setting in one process, interleaved rounds, paired and min-time ratios
(benchmarks/_timing.py). Peak memory: each variant in its own subprocess, the process's peak RSS over two
steady-state steps after a warm-up step (VmHWM reset; on CUDA, ``max_memory_allocated``).

    python benchmarks/llm_memory.py [--settings full-fp32-ckpt-T512 ...] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import _timing  # noqa: E402  (sets the offline environment first)
from benchmarks._timing import Variant, fmt  # noqa: E402
from benchmarks.step_speed import _LAUNCHER, _reset_peak_rss, _vm_hwm_kb  # noqa: E402

# isort: split

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402

VARIANTS = ("stock", "dp_off", "dp", "opacus")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "llm_memory.json"
MEMORY_MARKER = "LLM_MEMORY_JSON "
# the issue's bars: (DP peak / non-private peak, DP time / non-private time), checkpointing on
BARS = {"full": (1.1, 2.1), "lora": (1.1, 1.3)}
NO_CHECKPOINT_PEAK_BAR = (2048, 1.0)  # without checkpointing, full FT at this T: DP peak ≤ 1.0 × non-private


@dataclass(frozen=True)
class Setting:
    tuning: str  # "full" or "lora"
    precision: str  # "fp32" or "bf16" (autocast, fp32 weights)
    checkpointing: bool
    seq: int
    batch: int = 2
    layers: int = 8
    width: int = 512
    intermediate: int = 1408
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 32000

    @property
    def name(self) -> str:
        return f"{self.tuning}-{self.precision}-{'ckpt' if self.checkpointing else 'nockpt'}-T{self.seq}"


def default_settings() -> list[Setting]:
    """What 2 CPU cores can run in about an hour; pass --settings for others."""
    settings = [Setting("full", "fp32", ckpt, seq) for seq in (512, 1024) for ckpt in (False, True)]
    settings += [Setting("full", "fp32", ckpt, 2048) for ckpt in (False, True)]
    settings += [Setting("lora", "fp32", ckpt, 1024) for ckpt in (False, True)]
    settings += [Setting("full", "bf16", True, 512), Setting("lora", "bf16", True, 512)]
    return settings


def quick_settings() -> list[Setting]:
    tiny = dict(layers=2, width=64, intermediate=128, heads=4, kv_heads=2, vocab=1000, seq=64)
    return [
        Setting(t, p, c, **tiny) for t in ("full", "lora") for p in ("fp32", "bf16") for c in (False, True)
    ]


def parse_setting(name: str) -> Setting:
    """``full-fp32-ckpt-T512`` back into a Setting (batch 2)."""
    tuning, precision, checkpointing, seq = name.split("-")
    return Setting(tuning, precision, checkpointing == "ckpt", int(seq[1:]))


# ---- model, batch, variants ----------------------------------------------------------------------------


def build_model(s: Setting) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=s.layers,
        hidden_size=s.width,
        intermediate_size=s.intermediate,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        vocab_size=s.vocab,
        max_position_embeddings=max(s.seq, 64),
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    model = LlamaForCausalLM(config).train()
    if s.checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if s.tuning == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
        )
    return model


def _args(s: Setting, folder: str, **extra) -> DPTrainingArguments:
    return DPTrainingArguments(
        output_dir=folder,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=s.batch,
        bf16=s.precision == "bf16",
        activation_checkpointing=s.checkpointing,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        **extra,
    )


def _rows(s: Setting) -> list[dict[str, torch.Tensor]]:
    row = {"input_ids": torch.zeros(s.seq, dtype=torch.long), "labels": torch.zeros(s.seq, dtype=torch.long)}
    return [row] * (100 * s.batch)


def build_stock(s: Setting, batch: dict) -> Variant:
    folder = tempfile.TemporaryDirectory(prefix="llm_memory_")
    model = build_model(s)
    trainer = Trainer(model=model, args=_args(s, folder.name, disable_dp=True, optim="adamw_torch"))
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train() sets for each window

    def step() -> float:
        loss = trainer.training_step(model, batch)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return Variant("stock", step=step, keep=[folder, trainer])


def build_dp(s: Setting, batch: dict, private: bool) -> Variant:
    folder = tempfile.TemporaryDirectory(prefix="llm_memory_")
    privacy = (
        {"noise_multiplier": 1.0, "per_sample_max_grad_norm": 1.0, "dp_optimizer": "adamw"}
        if private
        else {"disable_dp": True, "dp_optimizer": "adamw"}
    )
    trainer = DPTrainer(model=build_model(s), args=_args(s, folder.name, **privacy), train_dataset=_rows(s))
    trainer.create_optimizer()
    variant = Variant(
        "dp" if private else "dp_off", step=lambda: trainer.train_one_step([batch]), keep=[folder]
    )
    variant.keep.append(trainer)
    if private:
        variant.info["norms_in_backward"] = trainer._clipping.norms_in_backward
    return variant


def build_opacus(s: Setting, batch: dict) -> Variant:
    from opacus import PrivacyEngine

    model = build_model(s)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-5)
    loader = DataLoader(TensorDataset(torch.zeros(100 * s.batch, 1)), batch_size=s.batch)
    dp_model, dp_optimizer, criterion, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
        criterion=torch.nn.CrossEntropyLoss(reduction="mean", ignore_index=-100),
        loss_reduction="mean",
    )
    targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def step() -> float:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=s.precision == "bf16"):
            logits = dp_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = criterion(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), shape=logits.shape
        )
        loss.backward()
        dp_optimizer.step()
        dp_optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return Variant("opacus", step=step, keep=[dp_model, dp_optimizer, criterion])


BUILDERS: dict[str, Callable[[Setting, dict], Variant]] = {
    "stock": build_stock,
    "dp_off": lambda s, b: build_dp(s, b, private=False),
    "dp": lambda s, b: build_dp(s, b, private=True),
    "opacus": build_opacus,
}


def make_batch(s: Setting) -> dict[str, torch.Tensor]:
    batch = _timing.token_batch(s.batch, s.seq, s.vocab, seed=0)
    return {k: v.cuda() for k, v in batch.items()} if torch.cuda.is_available() else batch


# ---- memory ---------------------------------------------------------------------------------------------


def memory_only(variant_name: str, s: Setting) -> dict:
    """One variant in this process: warm-up step, then the peak of two steps (MB)."""
    variant = _timing.build(variant_name, lambda: BUILDERS[variant_name](s, make_batch(s)))
    _timing.time_step(variant)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    reset = _reset_peak_rss()
    for _ in range(2):
        _timing.time_step(variant)
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        hwm = _vm_hwm_kb()
        peak = hwm / 1024 if reset and hwm is not None else None
    return {"variant": variant_name, "peak_mb": peak, "error": variant.error, **variant.info}


def measure_memory(variant_name: str, s: Setting, timeout: float = 3600) -> dict:
    """``memory_only`` in a fresh process (through a launcher, so that it does not inherit this one's peak)."""
    child = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--memory-only",
        variant_name,
        "--settings",
        s.name,
    ]
    if s in quick_settings():
        child.append("--quick")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, *child], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"variant": variant_name, "error": f"timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MEMORY_MARKER):
            return json.loads(line[len(MEMORY_MARKER) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"variant": variant_name, "error": f"exited {proc.returncode}: " + " | ".join(tail)}


# ---- one setting, all settings --------------------------------------------------------------------------


def run_setting(s: Setting, rounds: int, variant_names: list[str]) -> dict:
    print(f"\n== {s.name}", flush=True)
    memory = {name: measure_memory(name, s) for name in variant_names}
    batch = make_batch(s)
    variants = {
        name: _timing.build(name, lambda name=name: BUILDERS[name](s, batch)) for name in variant_names
    }
    _timing.interleaved(variants, rounds=rounds, warmup=1)
    times = {name: _timing.timing_summary(v) for name, v in variants.items()}
    peak = {name: m.get("peak_mb") for name, m in memory.items()}
    ratios: dict[str, dict | None] = {}
    for num in ("dp", "opacus", "dp_off"):
        for den in ("stock", "opacus"):
            if num == den or num not in variants or den not in variants:
                continue
            entry = {}
            paired = _timing.paired_ratios(variants[num].times, variants[den].times)
            if paired is not None:
                entry.update(paired_median=paired["paired_median"], min_time=paired["min_time"])
            if peak.get(num) and peak.get(den):
                entry["peak"] = peak[num] / peak[den]
            ratios[f"{num}_vs_{den}"] = entry or None
    return {"setting": asdict(s), "name": s.name, "times": times, "memory": memory, "ratios": ratios}


def bar_lines(results: list[dict]) -> list[str]:
    """Each bar of the issue against the measured ratio (paired median for time), met or not."""
    lines = []
    for r in results:
        s, dp = r["setting"], r["ratios"].get("dp_vs_stock") or {}
        if s["checkpointing"] and s["precision"] == "fp32":
            peak_bar, time_bar = BARS[s["tuning"]]
            for what, key, bar in (("peak", "peak", peak_bar), ("time", "paired_median", time_bar)):
                value = dp.get(key)
                met = "not measured" if value is None else ("met" if value <= bar else "NOT met")
                lines.append(
                    f"| {r['name']} | DP {what} / non-private ≤ {bar} | {fmt(value, '.2f')} | {met} |"
                )
        if not s["checkpointing"] and s["tuning"] == "full" and s["seq"] == NO_CHECKPOINT_PEAK_BAR[0]:
            value, bar = dp.get("peak"), NO_CHECKPOINT_PEAK_BAR[1]
            met = "not measured" if value is None else ("met" if value <= bar else "NOT met")
            lines.append(f"| {r['name']} | DP peak / non-private ≤ {bar} | {fmt(value, '.2f')} | {met} |")
        opacus = r["ratios"].get("dp_vs_opacus") or {}
        for what, key in (("peak", "peak"), ("time", "paired_median")):
            value = opacus.get(key)
            met = "Opacus failed" if value is None else ("met" if value < 1 else "NOT met")
            lines.append(f"| {r['name']} | DP {what} / Opacus < 1 | {fmt(value, '.2f')} | {met} |")
    return lines


def markdown(result: dict) -> str:
    out = [
        "# LLM memory benchmark (`benchmarks/llm_memory.py`)",
        "",
        f"Device: {result['environment']['device']}; torch {result['environment']['torch']}, "
        f"transformers {result['environment']['transformers']}, opacus {result['environment']['opacus']}, "
        f"{result['environment']['threads']} threads. Peak: process peak RSS over two steady steps (CPU).",
        "",
        "| setting | variant | peak MB | median s | min s | peak / stock | time / stock (paired) | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["settings"]:
        stock_peak = r["memory"].get("stock", {}).get("peak_mb")
        for name, t in r["times"].items():
            peak = r["memory"].get(name, {}).get("peak_mb")
            ratio = r["ratios"].get(f"{name}_vs_stock") or {}
            error = (t["error"] or r["memory"].get(name, {}).get("error") or "").split("\n")[0][:120]
            out.append(
                f"| {r['name']} | {name} | {fmt(peak, '.0f')} | {fmt(t['median_s'], '.2f')} | "
                f"{fmt(t['min_s'], '.2f')} | {fmt(peak / stock_peak if peak and stock_peak else None, '.2f')} | "
                f"{fmt(ratio.get('paired_median'), '.2f')} | {error} |"
            )
    out += ["", "## The issue's bars", "", "| setting | bar | measured | |", "|---|---|---|---|"]
    out += bar_lines(result["settings"])
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="*", default=None, help="names like full-fp32-ckpt-T512")
    p.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a tiny model, every setting, 1 round: a smoke test")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--memory-only", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    cli = p.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 16))
    pool = quick_settings() if cli.quick else default_settings()
    if cli.settings:
        known = {setting.name: setting for setting in pool}
        settings = [known.get(name) or parse_setting(name) for name in cli.settings]
    else:
        settings = pool
    if cli.memory_only:
        print(MEMORY_MARKER + json.dumps(memory_only(cli.memory_only, settings[0])), flush=True)
        return
    results = [run_setting(s, 1 if cli.quick else cli.rounds, cli.variants) for s in settings]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"environment": _timing.environment(device=device), "settings": results}
    _timing.write_result(cli.out, result)
    cli.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
