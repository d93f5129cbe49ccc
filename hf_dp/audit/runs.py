"""The audit's training runs: the user's arguments, trainer class and data, plus canaries.

Step audit: two runs, on D and on D' = D + one canary, with the user's σ, q, C, batch, accumulation, clipping
mode, update rule and backend. Each step is one trial: before it the update rule's state is reset, so the probe's
update is the rule's FIRST update, a function of that step's released gradient alone (the probe has no weight
decay and the learning rate is constant). Poisson steps are independent trials; with shuffled fixed-size batches
only the first step of each epoch is used (the steps of one epoch share the canary's single slot).

One-run audit: one run of the user's length on D plus the canaries drawn with probability ½; a canary's score is
its probe weight after training.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import PrinterCallback, TrainerCallback

from hf_dp.accounting import compute_epsilon
from hf_dp.arguments import DPTrainingArguments
from hf_dp.audit import bounds
from hf_dp.audit.canary import CanaryCollator, WithCanaries, attach_probe, audited_trainer_class, probe_of
from hf_dp.bandmf import per_step_error
from hf_dp.privacy import plan_privacy
from hf_dp.trainer import DPTrainer

POWERLESS_EPSILON = 0.05  # an exact step's median bound below this: the audit cannot see the canary


@dataclass
class StepAudit:
    """What a step audit found, and what it is compared with."""

    optimizer: str
    noise_multiplier: float
    sample_rate: float
    clip_norm: float
    expected_batch_size: int
    world_size: int
    backend: str
    trials: int
    threshold: bounds.ThresholdBound  # the assumption-free bound, at the δ where it is most telling
    at_run_delta: bounds.ThresholdBound  # the same test at the run's own δ
    gaussian: bounds.GaussianFit
    ideal_epsilon: float  # the median bound of an exact implementation with as many trials (simulated)
    run_epsilon: float  # the ε the full training run reports
    seconds: float
    scores_without: np.ndarray = field(repr=False)
    scores_with: np.ndarray = field(repr=False)

    @property
    def flagged(self) -> bool:
        """The verdict rests on one test (its δ grid includes the run's δ), so its confidence is the stated one."""
        return self.threshold.exceeds_claim

    def summary(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "backend": self.backend,
            "world_size": self.world_size,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "clip_norm": self.clip_norm,
            "expected_batch_size": self.expected_batch_size,
            "trials_per_world": self.trials,
            "epsilon_lower_bound": self.threshold.epsilon,
            "delta": self.threshold.delta,
            "reported_epsilon_one_step": self.threshold.claimed_epsilon,
            "ideal_lower_bound": self.ideal_epsilon,
            "confidence": self.threshold.confidence,
            "at_run_delta": self.at_run_delta.as_dict(),
            "gaussian_fit": dataclasses.asdict(self.gaussian),
            "reported_epsilon_full_run": self.run_epsilon,
            "flagged": self.flagged,
            "seconds": self.seconds,
        }

    def __str__(self) -> str:
        t, r = self.threshold, self.at_run_delta
        verdict = (
            "VIOLATION: the step leaks more than it reports" if self.flagged else "consistent with the claim"
        )
        return (
            f"step audit ({self.optimizer}, {self.backend} x{self.world_size}, σ={self.noise_multiplier:.3g}, "
            f"q={self.sample_rate:.3g}, {self.trials} trials per world): {verdict}\n"
            f"  ε ≥ {t.epsilon:.3f} at δ={t.delta:g} (reported for one step: {t.claimed_epsilon:.3f}; an exact "
            f"implementation would show {self.ideal_epsilon:.3f} with these trials; {t.confidence:.0%} confidence)\n"
            f"  ε ≥ {r.epsilon:.3f} at the run's δ={r.delta:g} (reported: {r.claimed_epsilon:.3f})\n"
            f"  Gaussian-DP fit: μ ≈ {self.gaussian.mu:.3f} (≥ {self.gaussian.mu_lower:.3f}); μ = 1/σ = "
            f"{1 / self.noise_multiplier if self.noise_multiplier else math.inf:.3f} for one step at q = 1\n"
            f"  the full run reports ε = {self.run_epsilon:.3f} at δ={r.delta:g}" + self._power_hint()
        )

    def _power_hint(self) -> str:
        """What to change when even an exact step would show nothing: q (the canary is rarely drawn) or trials."""
        if self.ideal_epsilon >= POWERLESS_EPSILON:
            return ""
        if self.sample_rate < 0.5:
            return (
                f"\n  note: at q={self.sample_rate:.3g} even an exact step shows nothing in {self.trials} trials; "
                f"to test the clipping, noise and update rule, rerun with --num_examples {self.expected_batch_size} "
                "(q ≈ 1)"
            )
        return f"\n  note: even an exact step shows nothing in {self.trials} trials; raise --trials"


class _ProbeRecorder(TrainerCallback):
    """Records the probe's update at every step; with ``reset`` the rule's state is fresh and the probe's weight
    0 before each, so that every step is an independent trial."""

    def __init__(self, trainer: DPTrainer, reset: bool) -> None:
        self.trainer, self.reset = trainer, reset
        self.fresh_state: dict | None = None
        self.updates: list[np.ndarray] = []

    def on_step_begin(self, args, state, control, **kwargs):
        rule = self.trainer.dp.optimizer
        if self.reset:
            if self.fresh_state is None:
                self.fresh_state = copy.deepcopy(rule.state_dict())
            else:
                rule.load_state_dict(self.fresh_state)
            _zero_probe(self.trainer)
        self._before = probe_of(self.trainer.model).weight.detach().double().cpu().flatten().clone()

    def on_step_end(self, args, state, control, **kwargs):
        after = probe_of(self.trainer.model).weight.detach().double().cpu().flatten()
        self.updates.append((after - self._before).numpy())


def _zero_probe(trainer: DPTrainer) -> None:
    """Every trial starts from w = 0: a weight that drifted with earlier trials would carry them into this one's
    score (even through the rounding of w + Δ)."""
    weight = probe_of(trainer.model).weight
    with torch.no_grad():
        weight.zero_()
    if trainer.is_deepspeed_enabled:  # ZeRO keeps its own fp32 copy of the weights it steps
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(weight, torch.zeros_like(weight))


def audit_arguments(args: DPTrainingArguments, *, output_dir: str, seed_offset: int, **changes: Any):
    """The user's arguments for an audit run: same privacy and step, no saving, logging or hub."""
    names = {f.name for f in dataclasses.fields(args) if f.init}
    fixed = {
        "output_dir": output_dir,
        "save_strategy": "no",
        "eval_strategy": "no",
        "logging_strategy": "no",
        "report_to": "none",
        "push_to_hub": False,
        "load_best_model_at_end": False,
        "remove_unused_columns": False,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "disable_tqdm": True,
        "allow_large_delta": True,  # δ is the user run's, checked there against its own N
        "accountant": "rdp",  # the run's own ledger is not the claim (that is computed below); RDP never overflows
        "insecure_dp_seed": None if args.insecure_dp_seed is None else args.insecure_dp_seed + seed_offset,
        **changes,
    }
    return dataclasses.replace(args, **{k: v for k, v in fixed.items() if k in names})


def _run(
    args: DPTrainingArguments,
    model_init: Callable[[], nn.Module],
    dataset: Dataset,
    collator,
    trainer_class: type,
    canaries: int,
    reset: bool,
):
    model = model_init()
    attach_probe(model, canaries)
    trainer = audited_trainer_class(trainer_class)(
        model=model, args=args, train_dataset=dataset, data_collator=CanaryCollator(collator)
    )
    # The audit run's own metrics and RDP ledger (thousands of reset steps) are not the claim: keep them quiet.
    trainer.remove_callback(PrinterCallback)
    recorder = _ProbeRecorder(trainer, reset)
    trainer.add_callback(recorder)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the smallest alpha")
        trainer.train()
    return trainer, np.stack(recorder.updates)


def _optimizer_name(trainer: DPTrainer) -> str:
    return trainer.dp.update_rule[0]


def _backend(trainer: DPTrainer) -> str:
    if trainer.is_deepspeed_enabled:
        return f"deepspeed-zero{trainer.dp.backend.zero_stage}"
    return "ddp" if trainer.args.world_size > 1 else "single"


def audit_step(
    args: DPTrainingArguments,
    model_init: Callable[[], nn.Module],
    train_dataset: Dataset,
    data_collator=None,
    *,
    trials: int = 1000,
    trainer_class: type = DPTrainer,
    confidence: float = 0.95,
    output_dir: str | None = None,
) -> StepAudit:
    """White-box audit of one step of the run ``args`` describes over ``train_dataset`` (σ from its plan)."""
    if args.noise_mechanism != "independent":
        raise ValueError(
            f"hf_dp.audit: the step audit replays one step as independent trials, but noise_mechanism="
            f"{args.noise_mechanism!r} correlates each step's noise with the steps before it, so one step alone is not "
            "the mechanism the run accounts; audit the whole run with audit_one_run"
        )
    start = time.perf_counter()
    run_plan = plan_privacy(args, train_dataset)
    with tempfile.TemporaryDirectory() as scratch:
        out = output_dir or scratch
        steps_per_trial = (
            1 if args.poisson_sampling else math.ceil((len(train_dataset) + 1) / run_plan.expected_batch_size)
        )
        common = dict(
            noise_multiplier=run_plan.noise_multiplier,
            target_epsilon=None,
            target_delta=run_plan.delta,
            max_steps=trials * steps_per_trial,
        )
        scores = {}
        for offset, (world, canary_ids) in enumerate((("without", []), ("with", [1]))):
            run_args = audit_arguments(args, output_dir=f"{out}/{world}", seed_offset=offset, **common)
            dataset = WithCanaries(train_dataset, canary_ids)
            trainer, updates = _run(
                run_args, model_init, dataset, data_collator, trainer_class, 1, reset=True
            )
            scores[world] = updates[::steps_per_trial, 0] / run_args.learning_rate
    plan = trainer.privacy_plan  # the canary's world: q = B̄/(N + 1)
    claimed = functools.lru_cache(maxsize=None)(
        lambda delta: compute_epsilon(plan.noise_multiplier, plan.sample_rate, 1, delta, run_plan.accountant)
    )
    deltas = sorted({*bounds.AUDIT_DELTAS, run_plan.delta})
    threshold = bounds.threshold_audit(scores["without"], scores["with"], claimed, deltas, confidence)
    at_run_delta = bounds.threshold_audit(
        scores["without"], scores["with"], claimed, [run_plan.delta], confidence
    )
    ideal = bounds.simulate_ideal_step(
        plan.noise_multiplier, plan.sample_rate, trials, claimed, deltas, confidence
    )
    return StepAudit(
        optimizer=_optimizer_name(trainer),
        noise_multiplier=plan.noise_multiplier,
        sample_rate=plan.sample_rate,
        clip_norm=plan.clip_norm,
        expected_batch_size=plan.expected_batch_size,
        world_size=args.world_size,
        backend=_backend(trainer),
        trials=trials,
        threshold=threshold,
        at_run_delta=at_run_delta,
        gaussian=bounds.gaussian_fit(scores["without"], scores["with"], run_plan.delta, confidence),
        ideal_epsilon=ideal,
        run_epsilon=compute_epsilon(
            run_plan.noise_multiplier,
            run_plan.sample_rate,
            run_plan.planned_steps,
            run_plan.delta,
            run_plan.accountant,
        ),
        seconds=time.perf_counter() - start,
        scores_without=scores["without"],
        scores_with=scores["with"],
    )


@dataclass
class OneRunAudit:
    optimizer: str
    noise_multiplier: float
    sample_rate: float
    steps: int
    bound: bounds.OneRunBound
    ideal_epsilon: float
    seconds: float
    scores: np.ndarray = field(repr=False)
    included: np.ndarray = field(repr=False)

    @property
    def flagged(self) -> bool:
        return self.bound.exceeds_claim

    def summary(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            **self.bound.as_dict(),
            "ideal_lower_bound": self.ideal_epsilon,
            "flagged": self.flagged,
            "seconds": self.seconds,
        }

    def __str__(self) -> str:
        b = self.bound
        verdict = (
            "VIOLATION: the run leaks more than it reports" if self.flagged else "consistent with the claim"
        )
        return (
            f"one-run audit ({self.optimizer}, {b.canaries} canaries, {self.steps} steps, σ={self.noise_multiplier:.3g},"
            f" q={self.sample_rate:.3g}): {verdict}\n"
            f"  ε ≥ {b.epsilon:.3f} at δ={b.delta:g} from {b.correct}/{b.guesses} right guesses (reported: "
            f"{b.claimed_epsilon:.3f}; an exact implementation would show {self.ideal_epsilon:.3f}; "
            f"{b.confidence:.0%} confidence)"
        )


def audit_one_run(
    args: DPTrainingArguments,
    model_init: Callable[[], nn.Module],
    train_dataset: Dataset,
    data_collator=None,
    *,
    canaries: int = 1000,
    trainer_class: type = DPTrainer,
    confidence: float = 0.95,
    seed: int | None = None,
    output_dir: str | None = None,
) -> OneRunAudit:
    """Steinke, Nasr, Jagielski 2023: ``canaries`` canaries, each in the training set with probability ½, one run
    of the length ``args`` asks for; the bound is on the whole run's ε as that run reports it."""
    start = time.perf_counter()
    run_plan = plan_privacy(args, train_dataset)
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5
    with tempfile.TemporaryDirectory() as scratch:
        run_args = audit_arguments(
            args,
            output_dir=output_dir or scratch,
            seed_offset=0,
            noise_multiplier=run_plan.noise_multiplier,
            target_epsilon=None,
            target_delta=run_plan.delta,
            max_steps=run_plan.planned_steps,
        )
        dataset = WithCanaries(train_dataset, [j + 1 for j in np.flatnonzero(included)])
        trainer, updates = _run(
            run_args, model_init, dataset, data_collator, trainer_class, canaries, reset=False
        )
    scores = updates.sum(axis=0)
    plan = trainer.privacy_plan
    claimed = compute_epsilon(
        plan.noise_multiplier, plan.sample_rate, trainer.accountant.steps, plan.delta, run_plan.accountant
    )
    bound = bounds.one_run_audit(scores, included, plan.delta, claimed, confidence)
    released = trainer.dp.mechanism.step
    ideal = bounds.simulate_ideal_one_run(  # correlated noise: the noise of the sum is C⁻¹z's last prefix sum
        plan.noise_multiplier,
        plan.sample_rate,
        trainer.accountant.steps,
        canaries,
        plan.delta,
        claimed,
        confidence,
        sum_noise_std=plan.noise_multiplier * math.sqrt(per_step_error(plan.strategy.coefs, released)[-1]),
    )
    return OneRunAudit(
        optimizer=_optimizer_name(trainer),
        noise_multiplier=plan.noise_multiplier,
        sample_rate=plan.sample_rate,
        steps=released,
        bound=bound,
        ideal_epsilon=ideal,
        seconds=time.perf_counter() - start,
        scores=scores,
        included=included,
    )
