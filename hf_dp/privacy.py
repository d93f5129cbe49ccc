"""The privacy plan of a run: N, B̄, q, T, δ, σ and C, derived once from the arguments and the data set.

σ is calibrated from (ε, δ, q, T) by the accountant (Opacus PRV or RDP) unless given. δ defaults to N^-1.1,
below 1/N for every N ≥ 2; a δ ≥ 1/N would let a mechanism publish one whole example with probability δ
and still be "(ε, δ)-DP", so it is refused unless ``allow_large_delta`` (which the model card reports).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset

from hf_dp.accounting import calibrate_noise_multiplier
from hf_dp.bandmf import INDEPENDENT, BandedToeplitz, banded_strategy, choose_bands

logger = logging.getLogger(__name__)

# Above this σ the noise on ĝ dwarfs any clipped sum by a factor 1e6: the run would learn nothing.
MAX_NOISE_MULTIPLIER = 1e6


def default_delta(num_examples: int) -> float:
    """δ = N^-1.1, below 1/N for every N ≥ 2 (the usual "δ ≪ 1/N" advice, e.g. Ponomareva et al. 2023)."""
    return float(num_examples) ** -1.1


@dataclass(frozen=True)
class PrivacyPlan:
    """What the run promises: the subsampled Gaussian mechanism (σ, q) composed over the planned steps."""

    num_examples: int
    expected_batch_size: int
    sample_rate: float
    steps_per_epoch: int
    planned_steps: int
    delta: float
    noise_multiplier: float
    clip_norm: float
    accountant: str
    private: bool
    unit: str = "example"  # what one of the N protected units is (UNITS)
    max_examples_per_unit: int | None = None  # user-level: examples of a sampled user per step, at most
    noise_mechanism: str = "independent"  # hf_dp.mechanism.NOISE_MECHANISMS
    strategy: BandedToeplitz = INDEPENDENT  # the noise's correlation across steps (b = 1: none)

    @property
    def bands(self) -> int:
        """b: the strategy's bands, and the groups of cyclic Poisson sampling (1: plain Poisson sampling)."""
        return self.strategy.bands

    @property
    def mean_noise_std(self) -> float:
        """σC/B̄ · ‖x‖: the per-coordinate noise std of the privatised mean gradient ĝ, where ‖x‖ is the
        correlated noise's marginal std over the planned steps in units of σC (1 for independent noise)."""
        return self.noise_multiplier * self.clip_norm * self.strategy.marginal_std / self.expected_batch_size

    def ledger_steps(self, steps: int) -> int:
        """The DP-SGD steps at rate q that ``steps`` released steps are accounted as: an example of a cyclic
        Poisson group takes part in at most ⌈t/b⌉ of the first t steps (Choquette-Choo et al. 2023, Thm 4)."""
        return -(-steps // self.bands)


# The privacy units a guarantee can be stated in: (singular, plural) as the model card and the logs say them.
UNITS = {
    "example": ("example", "training examples"),
    "pair": ("preference pair (its chosen and rejected completions together)", "preference pairs"),
    "user": ("user (all of one user's examples together)", "users"),
    "block": (
        "block of tokens cut from concatenated text (a record may span blocks, and a block hold several records)",
        "blocks",
    ),
}


def require_map_style(dataset) -> None:
    """Poisson sampling draws each of the N examples independently: it needs random access and a length."""
    if isinstance(dataset, dict):  # a DatasetDict: its length is its number of splits
        raise ValueError(
            f"train_dataset is a {type(dataset).__name__} of splits {list(dataset)}, not one dataset: pass the "
            "split to train on (e.g. dataset['train'])"
        )
    if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            f"DPTrainer needs a map-style train_dataset (random access and a length), not {type(dataset).__name__}: "
            "Poisson sampling draws each of the N examples independently; convert a streaming or iterable dataset "
            "with datasets' to_list/from_list"
        )


def plan_privacy(args, dataset, unit: str = "example", num_units: int | None = None) -> PrivacyPlan:
    """The plan for ``DPTrainingArguments`` ``args`` over ``dataset``; one-line ValueError if it cannot hold.
    N counts ``unit``s: the dataset's rows, or ``num_units`` when several rows form one unit (users)."""
    require_map_style(dataset)
    if not args.has_privacy_budget:
        raise ValueError(
            "DPTrainer: to train, give one of target_epsilon (σ is then calibrated) and noise_multiplier in "
            "DPTrainingArguments, or disable_dp=True for a non-private baseline"
        )
    num_examples = len(dataset) if num_units is None else num_units
    if num_examples == 0:
        raise ValueError(
            "train_dataset is empty (or every row was dropped in preprocessing: TRL drops the rows max_length leaves "
            "without a trained token): give it rows to train on"
        )
    expected_batch_size = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    )
    if expected_batch_size > num_examples:
        raise ValueError(
            f"the logical batch ({expected_batch_size} = per-device batch x accumulation x processes) exceeds the "
            f"{num_examples} {UNITS[unit][1]}: lower per_device_train_batch_size or gradient_accumulation_steps"
        )
    steps_per_epoch = math.ceil(num_examples / expected_batch_size)
    planned_steps = (
        args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    )
    delta = args.target_delta or default_delta(num_examples)
    if not args.disable_dp and delta >= 1 / num_examples and not args.allow_large_delta:
        raise ValueError(
            f"target_delta={delta:g} is not below 1/N = {1 / num_examples:g} for N = {num_examples} {UNITS[unit][1]}: such a "
            "guarantee allows publishing an example outright; lower target_delta (default N^-1.1) or set "
            "allow_large_delta=True, which the model card reports"
        )
    bands = _bands(
        args, planned_steps, num_examples // expected_batch_size, delta, expected_batch_size / num_examples
    )
    sample_rate = expected_batch_size * bands / num_examples
    if args.disable_dp:
        noise_multiplier = 0.0
    elif args.noise_multiplier is not None:
        noise_multiplier = float(args.noise_multiplier)
    else:
        noise_multiplier = calibrate_noise_multiplier(
            args.target_epsilon, delta, sample_rate, -(-planned_steps // bands), args.accountant
        )
    if noise_multiplier > MAX_NOISE_MULTIPLIER:
        raise ValueError(
            f"noise_multiplier σ = {noise_multiplier:.3g} > {MAX_NOISE_MULTIPLIER:g}: the noise would drown every update; "
            "raise target_epsilon, train fewer steps or use a larger batch"
        )
    strategy = INDEPENDENT if bands == 1 else banded_strategy(planned_steps, bands)
    mechanism = args.noise_mechanism if not args.disable_dp else "independent"
    logger.info(
        f"hf_dp: the guarantee is per {unit}: N={num_examples} {UNITS[unit][1]}, expected batch {expected_batch_size}, "
        f"{planned_steps} planned steps, sigma={noise_multiplier:.4g}, delta={delta:.3g}; "
        f"{describe_mechanism(mechanism, strategy, sample_rate, planned_steps)}"
    )
    return PrivacyPlan(
        num_examples=num_examples,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
        steps_per_epoch=steps_per_epoch,
        planned_steps=planned_steps,
        delta=delta,
        noise_multiplier=noise_multiplier,
        clip_norm=args.per_sample_max_grad_norm,
        accountant=args.accountant,
        private=not args.disable_dp,
        unit=unit,
        max_examples_per_unit=args.max_examples_per_unit if unit == "user" else None,
        noise_mechanism=mechanism,
        strategy=strategy,
    )


def _bands(args, planned_steps: int, max_bands: int, delta: float, rate: float) -> int:
    """b for the run: 1 for independent noise, the user's, or (``"auto"``) the b of least expected error at the σ
    calibrated for ⌈n/b⌉ steps at rate b·q. Refused in one line when b > n or b > N/B̄ (the rate b·q would pass 1)."""
    if args.noise_mechanism != "bandmf" or args.disable_dp:
        return 1
    if args.num_bands == "auto":
        return choose_bands(
            planned_steps,
            max_bands,
            lambda b: calibrate_noise_multiplier(
                args.target_epsilon, delta, b * rate, -(-planned_steps // b), args.accountant
            ),
        )
    bands = int(args.num_bands)
    if bands > planned_steps:
        raise ValueError(
            f"num_bands={bands} exceeds the {planned_steps} planned steps: lower num_bands or train longer"
        )
    if bands > max_bands:
        raise ValueError(
            f"num_bands={bands} exceeds N/B̄ = {max_bands}: each of the b groups of cyclic Poisson sampling must "
            "hold an expected batch; lower num_bands or the batch size"
        )
    return bands


def describe_mechanism(
    mechanism: str, strategy: BandedToeplitz, sample_rate: float, planned_steps: int
) -> str:
    """One line: the noise, the sampling and the accounting, as the logs and the model card state them."""
    if mechanism == "independent":
        return f"independent Gaussian noise, accounted as DP-SGD at q={sample_rate:.4g}"
    b = strategy.bands
    return (
        f"{mechanism} noise with {b} bands, cyclic Poisson sampling over {b} groups at p={sample_rate:.4g}, "
        f"accounted as DP-SGD with ceil(n/{b}) = {-(-planned_steps // b)} steps at p (amplified BandMF, "
        "Choquette-Choo et al. 2023)"
    )


def epsilon_spent(plan: PrivacyPlan, accountant) -> float:
    """ε spent so far at the plan's δ (inf for a run without noise)."""
    if not plan.private or plan.noise_multiplier == 0:
        return math.inf
    return accountant.get_epsilon()


def privacy_report(
    plan: PrivacyPlan, accountant, args, steps: int, randomness: str, update_rule: tuple[str, dict[str, Any]]
) -> dict[str, Any]:
    """The guarantee of a run as plain values: what model cards, logs and results state (hf_dp.hub).
    ``update_rule``: the name and kwargs of the rule fed the privatised gradient."""
    return {
        "epsilon": epsilon_spent(plan, accountant),
        "delta": plan.delta,
        "target_epsilon": args.target_epsilon,
        "accountant": args.accountant,
        "noise_multiplier": plan.noise_multiplier,
        "noise_phases": [
            [sigma, steps] for sigma, _, steps in accountant.history
        ],  # σ changed on a resume: several
        "max_grad_norm": plan.clip_norm,
        "sample_rate": plan.sample_rate,
        "sampling": sampling_name(args, plan.bands),
        "unit": plan.unit,
        "max_examples_per_unit": plan.max_examples_per_unit,
        "noise_mechanism": plan.noise_mechanism,
        "num_bands": plan.bands,
        "strategy_coefs": list(plan.strategy.coefs),
        "accounting": describe_mechanism(
            plan.noise_mechanism, plan.strategy, plan.sample_rate, plan.planned_steps
        ),
        "expected_batch_size": plan.expected_batch_size,
        "num_train_examples": plan.num_examples,
        "steps": steps,
        "optimizer": update_rule[0],
        "optimizer_kwargs": dict(update_rule[1]),
        "clipping_mode": args.clipping_mode,
        "clipping_fn": args.clipping_fn,
        "clipping_groups": "flat: one norm per example"
        if args.clipping_groups == "all"
        else args.clipping_groups,
        "noise_randomness": randomness,
        "allow_large_delta": args.allow_large_delta,
        "disable_dp": args.disable_dp,
    }


def privacy_metrics(report: dict[str, Any]) -> dict[str, float | int | str]:
    """The guarantee as training metrics (``train_results.json``, ``all_results.json``)."""
    return {
        **{key: report[key] for key in ("epsilon", "delta", "noise_multiplier")},
        "privacy_unit": report["unit"],
        "dp_steps": report["steps"],
        "noise_mechanism": report["noise_mechanism"],
        "num_bands": report["num_bands"],
    }


def sampling_name(args, bands: int = 1) -> str:
    if not args.poisson_sampling:
        return "shuffled fixed-size batches"
    return "poisson" if bands == 1 else f"cyclic poisson over {bands} groups"


def plan_record(plan: PrivacyPlan, args) -> dict[str, Any]:
    """What a checkpoint's ledger was spent under, as JSON values (hf_dp.checkpoint compares them on resume)."""
    return {
        "num_examples": plan.num_examples,
        "expected_batch_size": plan.expected_batch_size,
        "sample_rate": plan.sample_rate,
        "noise_multiplier": plan.noise_multiplier,
        "clip_norm": plan.clip_norm,
        "delta": plan.delta,
        "sampling": sampling_name(args, plan.bands),
        "unit": plan.unit,
        "privacy_unit_column": args.privacy_unit_column,
        "accountant": args.accountant,
        "private": plan.private,
        "secure_mode": args.secure_mode,
        "dp_optimizer": args.dp_optimizer,
        "save_only_model": args.save_only_model,
        "noise_mechanism": plan.noise_mechanism,
        "strategy_coefs": list(plan.strategy.coefs),
    }
