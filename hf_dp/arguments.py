"""DPTrainingArguments: the Trainer's arguments plus the privacy knobs, validated before training."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field

from transformers import TrainingArguments

from hf_dp.optim.factory import DP_OPTIMIZERS

CLIPPING_MODES = ("ghost", "per_sample")
CLIPPING_FNS = ("abadi", "automatic")
ACCOUNTANTS = ("prv", "rdp")


def default_delta(num_examples: int) -> float:
    """δ = N^-1.1, below 1/N for every N ≥ 2 (the usual "δ ≪ 1/N" advice, e.g. Ponomareva et al. 2023)."""
    return float(num_examples) ** -1.1


@dataclass
class DPTrainingArguments(TrainingArguments):
    """``TrainingArguments`` for differentially private training with ``DPTrainer``.

    Exactly one of ``target_epsilon`` (σ is then calibrated for the planned steps) and
    ``noise_multiplier`` must be given, unless ``disable_dp``. The logical batch is
    per-device batch × gradient accumulation × processes; with Poisson sampling it is the expected size.
    """

    target_epsilon: float | None = field(
        default=None,
        metadata={"help": "Privacy budget ε; σ is calibrated so the planned steps spend at most this."},
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "σ: noise std over clip norm. 0 trains WITHOUT privacy (for testing)."},
    )
    target_delta: float | None = field(
        default=None, metadata={"help": "δ of the (ε, δ) guarantee. Default: N^-1.1 for N training examples."}
    )
    per_sample_max_grad_norm: float = field(
        default=1.0, metadata={"help": "C: per-example gradient clip norm."}
    )
    clipping_mode: str = field(
        default="ghost",
        metadata={
            "help": "'ghost': norms from activations and output gradients (Gram or explicit per layer, "
            "whichever is cheaper), one backward; 'per_sample': materialised per-example gradients."
        },
    )
    clipping_fn: str = field(
        default="abadi",
        metadata={"help": "'abadi': min(1, C/‖g‖); 'automatic': C/(‖g‖ + 0.01) (Bu et al. 2022)."},
    )
    accountant: str = field(
        default="prv", metadata={"help": "'prv' (Gopi et al. 2021) or 'rdp' (Mironov 2017)."}
    )
    poisson_sampling: bool = field(
        default=True,
        metadata={
            "help": "Poisson sampling (what the accountant assumes). False: shuffled fixed-size batches, "
            "accounted AS IF Poisson (the model card says so)."
        },
    )
    dp_optimizer: str = field(default="adamw", metadata={"help": f"One of {sorted(DP_OPTIMIZERS)}."})
    dp_optimizer_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra keyword arguments for the DP optimizer (JSON on the command line)."},
    )
    disable_dp: bool = field(
        default=False,
        metadata={"help": "Same code path with no clipping and no noise: a non-private baseline."},
    )
    secure_mode: bool = field(
        default=False,
        metadata={
            "help": "Draw noise and batches from OS entropy (not reproducible; checkpoints cannot replay them)."
        },
    )
    max_grad_norm: float = field(
        default=0.0,
        metadata={
            "help": "Must stay 0 under DP: it would clip the noisy aggregate. Use per_sample_max_grad_norm."
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.dp_optimizer_kwargs, str):
            self.dp_optimizer_kwargs = json.loads(self.dp_optimizer_kwargs)
        self.dp_optimizer_kwargs = dict(self.dp_optimizer_kwargs or {})
        self._validate_privacy()
        super().__post_init__()
        self._validate_trainer_options()

    def _validate_privacy(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(f"DPTrainingArguments: {message}")

        if self.clipping_mode not in CLIPPING_MODES:
            fail(f"clipping_mode={self.clipping_mode!r} is unknown; use one of {CLIPPING_MODES}")
        if self.clipping_fn not in CLIPPING_FNS:
            fail(f"clipping_fn={self.clipping_fn!r} is unknown; use one of {CLIPPING_FNS}")
        if self.accountant not in ACCOUNTANTS:
            fail(f"accountant={self.accountant!r} is unknown; use one of {ACCOUNTANTS}")
        if self.dp_optimizer not in DP_OPTIMIZERS:
            fail(f"dp_optimizer={self.dp_optimizer!r} is unknown; use one of {sorted(DP_OPTIMIZERS)}")
        if self.max_grad_norm:
            fail(
                f"max_grad_norm={self.max_grad_norm} would clip the noisy aggregate gradient; set it to 0 and use "
                "per_sample_max_grad_norm for the per-example clip norm"
            )
        if self.disable_dp:
            if self.target_epsilon is not None or self.noise_multiplier is not None:
                fail("disable_dp=True trains without privacy; drop target_epsilon and noise_multiplier")
            return
        if not self.per_sample_max_grad_norm > 0:
            fail(f"per_sample_max_grad_norm must be > 0, got {self.per_sample_max_grad_norm}")
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            fail("give exactly one of target_epsilon (σ is then calibrated) and noise_multiplier")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            fail(f"target_epsilon must be > 0, got {self.target_epsilon}")
        if self.noise_multiplier is not None and self.noise_multiplier < 0:
            fail(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if self.target_delta is not None and not 0 < self.target_delta < 1:
            fail(f"target_delta must be in (0, 1), got {self.target_delta}")
        if self.noise_multiplier == 0:
            warnings.warn(
                "noise_multiplier=0: training adds no noise and is NOT differentially private", stacklevel=3
            )
        if not self.poisson_sampling:
            warnings.warn(
                "poisson_sampling=False: fixed-size shuffled batches; epsilon is accounted as if batches were "
                "Poisson-sampled, which they are not",
                stacklevel=3,
            )

    def _validate_trainer_options(self) -> None:
        if self.disable_dp:
            return
        if self.fp16:
            raise ValueError(
                "DPTrainingArguments: fp16 loss scaling is not supported under DP; use bf16 or fp32"
            )
        if self.gradient_checkpointing:
            raise ValueError(
                "DPTrainingArguments: gradient_checkpointing re-runs forwards inside backward, which per-example "
                "clipping does not support yet; turn it off"
            )
