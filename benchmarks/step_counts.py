"""How many operators a steady-state DP step dispatches and how many times it reads a tensor on the host, against
the stock Trainer's step, in four cells: LoRA and full fine-tuning, with and without activation checkpointing.

Counted on CPU with step_flops.py's dispatch mode (``Traffic``): the non-view operator calls of one step after the
first (each a kernel launch on a device; the matrix products included) and the calls of
``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``: each a device synchronisation), and apart from
them the operators whose output size depends on tensor values (boolean-mask indexing, ``nonzero``), which wait for
a device too. On CPU every such read counts, also of a tensor that would stay on the host beside a device. The variants
are llm_memory.py's ``stock`` (``Trainer.training_step`` + ``optimizer.step()``) and ``dp`` (``DPTrainer``'s
``train_one_step``: clipping, noise, accounting) on a tiny Llama, fp32, AdamW. With ``--stacks`` every DP host read
is attributed to the innermost frame of hf_dp (or of the benchmark) that asked for it; with ``--ops`` every
operator call is counted by operator name, stock and DP, and the DP's by the innermost hf_dp line that issued it
(where the extra calls sit). Each cell also counts ``dp_groupwise`` (``clipping_groups="layer"``).

The issue's bar: DP / stock operator calls at most ``CALLS_BAR`` and at most ``SYNCS_BAR`` more host syncs, in all
four cells.

    .venv/bin/python benchmarks/step_counts.py --stacks --out benchmarks/results/step_counts.json
    .venv/bin/python benchmarks/step_counts.py --ops --cells full-nockpt --out /tmp/step_counts.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
sys.path[:] = [_REPO_ROOT] + [p for p in sys.path if p != _REPO_ROOT]  # before Opacus' own ``benchmarks``

from benchmarks import llm_memory  # noqa: E402
from benchmarks.step_flops import Traffic  # noqa: E402

CELLS = (("lora", False), ("lora", True), ("full", False), ("full", True))
TINY = llm_memory.Shape(layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, vocab=1000)
TINY_SEQ, TINY_BATCH = 64, 4
CALLS_BAR = 1.30  # DP / stock non-view operator calls
SYNCS_BAR = 3  # DP host syncs - stock host syncs
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "step_counts.json"
TOP_OPS = 25  # the operators and source lines ``--ops`` lists per cell
# In the Markdown file, this line and what follows it are notes written by hand, kept when the file is rewritten.
NOTES = "<!-- notes: kept when step_counts.py rewrites this file -->"


def cell_name(tuning: str, checkpointing: bool) -> str:
    return f"{tuning}-{'ckpt' if checkpointing else 'nockpt'}"


def _source(stack: list[str]) -> str:
    """Where a host read comes from: the innermost hf_dp frame, else the innermost frame of the step's caller."""
    ours = [frame for frame in stack if "hf_dp" in frame or frame.split(":")[0] in _HF_DP_FILES]
    return (ours or stack or ["?"])[-1]


_HF_DP_FILES = {path.name for path in (Path(_REPO_ROOT) / "hf_dp").rglob("*.py")}


def count_variant(
    name: str, setting: llm_memory.Setting, rows: list[dict], stacks: bool, ops: bool = False
) -> dict[str, Any]:
    """One variant: built, its first step taken (DP's checks), then one step counted; ``ops``: its calls by
    operator name and by source line."""
    variant = llm_memory.build_variant(name, setting, rows, "cpu")
    if variant.error:
        raise RuntimeError(f"{name} on {setting.name}: {variant.error}")
    variant.step()
    traffic = Traffic(set(), stacks=stacks, ops=ops)
    with traffic:
        variant.step()
    result: dict[str, Any] = {
        "calls": traffic.calls,
        "host_syncs": traffic.host_reads,
        "value_sized_ops": traffic.value_sized,
    }
    if stacks:
        result["sync_sources"] = dict(Counter(_source(s) for s in traffic.host_read_stacks).most_common())
        result["value_sized_sources"] = dict(
            Counter(_source(s) for s in traffic.value_sized_stacks).most_common()
        )
    if ops:
        result["ops"] = dict(Counter(op for op, _ in traffic.call_stacks).most_common())
        result["op_sources"] = dict(Counter(_source(s) for _, s in traffic.call_stacks).most_common())
    return result


def count_cell(
    tuning: str,
    checkpointing: bool,
    shape: llm_memory.Shape = TINY,
    seq: int = TINY_SEQ,
    batch: int = TINY_BATCH,
    stacks: bool = False,
    ops: bool = False,
) -> dict[str, Any]:
    """Stock and DP counts of one cell, their ratio of calls and the host syncs DP adds."""
    setting = llm_memory.Setting(tuning, "fp32", checkpointing, seq, batch, shape)
    rows = llm_memory.make_rows(setting)
    stock = count_variant("stock", setting, rows, stacks, ops)
    dp = count_variant("dp", setting, rows, stacks, ops)
    groupwise = count_variant("dp_groupwise", setting, rows, stacks=False)
    return {
        "stock": stock,
        "dp": dp,
        "calls_ratio": dp["calls"] / stock["calls"],
        "extra_syncs": dp["host_syncs"] - stock["host_syncs"],
        "dp_groupwise": groupwise,
        "groupwise_calls_ratio": groupwise["calls"] / stock["calls"],
        "groupwise_extra_syncs": groupwise["host_syncs"] - stock["host_syncs"],
    }


def markdown(result: dict[str, Any]) -> str:
    s = result["setting"]
    shape = s["shape"]
    lines = [
        "# Operator calls and host syncs of one steady-state step (`benchmarks/step_counts.py`)",
        "",
        f"Llama {shape['layers']} × {shape['hidden']} (intermediate {shape['intermediate']}, {shape['heads']} heads, "
        f"{shape['kv_heads']} KV heads, vocabulary {shape['vocab']}), B {s['batch']}, T {s['seq']}, fp32, AdamW; "
        f"one step after the first. The bar: DP / stock calls ≤ {CALLS_BAR}, at most {SYNCS_BAR} more host syncs.",
        "",
        "| cell | operator calls stock | DP | DP / stock | host syncs stock → DP | value-sized ops stock → DP | "
        "bar met |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in result["cells"].items():
        met = c["calls_ratio"] <= CALLS_BAR and c["extra_syncs"] <= SYNCS_BAR
        lines.append(
            f"| {name} | {c['stock']['calls']} | {c['dp']['calls']} | {c['calls_ratio']:.2f}x | "
            f"{c['stock']['host_syncs']} → {c['dp']['host_syncs']} | "
            f"{c['stock']['value_sized_ops']} → {c['dp']['value_sized_ops']} | {'yes' if met else 'no'} |"
        )
    lines += [
        "",
        'Group-wise clipping (`clipping_groups="layer"`: each group clipped and summed in the one backward), same cells:',
        "",
        "| cell | operator calls stock | DP group-wise | ratio | host syncs stock → DP group-wise |",
        "|---|---|---|---|---|",
    ]
    for name, c in result["cells"].items():
        g = c["dp_groupwise"]
        lines.append(
            f"| {name} | {c['stock']['calls']} | {g['calls']} | {c['groupwise_calls_ratio']:.2f}x | "
            f"{c['stock']['host_syncs']} → {g['host_syncs']} |"
        )
    for name, c in result["cells"].items():
        if "sync_sources" in c["dp"]:
            lines += ["", f"DP host syncs of {name}, by source:", ""]
            lines += [f"- {n} × {where}" for where, n in c["dp"]["sync_sources"].items()]
            lines += [f"- {n} × {where} (value-sized)" for where, n in c["dp"]["value_sized_sources"].items()]
    for name, c in result["cells"].items():
        if "ops" in c["dp"]:
            lines += _op_lines(name, c)
    return "\n".join(lines) + "\n"


def _op_lines(name: str, c: dict[str, Any]) -> list[str]:
    """A cell's operator calls by name, DP − stock (the largest differences), and DP's by source line."""
    stock, dp = c["stock"]["ops"], c["dp"]["ops"]
    extra = sorted(set(stock) | set(dp), key=lambda op: -abs(dp.get(op, 0) - stock.get(op, 0)))[:TOP_OPS]
    lines = [
        "",
        f"Operator calls of {name} by operator (DP − stock = {c['dp']['calls'] - c['stock']['calls']}):",
        "",
    ]
    lines += ["| operator | stock | DP | DP − stock |", "|---|---|---|---|"]
    lines += [
        f"| {op} | {stock.get(op, 0)} | {dp.get(op, 0)} | {dp.get(op, 0) - stock.get(op, 0):+d} |"
        for op in extra
    ]
    lines += [
        "",
        f"DP operator calls of {name} by the innermost hf_dp line that issued them (top {TOP_OPS}):",
        "",
    ]
    lines += [f"- {n} × {where}" for where, n in list(c["dp"]["op_sources"].items())[:TOP_OPS]]
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(TINY, name))
    p.add_argument("--seq", type=int, default=TINY_SEQ)
    p.add_argument("--batch", type=int, default=TINY_BATCH)
    p.add_argument("--cells", nargs="*", default=[cell_name(*c) for c in CELLS])
    p.add_argument("--stacks", action="store_true", help="attribute every DP host sync to its source")
    p.add_argument("--ops", action="store_true", help="count every operator call by name and by source line")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(use_cache|bos_token_id|gradient_checkpointing).*")
    shape = llm_memory.Shape(
        **{k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")}
    )
    cells = {
        cell_name(*c): count_cell(*c, shape, args.seq, args.batch, args.stacks, args.ops)
        for c in CELLS
        if cell_name(*c) in args.cells
    }
    result: dict[str, Any] = {
        "benchmark": "step_counts",
        "setting": {"shape": asdict(shape), "seq": args.seq, "batch": args.batch},
        "bar": {"calls_ratio": CALLS_BAR, "extra_syncs": SYNCS_BAR},
        "cells": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    md = args.out.with_suffix(".md")
    notes = md.read_text().partition(NOTES) if md.exists() else ("", "", "")
    md.write_text(markdown(result) + (f"\n{NOTES}{notes[2]}" if notes[1] else ""))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
