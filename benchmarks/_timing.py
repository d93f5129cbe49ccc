"""The one timing harness of the benchmarks: variants timed in interleaved rounds, paired and min-time ratios.

The machines switch between speed regimes, so every script builds its variants, warms each up, then times
one step of every variant per round with the order rotated (each variant runs first, second, … equally
often), and reports the median of per-round ratios (robust to a change of speed between rounds) and the ratio
of minimum times. Import it before torch / transformers: it sets the offline environment they read.

On a GPU (``device="cuda"``) the clock stops when the step's kernels have run, and with ``step_peak`` each step
also records the most it allocated above what was allocated at its start (gpu_check.py's peak = what a variant
holds at rest + that).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recipes.common import set_offline_defaults

set_offline_defaults()
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


@dataclass
class Variant:
    """One thing to time: ``step()`` runs one step and returns its loss; ``info`` is reported as is."""

    name: str
    step: Callable[[], float] | None = None
    error: str | None = None
    times: list[float | None] = field(default_factory=list)
    first_loss: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # objects (trainers, temporary folders) that must outlive it
    keep: list[Any] = field(default_factory=list)
    # CUDA, ``step_peak``: bytes each step allocated above its start; bytes the variant holds at rest (its user's)
    transient: list[float] = field(default_factory=list)
    resident: float | None = None


def build(name: str, builder: Callable[[], Variant], failed: type[Variant] = Variant) -> Variant:
    """``builder()``, or a variant (of class ``failed``) that records why it could not be built (the others
    still run)."""
    try:
        return builder()
    except Exception as exc:
        traceback.print_exc()
        return failed(name, error=f"build failed: {type(exc).__name__}: {exc}")


def synchronize(device: str) -> None:
    """On CUDA, wait for the queued kernels."""
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """On CUDA, collect garbage and return cached blocks (before a measurement, after a failed step). Not on the
    CPU, where nothing is measured this way and one ``gc.collect()`` of a large process took a second on a loaded
    2-core machine."""
    if device == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def time_step(
    variant: Variant,
    before: Callable[[Variant], None] | None = None,
    *,
    device: str = "cpu",
    step_peak: bool = False,
) -> float | None:
    """Seconds of one ``variant.step()`` (on CUDA: until its kernels have run; with ``step_peak`` the bytes it
    allocated above its start are appended to ``variant.transient``); a failure or a non-finite loss records
    the error and retires it (on CUDA, often out of memory, its objects are let go and the cache emptied)."""
    if variant.error is not None or variant.step is None:
        return None
    peak = step_peak and device == "cuda"
    try:
        if before is not None:
            before(variant)
        synchronize(device)
        if peak:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = variant.step()
        synchronize(device)
        elapsed = time.perf_counter() - start
        if peak:
            variant.transient.append(torch.cuda.max_memory_allocated() - base)
        if not math.isfinite(loss):
            raise ValueError(f"non-finite loss {loss}")
    except Exception as exc:
        traceback.print_exc()
        variant.error, variant.step = f"step failed: {type(exc).__name__}: {exc}", None
        if device == "cuda":
            variant.keep.clear()
            release(device)
        return None
    if variant.first_loss is None:
        variant.first_loss = loss
    return elapsed


def rotations(names: Sequence[str], rounds: int) -> list[list[str]]:
    """Round r starts at variant r (mod n)."""
    names = list(names)
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(rounds)]


def interleaved(
    variants: dict[str, Variant],
    rounds: int,
    warmup: int,
    before: Callable[[Variant], None] | None = None,
    *,
    device: str = "cpu",
    step_peak: bool = False,
) -> list[list[str]]:
    """Warm every variant up, then time one step of each per round in rotated order; returns the orders."""
    for variant in variants.values():
        for _ in range(warmup):
            time_step(variant, before, device=device, step_peak=step_peak)
    return timed_rounds(variants, rounds, before, device=device, step_peak=step_peak)


def timed_rounds(
    variants: dict[str, Variant],
    rounds: int,
    before: Callable[[Variant], None] | None = None,
    *,
    device: str = "cpu",
    step_peak: bool = False,
) -> list[list[str]]:
    """One timed step of each (warmed-up) variant per round, in rotated order; returns the orders."""
    if not variants:
        return []
    orders = rotations(variants, rounds)
    for r, order in enumerate(orders):
        for name in order:
            variants[name].times.append(time_step(variants[name], before, device=device, step_peak=step_peak))
        print_round(r, rounds, order, variants)
    return orders


def print_round(r: int, rounds: int, order: Sequence[str], variants: dict[str, Variant]) -> None:
    line = ", ".join(f"{n} {fmt(variants[n].times[-1])}" for n in order)
    print(f"round {r + 1}/{rounds}: {line}", flush=True)


def timing_summary(variant: Variant) -> dict[str, Any]:
    ok = [t for t in variant.times if t]
    return {
        "median_s": statistics.median(ok) if ok else None,
        "min_s": min(ok) if ok else None,
        "times_s": variant.times,
        "first_loss": variant.first_loss,
        "error": variant.error,
        **variant.info,
    }


def paired_ratios(times: Sequence[float | None], base: Sequence[float | None]) -> dict[str, Any] | None:
    """The median of per-round ratios to the base, and min / min (``None`` entries: failed rounds)."""
    pairs = [t / b for t, b in zip(times, base, strict=False) if t and b]
    if not pairs:
        return None
    return {
        "paired_median": statistics.median(pairs),
        "min_time": min(t for t in times if t) / min(b for b in base if b),
        "per_round": pairs,
    }


def first_line(text: str | None) -> str | None:
    """The first non-empty line of an error (what the tables show), at most 500 characters."""
    if not text:
        return None
    return next((line.strip() for line in text.splitlines() if line.strip()), text)[:500]


def git_state(root: str | Path) -> tuple[str | None, bool | None]:
    """The checkout's short commit, and whether hf_dp/ has uncommitted changes (None, None outside git)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "hf_dp"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return commit, bool(dirty)


def environment(**extra: Any) -> dict[str, Any]:
    """Versions, threads, load and the allocator settings that change the cost of every large tensor."""
    import opacus

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "opacus": opacus.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "load_average_1_5_15min": list(os.getloadavg()),
        "allocator_env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith("MALLOC_") or k in ("LD_PRELOAD", "HF_DP_KEEP_CPU_HEAP")
        },
        **extra,
    }


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


# ---- the model every timing script uses -------------------------------------------------------------------


def gpt2_config(layers: int, width: int, heads: int, vocab: int, seq: int, tied: bool = True) -> GPT2Config:
    """A GPT-2 shape without dropout (timed steps must not depend on the dropout draw), token 0 for all
    special tokens."""
    return GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocab,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )


def tied_gpt2(layers: int, width: int, heads: int, vocab: int, seq: int, seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(gpt2_config(layers, width, heads, vocab, seq)).float()
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise RuntimeError("expected a tied GPT-2 (lm_head.weight is wte.weight)")
    return model.train()


def token_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """A fixed random token batch with labels = inputs (every example real)."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
