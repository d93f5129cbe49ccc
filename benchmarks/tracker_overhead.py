"""What the row tracker (hf_dp/clipping/rows.py, a ``TorchFunctionMode``: one Python call per operation) costs a
steady-state DP step where it stays on (OPT, MoE, T5, MPNet, DeBERTa, Mamba), and what the ``LooseWatch`` that
replaces it once it has stopped costs where it runs (a weighted pass that back-propagates the model: activation
checkpointing, ZeRO-3): step_counts.py's tiny Llama (4 × 64, B 4, T 64, fp32, one thread), one steady-state DP
step with the tracker forced on, with the watch and bare (the watch swapped for a null context), interleaved, in
two settings: book-keeping (whose sum comes from the taps: no watch runs, so watch = bare) and non-reentrant
activation checkpointing. On a Llama neither finds anything, so each ratio is its overhead alone, in a
launch-bound regime.

    .venv/bin/python benchmarks/tracker_overhead.py --out benchmarks/results/tracker_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
sys.path[:] = [_REPO_ROOT] + [p for p in sys.path if p != _REPO_ROOT]

import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from benchmarks import step_counts  # noqa: E402
from benchmarks._llama import llama_config  # noqa: E402
from hf_dp.backend import Backend  # noqa: E402
from hf_dp.clipping import rows  # noqa: E402
from hf_dp.clipping.engine import ClippingEngine  # noqa: E402
from hf_dp.clipping.pipeline import clipped_step  # noqa: E402
from hf_dp.clipping.plan import StepPlan  # noqa: E402
from hf_dp.losses import per_example_loss  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "tracker_overhead.json"


class _NoWatch(contextlib.nullcontext):
    """The bare arm: no mode at all once the tracker has stopped."""

    def __init__(self, loose) -> None:
        super().__init__()


def measure_setting(checkpointing: bool, rounds: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    shape = step_counts.TINY
    model = LlamaForCausalLM(llama_config(shape, step_counts.TINY_SEQ)).train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(0, shape.vocab, (step_counts.TINY_BATCH, step_counts.TINY_SEQ))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    step = clipped_step(ClippingEngine(model), model, Backend(checkpointing=checkpointing))
    mask = torch.ones(step_counts.TINY_BATCH)

    def run() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step.run(lambda module: per_example_loss(module, batch), mask, StepPlan(1.0), model)
        seconds = time.perf_counter() - start
        step.check_untouched()  # what the release does before the gradients are consumed
        return seconds

    run()  # the checked first step
    watch = rows.LooseWatch
    seconds: dict[str, list[float]] = {"bare": [], "watch": [], "tracker": []}
    try:
        for _ in range(rounds):
            for label in seconds:
                step.engine.row_tracking.on = label == "tracker"
                rows.LooseWatch = watch if label == "watch" else _NoWatch
                seconds[label].append(run())
    finally:
        rows.LooseWatch = watch
    median = {label: statistics.median(times) for label, times in seconds.items()}
    return {
        "median_ms": {label: round(1e3 * t, 2) for label, t in median.items()},
        "ratio_tracker_bare": round(median["tracker"] / median["bare"], 3),
        "ratio_watch_bare": round(median["watch"] / median["bare"], 3),
    }


def measure(rounds: int) -> dict:
    return {
        "benchmark": "tracker_overhead",
        "setting": {
            "shape": vars(step_counts.TINY),
            "seq": step_counts.TINY_SEQ,
            "batch": step_counts.TINY_BATCH,
        },
        "rounds": rounds,
        "book_keeping": measure_setting(False, rounds),
        "checkpointing": measure_setting(True, rounds),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    result = measure(args.rounds)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
