"""A long DP run under load: memory over time, the counters that must not grow, and ε against dp_accounting.

One ``DPTrainer`` run of a tiny GPT-2 (random weights, random fixed-length token rows, fp32, 1 thread) with
Poisson sampling, DP-AdamW at a given σ, a checkpoint every ``save_steps`` under ``save_total_limit``, an
evaluation every ``eval_steps`` and a log line every ``logging_steps``. Every ``sample_every`` optimizer steps
(in ``on_step_end``, i.e. before that step's log, evaluation and save) a callback records:

- ``rss_mb``: the process's resident set size (``/proc/self/statm``);
- ``tensors`` / ``tensor_mb``: the torch tensors alive after ``gc.collect()`` (found through ``gc``) and the
  bytes of their distinct storages;
- ``gc_objects``: every object the garbage collector tracks (each ``log_history`` entry is one of them);
- ``module_hooks``: forward, forward-pre, backward and backward-pre hooks on the model's modules;
  ``parameter_hooks``: tensor and post-accumulate-grad hooks on its parameters; ``global_hooks``: torch's
  global module hooks; ``optimizer_hooks``: step pre/post hooks on the DP update rule and torch's global ones;
- ``ledger_phases`` / ``ledger_steps``: the accountant's history (``state_dict()["history"]``): its length
  and its step count;
- ``epsilon_cache``: entries of the accountant's ε memo (an LRU cache of bounded size);
- ``log_history``: ``len(trainer.state.log_history)``, which grows by one per log line and evaluation BY DESIGN
  (the Trainer's record of the run);
- ``checkpoints`` / ``complete_checkpoints``: ``checkpoint-*`` folders on disk, and those with hf_dp's
  completion marker.

The summary gives RSS at 10%, 50% and 100% of the run, the least-squares RSS slope over the second half (MB per
1000 steps), and for every counter whether it is constant from ``warmup_step`` on. At the end, ``get_epsilon()``
is compared with Google's dp_accounting on the Poisson-sampled Gaussian with the run's σ, q = B̄/N and step
count (``RdpAccountant`` for accountant "rdp", ``PLDAccountant`` for "prv"), which is independent of Opacus.

    python benchmarks/long_run.py --steps 3000 --out benchmarks/results/long_run.json
    python benchmarks/long_run.py --quick      # 250 steps, a save every 20, an evaluation every 50
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # measure this checkout's hf_dp, whatever is installed
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks._timing import environment, tied_gpt2, write_result  # noqa: E402  (sets the offline environment first)

# isort: split

import dp_accounting  # noqa: E402
import torch  # noqa: E402
from dp_accounting.pld import PLDAccountant  # noqa: E402
from dp_accounting.rdp import RdpAccountant  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.modules import module as torch_module  # noqa: E402
from torch.optim import optimizer as torch_optimizer  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402
from hf_dp.accounting import _cached_epsilon  # noqa: E402
from hf_dp.checkpoint_files import checkpoint_folders, missing_part  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "long_run.json"
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
EPSILON_TOLERANCE = 0.01  # relative; what tests/test_accounting.py allows hf_dp against dp_accounting
# Counters that must not change once the run is warm. Not among them: log_history (the Trainer's record, one entry
# per log line and evaluation), gc_objects (which counts those entries), the ε memo (an LRU cache, bounded) and
# tensor_mb (the step's batch is alive in on_step_end, and its size varies under Poisson sampling).
FLAT_COUNTERS = (
    "tensors",
    "module_hooks",
    "parameter_hooks",
    "global_hooks",
    "optimizer_hooks",
    "ledger_phases",
    "checkpoints",
    "complete_checkpoints",
)


@dataclass(frozen=True)
class LongRunConfig:
    """The run: model shape, data, privacy and the Trainer's save / evaluation / logging cadence."""

    steps: int = 3000
    save_steps: int = 50
    save_total_limit: int = 2
    eval_steps: int = 100
    logging_steps: int = 10
    sample_every: int = 50
    warmup_step: int = 300  # counters must be constant from the first sample at or after this step
    layers: int = 2
    width: int = 64
    heads: int = 2
    vocab: int = 256
    seq: int = 32
    examples: int = 2048
    eval_examples: int = 64
    batch: int = 16  # expected logical batch B̄ (Poisson): q = batch / examples
    noise_multiplier: float = 1.0
    clip_norm: float = 1.0
    learning_rate: float = 1e-3
    accountant: str = "prv"
    seed: int = 0


QUICK = LongRunConfig(steps=250, save_steps=20, eval_steps=50, sample_every=10, warmup_step=60)


class RandomTokens(Dataset):
    """``n`` random token rows of length ``seq``; labels are the inputs (every token predicted)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, seq), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack equal-length rows; every token is attended to and predicted."""
    ids = torch.stack([row["input_ids"] for row in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def build_trainer(config: LongRunConfig, output_dir: str) -> DPTrainer:
    """The ``DPTrainer`` of the module docstring: Poisson sampling, DP-AdamW at σ, saves, evaluations, logs."""
    args = DPTrainingArguments(
        output_dir=output_dir,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        max_steps=config.steps,
        per_device_train_batch_size=config.batch,
        per_device_eval_batch_size=config.eval_examples,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        dp_optimizer="adamw",
        noise_multiplier=config.noise_multiplier,
        per_sample_max_grad_norm=config.clip_norm,
        accountant=config.accountant,
        poisson_sampling=True,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.save_total_limit,
        eval_strategy="steps",
        eval_steps=config.eval_steps,
        logging_steps=config.logging_steps,
        seed=config.seed,
        insecure_dp_seed=config.seed,
    )
    return DPTrainer(
        model=tied_gpt2(config.layers, config.width, config.heads, config.vocab, config.seq, config.seed),
        args=args,
        train_dataset=RandomTokens(config.examples, config.seq, config.vocab, config.seed),
        eval_dataset=RandomTokens(config.eval_examples, config.seq, config.vocab, config.seed + 1),
        data_collator=collate,
    )


# ---- what is sampled ----------------------------------------------------------------------------------


def rss_mb() -> float:
    """Resident set size of this process (second field of /proc/self/statm, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE_MB


def live_tensors() -> tuple[int, float]:
    """The number of torch tensors alive after a collection, and the MB of their distinct storages."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return len(tensors), sum(storages.values()) / 2**20


def module_hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for m in model.modules()
    )


def parameter_hook_count(model: nn.Module) -> int:
    return sum(
        len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        for p in model.parameters()
    )


def global_hook_count() -> int:
    return sum(
        len(hooks)
        for hooks in (
            torch_module._global_forward_hooks,
            torch_module._global_forward_pre_hooks,
            torch_module._global_backward_hooks,
            torch_module._global_backward_pre_hooks,
        )
    )


def optimizer_hook_count(optimizer: torch.optim.Optimizer | None) -> int:
    own = (
        0
        if optimizer is None
        else len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
    )
    return (
        own
        + len(torch_optimizer._global_optimizer_pre_hooks)
        + len(torch_optimizer._global_optimizer_post_hooks)
    )


def sample(trainer: DPTrainer, step: int) -> dict[str, Any]:
    """Every quantity of the module docstring, now."""
    tensors, tensor_mb = live_tensors()
    history = trainer.accountant.state_dict()["history"]
    folders = checkpoint_folders(trainer.args.output_dir)
    return {
        "step": step,
        "time_s": time.perf_counter(),
        "rss_mb": rss_mb(),
        "tensors": tensors,
        "tensor_mb": tensor_mb,
        "gc_objects": len(gc.get_objects()),
        "module_hooks": module_hook_count(trainer.model),
        "parameter_hooks": parameter_hook_count(trainer.model),
        "global_hooks": global_hook_count(),
        "optimizer_hooks": optimizer_hook_count(trainer.dp.optimizer),
        "ledger_phases": len(history),
        "ledger_steps": sum(n for _, _, n in history),
        "epsilon_cache": _cached_epsilon.cache_info().currsize,
        "log_history": len(trainer.state.log_history),
        "checkpoints": len(folders),
        "complete_checkpoints": sum(missing_part(f) is None for f in folders),
    }


class MemoryProbe(TrainerCallback):
    """Samples the trainer every ``every`` optimizer steps (and at step 1), at the end of the step."""

    def __init__(self, trainer: DPTrainer, every: int) -> None:
        self.trainer, self.every = trainer, every
        self.samples: list[dict[str, Any]] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 or state.global_step % self.every == 0:
            self.samples.append(sample(self.trainer, state.global_step))
        return control


# ---- the summary ----------------------------------------------------------------------------------------


def at_fraction(samples: list[dict[str, Any]], fraction: float, steps: int) -> dict[str, Any]:
    """The sample closest to ``fraction`` of the run."""
    return min(samples, key=lambda s: abs(s["step"] - fraction * steps))


def slope_per_1000_steps(samples: list[dict[str, Any]], key: str) -> float:
    """Least-squares slope of ``key`` against the step, times 1000."""
    xs, ys = [s["step"] for s in samples], [s[key] for s in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return 1000 * sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


def summarize(samples: list[dict[str, Any]], config: LongRunConfig) -> dict[str, Any]:
    warm = [s for s in samples if s["step"] >= config.warmup_step]
    second_half = [s for s in samples if s["step"] >= config.steps / 2]
    counters = {}
    for key in FLAT_COUNTERS:
        values = [s[key] for s in warm]
        counters[key] = {
            "after_warmup": values[0],
            "min": min(values),
            "max": max(values),
            "constant": min(values) == max(values),
        }
    return {
        "rss_mb": {
            f"{int(100 * f)}%": at_fraction(samples, f, config.steps)["rss_mb"] for f in (0.1, 0.5, 1.0)
        },
        "rss_mb_first_sample": samples[0]["rss_mb"],
        "rss_slope_mb_per_1000_steps_second_half": slope_per_1000_steps(second_half, "rss_mb"),
        "tensor_mb_after_warmup": [min(s["tensor_mb"] for s in warm), max(s["tensor_mb"] for s in warm)],
        "tensor_mb_slope_per_1000_steps_second_half": slope_per_1000_steps(second_half, "tensor_mb"),
        "gc_objects_slope_per_1000_steps_second_half": slope_per_1000_steps(second_half, "gc_objects"),
        "log_history_slope_per_1000_steps_second_half": slope_per_1000_steps(second_half, "log_history"),
        "warmup_step": warm[0]["step"],
        "counters": counters,
        "counters_constant_after_warmup": all(c["constant"] for c in counters.values()),
    }


def reference_epsilon(accountant: str, sigma: float, sample_rate: float, steps: int, delta: float) -> float:
    """dp_accounting's ε of ``steps`` Poisson-sampled Gaussian releases: RDP for "rdp", PLD for "prv" (a 1e-4
    value grid where ε < 2, where 1e-3 would be a few percent off, as in tests/test_accounting.py)."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    rdp = RdpAccountant()
    rdp.compose(event)
    if accountant == "rdp":
        return rdp.get_epsilon(delta)
    pld = PLDAccountant(value_discretization_interval=1e-3 if rdp.get_epsilon(delta) > 2 else 1e-4)
    pld.compose(event)
    return pld.get_epsilon(delta)


def epsilon_check(trainer: DPTrainer, config: LongRunConfig) -> dict[str, Any]:
    """``get_epsilon()`` against dp_accounting with σ, q and T taken from the configuration and the step count."""
    sample_rate = config.batch / config.examples
    steps = trainer.state.global_step
    ours = trainer.get_epsilon()
    reference = reference_epsilon(
        config.accountant, config.noise_multiplier, sample_rate, steps, trainer.target_delta
    )
    relative = abs(ours / reference - 1)
    return {
        "accountant": config.accountant,
        "noise_multiplier": config.noise_multiplier,
        "sample_rate": sample_rate,
        "steps": steps,
        "ledger_steps": trainer.accountant.steps,
        "delta": trainer.target_delta,
        "hf_dp": ours,
        "dp_accounting": reference,
        "relative_difference": relative,
        "tolerance": EPSILON_TOLERANCE,
        "within_tolerance": relative < EPSILON_TOLERANCE and trainer.accountant.steps == steps,
    }


def long_run(config: LongRunConfig, output_dir: str) -> dict[str, Any]:
    """Train ``config`` in ``output_dir``; the samples, their summary, the state after ``train()`` and the ε check."""
    trainer = build_trainer(config, output_dir)
    probe = MemoryProbe(trainer, config.sample_every)
    trainer.add_callback(probe)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    for s in probe.samples:
        s["time_s"] -= start
    return {
        "config": asdict(config),
        "seconds": seconds,
        "seconds_per_step": seconds / config.steps,
        "summary": summarize(probe.samples, config),
        "after_train": sample(trainer, trainer.state.global_step),  # the clipping hooks are removed by now
        "epsilon": epsilon_check(trainer, config),
        "samples": probe.samples,
    }


# ---- the report -----------------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    config, summary, eps = result["config"], result["summary"], result["epsilon"]
    after = result["after_train"]
    lines = [
        "# Long run: memory over time and ε (`benchmarks/long_run.py`)",
        "",
        f"Tiny GPT-2 ({config['layers']} × {config['width']}, vocab {config['vocab']}, T {config['seq']}), "
        f"N = {config['examples']}, B̄ = {config['batch']} (Poisson), DP-AdamW, σ = {config['noise_multiplier']:g}, "
        f"{config['steps']} steps; a save every {config['save_steps']} (save_total_limit {config['save_total_limit']}), "
        f"an evaluation every {config['eval_steps']}, a log every {config['logging_steps']}; 1 thread; "
        f"{result['seconds']:.0f} s ({1000 * result['seconds_per_step']:.0f} ms per step, saves and evaluations included).",
        "",
        "| RSS | MB |",
        "|---|---|",
        f"| step {result['samples'][0]['step']} | {summary['rss_mb_first_sample']:.1f} |",
        *(f"| {k} of the run | {v:.1f} |" for k, v in summary["rss_mb"].items()),
        f"| slope over the second half | {summary['rss_slope_mb_per_1000_steps_second_half']:+.2f} per 1000 steps |",
        "",
        f"| counter (from step {summary['warmup_step']}) | value | constant |",
        "|---|---|---|",
        *(
            f"| {k} | {c['min']:.4g}–{c['max']:.4g} | {'yes' if c['constant'] else '**no**'} |"
            for k, c in summary["counters"].items()
        ),
        "| tensor MB (the step's Poisson batch included) | {:.3f}–{:.3f} | — |".format(
            *summary["tensor_mb_after_warmup"]
        ),
        f"| log_history (grows by design: one entry per log line and evaluation) | "
        f"{result['samples'][0]['log_history']} → {after['log_history']} | — |",
        "",
        f"After `train()`: module hooks {after['module_hooks']}, optimizer hooks {after['optimizer_hooks']}, "
        f"complete checkpoints on disk {after['complete_checkpoints']}.",
        "",
        "| ε at δ = {:.3g} after {} steps | value |".format(eps["delta"], eps["steps"]),
        "|---|---|",
        f"| hf_dp `get_epsilon()` ({eps['accountant']}) | {eps['hf_dp']:.5f} |",
        f"| dp_accounting ({'RDP' if eps['accountant'] == 'rdp' else 'PLD'}) | {eps['dp_accounting']:.5f} |",
        f"| relative difference | {eps['relative_difference']:.2e} (tolerance {eps['tolerance']:g}) |",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=LongRunConfig.steps)
    parser.add_argument("--quick", action="store_true", help="the test's settings: 250 steps, saves every 20")
    parser.add_argument("--accountant", choices=("prv", "rdp"), default=LongRunConfig.accountant)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    options = parser.parse_args()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    config = QUICK if options.quick else LongRunConfig(steps=options.steps, warmup_step=options.steps // 10)
    config = replace(config, accountant=options.accountant)
    with tempfile.TemporaryDirectory() as output_dir:
        result = {"environment": environment(), **long_run(config, output_dir)}
    write_result(options.out, result)
    options.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
