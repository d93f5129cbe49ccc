"""DPTrainingArguments: the Trainer's arguments plus the privacy knobs, validated before training."""

from __future__ import annotations

import inspect
import json
import math
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import get_args

import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainingArguments

from hf_dp import compat
from hf_dp.accounting import AccountantName
from hf_dp.clipping.geometry import CLIPPING_FNS, CLIPPING_MODES, ClippingFn, ClippingMode
from hf_dp.clipping.loss_scale import DEFAULT_FP16_LOSS_SCALE, check_loss_scale
from hf_dp.distributed import check_launched_world, join_process_group
from hf_dp.mechanism import noise_mechanism_of
from hf_dp.optim.registry import dp_optimizer_names, make_dp_optimizer

ACCOUNTANTS = get_args(AccountantName)


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


@dataclass
class DPTrainingArguments(TrainingArguments):
    """``TrainingArguments`` for differentially private training with ``DPTrainer``.

    To train, give exactly one of ``target_epsilon`` (σ is then calibrated for the planned steps) and
    ``noise_multiplier``, unless ``disable_dp``; evaluation-only runs need neither. The logical batch is
    per-device batch × gradient accumulation × processes; with Poisson sampling it is the expected size.
    Every ``TrainingArguments`` field is honoured, mapped or refused here (hf_dp.compat, docs/trainer-arguments.md).
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
    clipping_mode: ClippingMode = field(
        default="ghost",
        metadata={
            "help": "'ghost': norms from activations and output gradients (Gram or explicit per layer, "
            "whichever is cheaper), one backward; 'per_sample': materialised per-example gradients."
        },
    )
    clipping_fn: ClippingFn = field(
        default="abadi",
        metadata={"help": "'abadi': min(1, C/‖g‖); 'automatic': C/(‖g‖ + 0.01) (Bu et al. 2022)."},
    )
    clipping_groups: str = field(
        default="all",
        metadata={
            "help": "Group-wise clipping (He et al. 2022): 'all' (one norm per example), 'layer' (each transformer "
            "block, the embeddings, the head), 'parameter' (each trainable tensor) or comma-separated module-name "
            "prefixes; group g is clipped to C_g = C/sqrt(G) (or clipping_group_norms), so the sensitivity stays C, "
            "in one backward per step. One process, DDP and DeepSpeed ZeRO-0/1/2."
        },
    )
    clipping_group_norms: list[float] | None = field(
        default=None,
        metadata={
            "help": "C_g per group, in the groups' order; sqrt(Σ C_g²) must equal per_sample_max_grad_norm."
        },
    )
    accountant: AccountantName = field(
        default="prv",
        metadata={"help": "'prv' (Gopi et al. 2021) or 'rdp' (Mironov 2017)."},
    )
    poisson_sampling: bool = field(
        default=True,
        metadata={
            "help": "Poisson sampling (what the accountant assumes). False: shuffled fixed-size batches, "
            "accounted AS IF Poisson (the model card says so)."
        },
    )
    dp_optimizer: str | None = field(
        default=None,
        metadata={
            "help": "The DP update rule: a registered name (hf_dp.optim.registry). Default: from `optim` "
            "(adamw_torch → 'adamw', sgd → 'sgd'), so 'adamw' unless you change optim."
        },
    )
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
            "help": "A fresh OS-entropy draw for every noise tensor and every batch (not reproducible; checkpoints "
            "cannot replay them). By default noise and batches come from a secret key drawn from OS entropy per run."
        },
    )
    insecure_dp_seed: int | None = field(
        default=None,
        metadata={
            "help": "INSECURE, for experiments only: derive the noise and the batches from this seed instead of a "
            "secret key. Anyone who knows it can remove the noise; the model card says so."
        },
    )
    allow_large_delta: bool = field(
        default=False,
        metadata={"help": "Accept target_delta >= 1/N (refused by default; the model card reports it)."},
    )
    privacy_unit_column: str | None = field(
        default=None,
        metadata={
            "help": "User-level DP: the train_dataset column naming each row's user (or any group to protect). "
            "Users are Poisson-sampled, at most max_examples_per_unit rows of each per step, and clipped as one."
        },
    )
    max_examples_per_unit: int = field(
        default=4,
        metadata={"help": "k: with privacy_unit_column, the rows of a sampled user taken per step, at most."},
    )
    rows_are_blocks: bool | None = field(
        default=None,
        metadata={
            "help": "The training rows are blocks cut from concatenated text (run_clm's group_texts): the guarantee "
            "is then stated per block, not per example. None: detected (rows of one length, labels = input_ids)."
        },
    )
    dp_fp16_loss_scale: float = field(
        default=DEFAULT_FP16_LOSS_SCALE,
        metadata={
            "help": "With fp16=True: the fixed loss scale S, a power of two. The per-example losses are scaled by S "
            "before each backward and the per-example gradients unscaled before clipping; S never changes, so no "
            "step is skipped and no scale decision depends on the data (docs/clipping.md, Low precision)."
        },
    )
    noise_mechanism: str = field(
        default="independent",
        metadata={
            "help": "'independent': fresh Gaussian noise every step (DP-SGD). 'bandmf': noise correlated across steps "
            "by a banded Toeplitz strategy, with cyclic Poisson sampling (DP-BandMF, Choquette-Choo et al. 2023; "
            "docs/correlated-noise.md)."
        },
    )
    num_bands: str = field(
        default="auto",
        metadata={
            "help": "With noise_mechanism='bandmf': the bands b >= 1 of the strategy (b = 1 is DP-SGD), or 'auto' to "
            "pick b by the expected error at the sigma calibrated for it (needs target_epsilon)."
        },
    )
    bandmf_buffers_on_cpu: bool = field(
        default=False,
        metadata={
            "help": "With noise_mechanism='bandmf': keep the b - 1 noise buffers (b - 1 x trainable parameters x 4 "
            "bytes) in CPU memory instead of the accelerator's."
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
            try:
                self.dp_optimizer_kwargs = json.loads(self.dp_optimizer_kwargs)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"DPTrainingArguments: dp_optimizer_kwargs is not valid JSON ({error.msg} at character "
                    f"{error.pos}): write it as a JSON object, e.g. '{{\"kappa\": 0.5}}'"
                ) from None
        if not isinstance(self.dp_optimizer_kwargs, dict | None):
            raise ValueError(
                f"DPTrainingArguments: dp_optimizer_kwargs must be a dict or a JSON object, got "
                f"{type(self.dp_optimizer_kwargs).__name__}"
            )
        self.dp_optimizer_kwargs = dict(self.dp_optimizer_kwargs or {})
        self._validate_schedule()
        self._validate_privacy()
        super().__post_init__()
        compat.check_fields(self)
        self._resolve_optimizer()

    @cached_property
    def _setup_devices(self) -> torch.device:
        join_process_group(self)  # on CPU, with ddp_timeout
        return TrainingArguments._setup_devices.func(self)

    @property
    def has_privacy_budget(self) -> bool:
        """Whether the arguments say how private training is (one of target_epsilon, noise_multiplier)."""
        return self.disable_dp or self.target_epsilon is not None or self.noise_multiplier is not None

    def _resolve_optimizer(self) -> None:
        """dp_optimizer from HF's ``optim``, HF's ``adam_*`` into its kwargs; the rule is built once on a dummy
        parameter so that a kwarg it does not take is refused here, in one line."""
        self.dp_optimizer = compat.resolve_dp_optimizer(self.dp_optimizer, self.optim)
        if self.dp_optimizer not in dp_optimizer_names():
            raise ValueError(
                f"DPTrainingArguments: dp_optimizer={self.dp_optimizer!r} is unknown; use one of "
                f"{list(dp_optimizer_names())}"
            )
        user_kwargs = self.dp_optimizer_kwargs
        from_adam = compat.adam_kwargs(self)
        self.dp_optimizer_kwargs = {**from_adam, **user_kwargs}
        try:
            self._build_rule_on_dummy(self.dp_optimizer_kwargs)
        except ValueError as error:
            if from_adam and self._builds(user_kwargs):
                raise ValueError(
                    f"DPTrainingArguments: adam_beta1/adam_beta2/adam_epsilon are set, but dp_optimizer="
                    f"{self.dp_optimizer!r} takes no {' or '.join(map(repr, from_adam))}; leave them at their defaults"
                ) from None
            raise ValueError(f"DPTrainingArguments: {error}") from None

    def _build_rule_on_dummy(self, kwargs: dict) -> None:
        dummy = [torch.nn.Parameter(torch.zeros(1))]
        make_dp_optimizer(
            self.dp_optimizer, dummy, mean_noise_std=1.0, **{"lr": self.learning_rate, **kwargs}
        )

    def _builds(self, kwargs: dict) -> bool:
        try:
            self._build_rule_on_dummy(kwargs)
        except ValueError:
            return False
        return True

    def _validate_schedule(self) -> None:
        """Check that the run trains at all: ``learning_rate`` finite (nan or inf turns every weight into nan),
        ``max_steps`` not 0 nor ``num_train_epochs`` 0 (the Trainer would take no step, while σ is planned for
        some), a logical batch of at least one row, and an update rule that trains towards the labels
        (``label_smoothing_factor`` in [0, 1), ``weight_decay`` >= 0, which the DP rules would otherwise take as
        given)."""
        if not math.isfinite(self.learning_rate):
            raise ValueError(
                f"DPTrainingArguments: learning_rate={self.learning_rate} would turn every weight into nan; "
                "set a finite learning_rate"
            )
        if self.max_steps == 0:
            raise ValueError(
                "DPTrainingArguments: max_steps=0 trains no step, while σ would be planned for num_train_epochs; "
                "set max_steps >= 1, or leave it at -1 to train num_train_epochs"
            )
        if self.max_steps < 0 and not self.num_train_epochs > 0:
            raise ValueError(
                f"DPTrainingArguments: num_train_epochs={self.num_train_epochs} trains no step; set num_train_epochs "
                "> 0 or max_steps >= 1"
            )
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"DPTrainingArguments: {name}={getattr(self, name)} makes an empty logical batch; set it >= 1"
                )
        if not 0 <= self.label_smoothing_factor < 1:
            raise ValueError(
                f"DPTrainingArguments: label_smoothing_factor={self.label_smoothing_factor} weights each token's "
                "cross-entropy by 1 - label_smoothing_factor, which must stay in (0, 1]; set it in [0, 1)"
            )
        if self.weight_decay < 0:
            raise ValueError(
                f"DPTrainingArguments: weight_decay={self.weight_decay} would grow the weights at every step; set "
                "it >= 0"
            )

    def _validate_privacy(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(f"DPTrainingArguments: {message}")

        if self.clipping_mode not in CLIPPING_MODES:
            fail(f"clipping_mode={self.clipping_mode!r} is unknown; use one of {CLIPPING_MODES}")
        if self.clipping_fn not in CLIPPING_FNS:
            fail(f"clipping_fn={self.clipping_fn!r} is unknown; use one of {CLIPPING_FNS}")
        if self.accountant not in ACCOUNTANTS:
            fail(f"accountant={self.accountant!r} is unknown; use one of {ACCOUNTANTS}")
        self._validate_noise_mechanism(fail)
        norms = self.clipping_group_norms
        if norms is not None and not (
            isinstance(norms, list | tuple) and all(isinstance(c, int | float) for c in norms)
        ):
            fail(f"clipping_group_norms={norms!r} must be a list of numbers, one C_g per group")
        if self.disable_dp:
            if self.clipping_groups != "all" or norms is not None:
                fail("disable_dp=True clips nothing; drop clipping_groups and clipping_group_norms")
            if self.target_epsilon is not None or self.noise_multiplier is not None:
                fail("disable_dp=True trains without privacy; drop target_epsilon and noise_multiplier")
            if self.noise_mechanism != "independent":
                fail(f"disable_dp=True adds no noise; drop noise_mechanism={self.noise_mechanism!r}")
            return
        if not (self.per_sample_max_grad_norm > 0 and math.isfinite(self.per_sample_max_grad_norm)):
            fail(f"per_sample_max_grad_norm must be > 0 and finite, got {self.per_sample_max_grad_norm}")
        if self.clipping_group_norms is not None and self.clipping_groups == "all":
            fail("clipping_group_norms needs groups: set clipping_groups ('layer', 'parameter' or prefixes)")
        if self.target_epsilon is not None and self.noise_multiplier is not None:
            fail("give exactly one of target_epsilon (σ is then calibrated) and noise_multiplier")
        if self.target_epsilon is not None and not (self.target_epsilon > 0 and _finite(self.target_epsilon)):
            fail(f"target_epsilon must be > 0 and finite, got {self.target_epsilon}")
        if self.noise_multiplier is not None and not (
            self.noise_multiplier >= 0 and _finite(self.noise_multiplier)
        ):
            fail(f"noise_multiplier must be >= 0 and finite, got {self.noise_multiplier}")
        if self.secure_mode and self.insecure_dp_seed is not None:
            fail("secure_mode and insecure_dp_seed contradict each other; drop one")
        if self.insecure_dp_seed is not None:
            warnings.warn(
                f"insecure_dp_seed={self.insecure_dp_seed}: the noise and the batches are a function of this seed; "
                "anyone who knows it can remove the noise from the released model (the model card says so)",
                stacklevel=3,
            )
        check_loss_scale(self.dp_fp16_loss_scale)
        if self.dp_fp16_loss_scale != DEFAULT_FP16_LOSS_SCALE and not self.fp16:
            fail(
                f"dp_fp16_loss_scale={self.dp_fp16_loss_scale:g} scales the loss under fp16 autocast only; set fp16=True "
                "or drop dp_fp16_loss_scale"
            )
        if self.max_examples_per_unit < 1:
            fail(f"max_examples_per_unit must be >= 1, got {self.max_examples_per_unit}")
        if self.privacy_unit_column is None and self.max_examples_per_unit != 4:
            fail(
                f"max_examples_per_unit={self.max_examples_per_unit} caps a user's rows per step, which needs "
                "privacy_unit_column (user-level DP); set privacy_unit_column or drop max_examples_per_unit"
            )
        if self.privacy_unit_column is not None and self.rows_are_blocks:
            fail(
                "privacy_unit_column groups rows into users and rows_are_blocks says rows are blocks; drop one"
            )
        if self.privacy_unit_column is not None and not self.poisson_sampling:
            fail("privacy_unit_column samples users by Poisson sampling; set poisson_sampling=True")
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

    def _validate_noise_mechanism(self, fail) -> None:
        noise_mechanism_of(self.noise_mechanism)
        bands = str(self.num_bands).strip()
        if bands != "auto" and not (bands.isascii() and bands.isdigit() and int(bands) >= 1):
            fail(f"num_bands={self.num_bands!r} must be an integer >= 1 or 'auto'")
        self.num_bands = bands if bands == "auto" else int(bands)
        if self.noise_mechanism != "bandmf" and self.num_bands not in ("auto", 1):
            fail(
                f"num_bands={self.num_bands} sets the bands of noise_mechanism='bandmf'; set it or drop num_bands"
            )
        if self.noise_mechanism != "bandmf" and self.bandmf_buffers_on_cpu:
            fail("bandmf_buffers_on_cpu places noise_mechanism='bandmf''s buffers; set it or drop the flag")
        if self.noise_mechanism != "bandmf":
            return
        if not self.poisson_sampling:
            fail(
                "noise_mechanism='bandmf' is accounted for cyclic Poisson sampling, not fixed-size batches; set "
                "poisson_sampling=True"
            )
        if self.num_bands == "auto" and self.noise_multiplier is not None:
            fail(
                "num_bands='auto' compares bands at equal epsilon, which needs target_epsilon; give target_epsilon "
                "or a number of bands"
            )


def check_trainer_call(trainer_class: type, mixin: type, args: tuple, kwargs: dict) -> None:
    """Refuse, before the Trainer builds anything, a call DP cannot train with. The arguments are named by the
    first ``__init__`` after ``mixin`` (DPTrainerMixin) in the MRO that names them (a subclass may take ``*args``)."""
    _refuse_bare_trl(trainer_class)
    bound = _bind_trainer_call(trainer_class.__mro__, mixin, args, kwargs)
    if bound is None:
        return  # the Trainer's own error says what is wrong
    if not isinstance(bound.get("args"), DPTrainingArguments):
        raise TypeError("DPTrainer needs DPTrainingArguments (from hf_dp), not TrainingArguments")
    if issubclass(trainer_class, Seq2SeqTrainer) and not isinstance(bound["args"], Seq2SeqTrainingArguments):
        raise TypeError(  # else an AttributeError ('generation_config') from inside Seq2SeqTrainer.__init__
            f"{trainer_class.__name__} is a Seq2SeqTrainer, which reads Seq2SeqTrainingArguments' generation fields: "
            "pass the arguments as a @dataclass class Args(DPTrainingArguments, Seq2SeqTrainingArguments)"
        )
    if bound.get("compute_loss_func") is not None:
        raise ValueError(
            "DPTrainer: compute_loss_func computes one loss for the whole batch; override "
            "compute_per_example_loss(model, inputs) to return one loss per example instead"
        )
    check_launched_world(bound["args"])


# TRL trainers hf_dp privatises, and its class for each (their units, losses and config are TRL-specific)
TRL_TRAINERS = {"SFTTrainer": "DPSFTTrainer", "DPOTrainer": "DPDPOTrainer"}


def _refuse_bare_trl(trainer_class: type) -> None:
    """DPTrainerMixin mixed straight into a TRL trainer misses what hf_dp.trl adds (DPO's pair units and per-pair
    losses, SFT's packing units and config): refused, naming the class to use."""
    mro = trainer_class.__mro__
    if any(cls.__module__ == "hf_dp.trl" for cls in mro):
        return
    trl = next((cls for cls in mro if cls.__module__.split(".")[0] == "trl"), None)
    if trl is not None:
        ours = TRL_TRAINERS.get(trl.__name__)
        instead = f"subclass hf_dp.trl.{ours} (with its config)" if ours else "hf_dp.trl supports SFT and DPO"
        raise TypeError(
            f"{trainer_class.__name__} mixes DPTrainerMixin into trl's {trl.__name__} directly, which would clip and "
            f"account the wrong units and losses; {instead}"
        )


def _bind_trainer_call(mro: tuple[type, ...], mixin: type, args: tuple, kwargs: dict) -> dict | None:
    for cls in mro[mro.index(mixin) + 1 :]:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters
        named = parameters.get("args")
        if named is not None and named.kind is not inspect.Parameter.VAR_POSITIONAL:
            try:
                return inspect.signature(init).bind_partial(None, *args, **kwargs).arguments
            except TypeError:
                return None
    return None
