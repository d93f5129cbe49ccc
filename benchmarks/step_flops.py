"""Multiply-adds of one training step with activation checkpointing, counted by torch's ``FlopCounterMode``.

What the GEMMs of a step cost, without a GPU and without timing noise: the stock ``transformers.Trainer`` step,
``DPTrainer``'s (``dp``: the weighted pass runs the checkpointed layers one by one, hf_dp/clipping/layerwise.py)
and the same with the layers back-propagated as one chain (``dp_chained``, replay.py). A Llama of
benchmarks/llm_memory.py's kind (GQA, untied head, random weights) on B random sequences of T tokens, fp32, full
fine-tuning, AdamW; each variant takes its first step (DP's checks), then one counted step. The counter sees
matrix products (mm, addmm, bmm, attention) forward and backward, recomputation included, not elementwise ops.
Per token, as multiply-adds (FLOPs / 2), with the ratios to the stock step: the floor the time bar meets on a
device where GEMMs dominate.

    .venv/bin/python benchmarks/step_flops.py --out benchmarks/results/step_flops.json
    .venv/bin/python benchmarks/step_flops.py --hidden 2048 --intermediate 5632 --heads 16 --kv-heads 4 \
        --seq 256 --batch 1 --out /tmp/step_flops_2048.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
sys.path[:] = [_REPO_ROOT] + [p for p in sys.path if p != _REPO_ROOT]  # before Opacus' own ``benchmarks``

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from benchmarks import llm_memory  # noqa: E402

VARIANTS = ("stock", "dp", "dp_chained")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "step_flops.json"


def count(name: str, setting: llm_memory.Setting, rows: list[dict]) -> dict[str, Any]:
    """One variant: built, its first step taken, then one step counted; multiply-adds per token, by operator."""
    variant = llm_memory.build_variant(name, setting, rows, "cpu")
    if variant.error:
        return {"error": variant.error}
    variant.step()
    counter = FlopCounterMode(display=False)
    with counter:
        variant.step()
    tokens = setting.batch * setting.seq
    by_op = {str(op): flops / 2 / tokens for op, flops in counter.get_flop_counts()["Global"].items()}
    result: dict[str, Any] = {"macs_per_token": counter.get_total_flops() / 2 / tokens, "by_op": by_op}
    result |= {key: variant.info.get(key) for key in ("tail_layers", "layerwise") if key in variant.info}
    return result


def markdown(result: dict[str, Any]) -> str:
    s = result["setting"]
    shape = s["shape"]
    lines = [
        "# Multiply-adds of one checkpointed step (`benchmarks/step_flops.py`)",
        "",
        f"Llama {shape['layers']} × {shape['hidden']} (intermediate {shape['intermediate']}, {shape['heads']} heads, "
        f"{shape['kv_heads']} KV heads, vocabulary {shape['vocab']}), B {s['batch']}, T {s['seq']}, fp32, full "
        "fine-tuning with activation checkpointing; torch's FlopCounterMode over one step after the first.",
        "",
        "| variant | multiply-adds per token | / stock | tail over layers | layer by layer |",
        "|---|---|---|---|---|",
    ]
    stock = result["variants"]["stock"].get("macs_per_token")
    for name, v in result["variants"].items():
        if "error" in v:
            lines.append(f"| {name} | error: {v['error'].splitlines()[0]} | | | |")
            continue
        macs = v["macs_per_token"]
        lines.append(
            f"| {name} | {macs / 1e6:.1f}M | {macs / stock:.3f} | {v.get('tail_layers', '-')} | "
            f"{v.get('layerwise', '-')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = llm_memory.Shape()
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(default, name))
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    shape = llm_memory.Shape(
        **{k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")}
    )
    setting = llm_memory.Setting("full", "fp32", True, args.seq, args.batch, shape)
    rows = llm_memory.make_rows(setting)
    result: dict[str, Any] = {
        "benchmark": "step_flops",
        "setting": {"shape": asdict(shape), "seq": args.seq, "batch": args.batch},
        "variants": {name: count(name, setting, rows) for name in VARIANTS},
        "environment": llm_memory.environment("cpu"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
