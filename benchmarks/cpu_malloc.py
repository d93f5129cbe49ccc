"""Peak RSS on CPU under glibc's default malloc versus mmapping every block of 64 KiB or more, stock vs DP.

What it measures. One ``llm_memory.py`` setting (by default issue 30's: Llama 8 x 256, intermediate 704, vocab
16k, T 1024, B 4, full fine-tuning, fp32, activation checkpointing), the stock Trainer and DPTrainer, each in a
fresh process (started through ``_memory.LAUNCHER``) under two allocators:

- ``default``: glibc's defaults. Blocks above the mmap threshold are mmapped and unmapped on free, and each
  freed mmapped block raises the threshold (up to 32 MB); blocks below it come from the heap, whose freed
  memory the process keeps.
- ``tight``: ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536``, so the RSS follows the live tensors
  (what ``llm_memory.py`` measures by default).

Per process: one warm-up step, then three timed steps; their peak RSS (VmHWM reset after the warm-up) and the
most free heap glibc held meanwhile (``mallinfo2().fordblks``, sampled at every module's forward). Rounds
are interleaved; ratios are DP over stock under the same allocator, paired by round and min-time.

    .venv/bin/python benchmarks/cpu_malloc.py --rounds 3 --out benchmarks/results/cpu_malloc_8x256.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _timing  # noqa: E402  (sets the offline environment first)
from benchmarks._memory import LAUNCHER  # noqa: E402

TIGHT = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
MARKER = "CPU_MALLOC "
STEPS = 3


def child(variant: str, setting_json: str) -> None:
    """One variant under this process's allocator: warm-up, then ``STEPS`` timed steps."""
    import ctypes

    import torch

    from benchmarks import llm_memory
    from benchmarks._memory import reset_peak_rss, vm_hwm_kb

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in [
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            ]
        ]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    held = [0]

    def sample(*_) -> None:
        held[0] = max(held[0], libc.mallinfo2().fordblks)

    setting = llm_memory.Setting.from_json(setting_json)
    built = llm_memory.build_variant(variant, setting, llm_memory.make_rows(setting), "cpu")
    _timing.time_step(built)
    reset_peak_rss()
    handle = torch.nn.modules.module.register_module_forward_hook(sample)
    times = [_timing.time_step(built) for _ in range(STEPS)]
    handle.remove()
    result = {"times_s": times, "peak_rss_mb": vm_hwm_kb() / 1024, "free_heap_held_max_mb": held[0] / 2**20}
    print(MARKER + json.dumps({**result, "error": built.error}))


def run(variant: str, setting_json: str, allocator: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(TIGHT if allocator == "tight" else {})
    command = [sys.executable, "-c", LAUNCHER, sys.executable, __file__, "--child", variant, setting_json]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if not lines:
        raise RuntimeError(f"{variant} ({allocator}) exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len(MARKER) :])


def main() -> None:
    from benchmarks import llm_memory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_malloc_8x256.json"))
    cli = parser.parse_args()
    if cli.child:
        return child(*cli.child)
    shape = llm_memory.Shape(hidden=cli.hidden, intermediate=cli.intermediate, vocab=cli.vocab)
    setting = llm_memory.Setting("full", "fp32", True, cli.seq, cli.batch, shape)
    runs: dict[str, dict[str, list[dict]]] = {a: {"stock": [], "dp": []} for a in ("default", "tight")}
    for round_ in range(cli.rounds):
        for allocator in ("default", "tight"):
            for variant in ("stock", "dp"):
                result = run(variant, setting.to_json(), allocator)
                runs[allocator][variant].append(result)
                print(f"round {round_} {allocator} {variant}: {json.dumps(result)}", flush=True)

    def dp_over_stock(allocator: str) -> dict[str, float]:
        stock, dp = runs[allocator]["stock"], runs[allocator]["dp"]
        step = [min(r["times_s"]) for r in stock], [min(r["times_s"]) for r in dp]
        return {
            "peak_rss_max": max(r["peak_rss_mb"] for r in dp) / max(r["peak_rss_mb"] for r in stock),
            "peak_rss_paired_median": statistics.median(
                d["peak_rss_mb"] / s["peak_rss_mb"] for s, d in zip(stock, dp, strict=True)
            ),
            "time_paired_median": statistics.median(d / s for s, d in zip(*step, strict=True)),
            "time_min": min(step[1]) / min(step[0]),
        }

    results = {
        "setting": json.loads(setting.to_json()),
        "environment": _timing.environment(),
        "runs": runs,
        "dp_over_stock": {allocator: dp_over_stock(allocator) for allocator in runs},
        "tight_over_default_time_min": {
            variant: min(min(r["times_s"]) for r in runs["tight"][variant])
            / min(min(r["times_s"]) for r in runs["default"][variant])
            for variant in ("stock", "dp")
        },
    }
    Path(cli.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: results[k] for k in ("dp_over_stock", "tight_over_default_time_min")}, indent=2))


if __name__ == "__main__":
    main()
