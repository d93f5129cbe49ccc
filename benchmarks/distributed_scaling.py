"""Scaling from 1 to 2 processes on CPU, DP vs non-private (DDP, DeepSpeed ZeRO-2/3, FSDP2), interleaved rounds.

Each configuration is a fresh launch (python / torchrun) of this same file with ``--worker``; the worker
trains a GPT-2-shaped model with DPTrainer for a fixed number of steps of the same logical batch and
reports the time per optimizer step, measured after one warm-up step, and the peak resident memory of each
process (the largest over the processes of a launch). On 2 cores one process runs 2
threads and each of 2 processes runs 1 thread, so this measures the parallel efficiency of the
multi-process paths (extra communication, DeepSpeed's two passes), not a speed-up from more hardware.

    python benchmarks/distributed_scaling.py [--rounds 3] [--out benchmarks/results/distributed_scaling.json]

``--checkpointing`` measures the 2-process backends with activation checkpointing (non-reentrant) instead, with a
third configuration per backend: DP with the weighted pass forced to run whole (no tail skip, no layer replay;
docs/clipping.md), which isolates what those save; and under DDP and ZeRO-2 a fourth: DP with the layers below the
tail chained (replayed) instead of one by one (hf_dp/clipping/layerwise.py).

    python benchmarks/distributed_scaling.py --checkpointing --seq 512 --out benchmarks/results/distributed_checkpointing.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "1 process, non-private": ("single", (), True),
    "1 process, DP": ("single", (), False),
    "2 processes DDP, non-private": ("torchrun", (), True),
    "2 processes DDP, DP": ("torchrun", (), False),
    "2 processes ZeRO-2, non-private": ("torchrun", ("--zero", "2"), True),
    "2 processes ZeRO-2, DP": ("torchrun", ("--zero", "2"), False),
    "2 processes ZeRO-3, non-private": ("torchrun", ("--zero", "3"), True),
    "2 processes ZeRO-3, DP": ("torchrun", ("--zero", "3"), False),
    "2 processes FSDP2, non-private": ("torchrun", ("--fsdp",), True),
    "2 processes FSDP2, DP": ("torchrun", ("--fsdp",), False),
}
BACKENDS = ["1 process", "2 processes DDP", "2 processes ZeRO-2", "2 processes ZeRO-3", "2 processes FSDP2"]
CHECKPOINTED_BACKENDS = {
    "2 processes DDP": (),
    "2 processes ZeRO-2": ("--zero", "2"),
    "2 processes ZeRO-3": ("--zero", "3"),
    "2 processes FSDP2": ("--fsdp",),
}
WHOLE = "DP, whole weighted pass"
CHAINED = "DP, layers chained"
LAYERWISE_BACKENDS = {"2 processes DDP", "2 processes ZeRO-2"}  # where the layers run one by one
CHECKPOINTED = {
    f"{backend}, {variant}": ("torchrun", (*flags, "--checkpointing", *extra), variant == "non-private")
    for backend, flags in CHECKPOINTED_BACKENDS.items()
    for variant, extra in (
        ("non-private", ()),
        ("DP", ()),
        (WHOLE, ("--whole_weighted_pass",)),
        *([(CHAINED, ("--chained_layers",))] if backend in LAYERWISE_BACKENDS else []),
    )
}


def worker(cli: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    from hf_dp import DPTrainer, DPTrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, 2 // world))
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=256,
        n_head=4,
        vocab_size=8192,
        n_positions=cli.seq,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = GPT2LMHeadModel(config)

    class Rows(Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(2, 8192, (cli.seq,), generator=g)
            return {"input_ids": ids, "labels": ids}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    deepspeed = None
    if cli.zero is not None:
        deepspeed = {
            "zero_optimization": {"stage": cli.zero},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": 0,
            "zero_allow_untested_optimizer": True,
        }
    privacy = {} if cli.non_private else {"noise_multiplier": 1.0}
    args = DPTrainingArguments(
        output_dir="/tmp/hf_dp_scaling",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        logging_strategy="no",
        per_device_train_batch_size=cli.batch // (world * 2),
        gradient_accumulation_steps=2,
        learning_rate=1e-4,
        dp_optimizer="adamw",
        per_sample_max_grad_norm=1.0,
        max_steps=cli.steps + 1,
        activation_checkpointing=cli.checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        seed=0,
        disable_dp=cli.non_private,
        deepspeed=deepspeed,
        fsdp=cli.fsdp,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]} if cli.fsdp else None,
        **privacy,
        poisson_sampling=False,  # the same batch size every step, so step times compare
    )
    clock = Clock()
    trainer = DPTrainer(model=model, args=args, train_dataset=Rows())
    trainer.add_callback(clock)
    if (
        cli.whole_weighted_pass
    ):  # every step after the checked first one runs the tail and the layers' forward
        trainer.dp.clipping.force(skips_tail=False, replays=False)
    if (
        cli.chained_layers
    ):  # every step after the checked first one chains (replays) the layers below the tail
        trainer.dp.clipping.force(layerwise=False)
    trainer.train()
    import resource

    import torch.distributed as dist

    peak = torch.tensor(float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024)  # MiB (Linux: KiB)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if args.process_index == 0:
        per_step = (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)
        info = {"seconds_per_step": per_step, "peak_rss_mib": peak.item(), "world_size": args.world_size}
        info["distributed_type"] = str(trainer.accelerator.distributed_type)
        print(json.dumps(info))
    trainer.accelerator.wait_for_everyone()

    if dist.is_initialized():
        dist.destroy_process_group()


def launch(kind: str, extra: tuple[str, ...], non_private: bool, cli: argparse.Namespace, port: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    if kind == "single":
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        command = [sys.executable]
    else:
        command = [
            str(Path(sys.executable).parent / "torchrun"),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
        ]
    command += [
        __file__,
        "--worker",
        "--steps",
        str(cli.steps),
        "--batch",
        str(cli.batch),
        "--seq",
        str(cli.seq),
    ]
    command += [*extra, *(["--non_private"] if non_private else [])]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-4000:])
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--zero", type=int, default=None)
    parser.add_argument("--non_private", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16, help="logical batch (2 micro-batches)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing (see the docstring)"
    )
    parser.add_argument(
        "--backends", nargs="+", default=None, help="with --checkpointing: some of DDP ZeRO-2 ZeRO-3 FSDP2"
    )
    parser.add_argument("--whole_weighted_pass", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chained_layers", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "distributed_scaling.json"))
    cli = parser.parse_args()
    if cli.worker:
        return worker(cli)
    backends = [f"2 processes {b}" for b in cli.backends] if cli.backends else list(CHECKPOINTED_BACKENDS)
    if cli.backends and (not cli.checkpointing or set(backends) - set(CHECKPOINTED_BACKENDS)):
        raise SystemExit(f"--backends takes --checkpointing and some of {list(CHECKPOINTED_BACKENDS)}")
    configs = (
        {name: c for name, c in CHECKPOINTED.items() if name.split(", ", 1)[0] in backends}
        if cli.checkpointing
        else CONFIGS
    )
    load_at_start = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in configs}
    peaks: dict[str, list[float]] = {name: [] for name in configs}
    kinds: dict[str, str] = {}
    port = 29900
    for round_ in range(cli.rounds):  # interleaved: every configuration once per round
        for name, (kind, extra, non_private) in configs.items():
            port += 1
            run = launch(kind, extra, non_private, cli, port)
            times[name].append(run["seconds_per_step"])
            peaks[name].append(run["peak_rss_mib"])
            kinds[name] = run["distributed_type"]
            print(
                f"round {round_}: {name}: {times[name][-1]:.3f} s/step, peak {peaks[name][-1]:.0f} MiB",
                flush=True,
            )

    def ratio(a: str, b: str) -> dict[str, float]:
        """a over b: paired median and min-time ratios of the step time, and the peak-memory ratio."""
        return {
            "paired_median_time": statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)),
            "min_time": min(times[a]) / min(times[b]),
            "peak_memory": max(peaks[a]) / max(peaks[b]),
        }

    results = {
        "setup": {
            "model": "GPT-2 4x256, vocab 8192",
            "seq": cli.seq,
            "logical_batch": cli.batch,
            "steps_timed": cli.steps,
            "rounds": cli.rounds,
            "activation_checkpointing": "non-reentrant" if cli.checkpointing else "off",
            "load_average_start_end": [load_at_start, os.getloadavg()],
            "optimizer": "adamw",
            "cores": os.cpu_count(),
        },
        "seconds_per_step": times,
        "peak_rss_mib_per_process": {name: max(p) for name, p in peaks.items()},
        "distributed_type": kinds,
    }
    if cli.checkpointing:
        results["dp_over_non_private_same_launch"] = {
            backend: {
                "DP": ratio(f"{backend}, DP", f"{backend}, non-private"),
                WHOLE: ratio(f"{backend}, {WHOLE}", f"{backend}, non-private"),
                f"DP over {WHOLE}": ratio(f"{backend}, DP", f"{backend}, {WHOLE}"),
                **(
                    {f"DP over {CHAINED}": ratio(f"{backend}, DP", f"{backend}, {CHAINED}")}
                    if backend in LAYERWISE_BACKENDS
                    else {}
                ),
            }
            for backend in backends
        }
    else:
        base = "1 process, non-private"
        results["paired_median_ratio_vs_1_process_non_private"] = {
            name: ratio(name, base)["paired_median_time"] for name in times
        }
        results["min_time_ratio_vs_1_process_non_private"] = {
            name: ratio(name, base)["min_time"] for name in times
        }
        results["dp_over_non_private_same_launch"] = {
            backend: ratio(f"{backend}, DP", f"{backend}, non-private") for backend in BACKENDS
        }
    Path(cli.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
