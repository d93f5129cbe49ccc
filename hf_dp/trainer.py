"""DPTrainer: the Hugging Face Trainer with exact per-example clipping, Poisson sampling and accounting.

Orchestration only: sampling, clipping, noise and accounting live in their own modules. A DP step
(DESIGN.md §2): Poisson logical batch → micro-batches → per-example losses → clipped sum into
``.grad`` (book-keeping, one backward) → at ``optimizer.step()`` noise N(0, σ²C²) once and division
by the expected batch size → update → accountant.step(σ, q) → ε in every log line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_dp.accounting import PrivacyAccountant, calibrate_noise_multiplier
from hf_dp.arguments import DPTrainingArguments, default_delta
from hf_dp.clipping.engine import ClippingEngine, clip_factors
from hf_dp.cpu_heap import keep_freed_memory
from hf_dp.distributed import check_deepspeed_config, sum_across_processes, zero_stage
from hf_dp.hub import add_privacy_to_model_card
from hf_dp.losses import per_example_loss
from hf_dp.noise import GaussianNoise
from hf_dp.optim.base import GradientPrivatizer
from hf_dp.optim.factory import make_dp_optimizer
from hf_dp.optim.plan import Shift, StepPlan, plan_for
from hf_dp.sampling import PoissonBatchSampler, ShuffledBatchSampler

logger = logging.getLogger(__name__)

EXAMPLE_MASK_KEY = "hf_dp_example_mask"
PRIVACY_STATE_FILE = "hf_dp_privacy_state.json"
_NOISE_SEED_OFFSET = 0x5EED
# these optimizers need the engine's book-keeping (scaled geometry, two evaluations), not DeepSpeed's backward
_NEEDS_BOOKKEEPING = ("stp", "dp2", "disk")


def _noise_state_file(process_index: int) -> str:
    return f"hf_dp_noise_state_process{process_index}.pt"


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    """Replay the same dropout masks in another pass over the same examples."""
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


class _ParameterShifter:
    """Parameters at θ + shift inside ``with shifter(shift):``, by pointing each ``p.data`` at a buffer holding
    θ + shift and back at θ's own tensor after (θ is never written, so it comes back EXACTLY: θ + δ − δ ≠ θ in
    floating point). The buffers live for the trainer's lifetime (one copy of the shifted parameters) and are
    filled once per plan, i.e. once per logical batch, however many micro-batches it has: one pass over θ and
    d, where copy-in, add and copy-back cost three."""

    def __init__(self) -> None:
        self._buffers: dict[nn.Parameter, torch.Tensor] = {}
        self._filled_for: tuple[Shift, list[int]] | None = None

    @contextlib.contextmanager
    def __call__(self, shift: Shift | None) -> Iterator[None]:
        if not shift:
            yield
            return
        params = list(shift.directions)
        buffers = [self._buffers.setdefault(p, torch.empty_like(p, requires_grad=False)) for p in params]
        # refilled for a new plan (a new logical batch) or when θ was written in place since (its version)
        key = (shift, [p._version for p in params])
        if self._filled_for is None or self._filled_for[0] is not shift or self._filled_for[1] != key[1]:
            with torch.no_grad():
                for param, buffer in zip(params, buffers, strict=True):
                    torch.add(param, shift.directions[param], alpha=shift.scale, out=buffer)
            self._filled_for = key
        originals = [p.data for p in params]
        for param, buffer in zip(params, buffers, strict=True):
            param.data = buffer
        try:
            yield
        finally:
            for param, original in zip(params, originals, strict=True):
                param.data = original


class _EpochDataLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches our batch sampler (the Trainer calls it each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class _MaskingCollator:
    """Collates a micro-batch and adds a (B,) mask of real examples; an empty micro-batch becomes one
    placeholder example with mask 0, so every step can run the same code path."""

    def __init__(self, collator, dataset) -> None:
        self.collator = collator
        self.dataset = dataset

    def __call__(self, examples: list) -> dict[str, Any]:
        real = len(examples)
        batch = dict(self.collator(examples if real else [self.dataset[0]]))
        batch[EXAMPLE_MASK_KEY] = torch.ones(real) if real else torch.zeros(1)
        return batch


class _PrivacyCallback(TrainerCallback):
    """Records every optimizer step with the accountant and stops before the budget would be exceeded.

    σ and q are fixed within a run, so the number of steps the budget allows is found once, by
    bisection at train start, instead of asking the accountant after every step.
    """

    def __init__(self, trainer: DPTrainerMixin) -> None:
        self.trainer = trainer
        self.allowed_steps: int | None = None

    def _fits(self, extra_steps: int) -> bool:
        trainer = self.trainer
        spent = trainer.accountant.epsilon_after(trainer.noise_multiplier, trainer.sample_rate, extra_steps)
        return spent <= trainer.args.target_epsilon

    def on_train_begin(self, args, state, control, **kwargs):
        trainer, target = self.trainer, self.trainer.args.target_epsilon
        self.allowed_steps = None
        remaining = state.max_steps - state.global_step
        if trainer.args.disable_dp or target is None or remaining <= 0 or self._fits(remaining):
            return control
        low, high = 0, remaining  # invariant: low steps fit, high steps do not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self._fits(middle) else (low, middle)
        if low == 0:
            spent = trainer.accountant.epsilon_after(trainer.noise_multiplier, trainer.sample_rate)
            raise ValueError(
                f"hf_dp: the privacy budget is spent: after {trainer.accountant.steps} steps one more would reach "
                f"epsilon {spent:.4g} > target_epsilon {target:g}; raise target_epsilon or train fewer steps"
            )
        self.allowed_steps = trainer.accountant.steps + low
        return control

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer.args.disable_dp:
            return control
        trainer.accountant.step(trainer.noise_multiplier, trainer.sample_rate)
        if self.allowed_steps is not None and trainer.accountant.steps >= self.allowed_steps:
            next_epsilon = trainer.accountant.epsilon_after(trainer.noise_multiplier, trainer.sample_rate)
            logger.warning(
                f"hf_dp: stopping at step {state.global_step}: one more step would spend epsilon "
                f"{next_epsilon:.4g} > target_epsilon {trainer.args.target_epsilon:g} "
                f"(spent so far {trainer.get_epsilon():.4g})"
            )
            control.should_training_stop = True
        return control


class DPTrainerMixin:
    """Makes a ``transformers.Trainer`` (sub)class differentially private; see ``DPTrainer``."""

    args: DPTrainingArguments

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DPTrainingArguments):
            raise TypeError("DPTrainer needs DPTrainingArguments (from hf_dp), not TrainingArguments")
        self._zero_stage = self._check_deepspeed() if self.is_deepspeed_enabled else None
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            raise ValueError(
                "DPTrainer needs a train_dataset with a length: Poisson sampling draws from N examples"
            )
        self.num_train_examples = len(self.train_dataset)
        self.expected_batch_size = (
            self.args.per_device_train_batch_size
            * self.args.gradient_accumulation_steps
            * self.args.world_size
        )
        if self.expected_batch_size > self.num_train_examples:
            raise ValueError(
                f"the logical batch ({self.expected_batch_size} = per-device batch x accumulation x processes) "
                f"exceeds the {self.num_train_examples} training examples: lower per_device_train_batch_size or "
                "gradient_accumulation_steps"
            )
        self.sample_rate = self.expected_batch_size / self.num_train_examples
        self.steps_per_epoch = math.ceil(self.num_train_examples / self.expected_batch_size)
        self.planned_steps = (
            self.args.max_steps
            if self.args.max_steps > 0
            else math.ceil(self.args.num_train_epochs * self.steps_per_epoch)
        )
        self.target_delta = self.args.target_delta or default_delta(self.num_train_examples)
        self.noise_multiplier = self._resolve_noise_multiplier()
        self.accountant = PrivacyAccountant(self.args.accountant, self.target_delta)
        self.clipping_engine = None
        if not self.args.disable_dp:
            self.clipping_engine = ClippingEngine(
                self.model,
                self.args.per_sample_max_grad_norm,
                clipping_fn=self.args.clipping_fn,
                mode=self.args.clipping_mode,
            )
        self._verified_engine = False
        self._shifted = _ParameterShifter()
        self._uses_custom_compute_loss = type(self).compute_loss is not Trainer.compute_loss
        # replicated gradients (one process, DDP, ZeRO-0) get the same noise on every process after the sum;
        # partitioned ones (ZeRO-1/2/3) independent noise per process on the partition it owns
        partitioned = bool(self._zero_stage)
        noise_seed = self.args.seed + _NOISE_SEED_OFFSET + (self.args.process_index if partitioned else 0)
        self.privatizer = GradientPrivatizer(
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=0.0 if self.args.disable_dp else self.args.per_sample_max_grad_norm,
            expected_batch_size=self.expected_batch_size,
            noise=GaussianNoise(seed=noise_seed, secure_mode=self.args.secure_mode),
            sum_across_processes=(
                sum_across_processes if self.args.world_size > 1 and not self.is_deepspeed_enabled else None
            ),
        )
        self._planned_at_step: int | None = None
        self._dp_optimizer: torch.optim.Optimizer | None = None
        self.add_callback(_PrivacyCallback(self))
        logger.info(
            f"hf_dp: N={self.num_train_examples}, expected batch {self.expected_batch_size}, q={self.sample_rate:.4g}, "
            f"{self.planned_steps} planned steps, sigma={self.noise_multiplier:.4g}, delta={self.target_delta:.3g}"
        )

    def _check_deepspeed(self) -> int:
        """Validate the DeepSpeed config for DP (DEEPSPEED.md) and return its ZeRO stage."""
        config = self.accelerator.state.deepspeed_plugin.deepspeed_config
        check_deepspeed_config(config)
        if self.args.dp_optimizer in _NEEDS_BOOKKEEPING:
            raise ValueError(
                f"dp_optimizer={self.args.dp_optimizer!r} (scaled clipping or two evaluations per step) is not "
                "supported under DeepSpeed yet; use DDP (accelerate launch without DeepSpeed) or another dp_optimizer"
            )
        # our optimizer is a torch one, which DeepSpeed calls "untested"; it only wraps it
        config.setdefault("zero_allow_untested_optimizer", True)
        return zero_stage(config)

    def _resolve_noise_multiplier(self) -> float:
        if self.args.disable_dp:
            return 0.0
        if self.args.noise_multiplier is not None:
            return float(self.args.noise_multiplier)
        return calibrate_noise_multiplier(
            self.args.target_epsilon,
            self.target_delta,
            self.sample_rate,
            self.planned_steps,
            self.args.accountant,
        )

    # ---- privacy state ----------------------------------------------------------------------------

    def get_epsilon(self) -> float:
        """ε spent so far at ``self.target_delta`` (inf for a run without noise)."""
        if self.args.disable_dp or self.noise_multiplier == 0:
            return math.inf
        return self.accountant.get_epsilon()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        logs = {**logs, "epsilon": self.get_epsilon()}
        super().log(logs, *args, **kwargs)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float | None:
        """The Trainer would log the norm of the clipped sum BEFORE noise, an unprivatised statistic: log none.

        Without DP, report the norm of the mean gradient (``.grad`` holds the sum until the optimizer step).
        """
        if self.args.disable_dp:
            norm = super()._get_grad_norm(model, grad_norm=grad_norm)
            return None if norm is None else norm / self.expected_batch_size
        return None

    def privacy_report(self) -> dict[str, Any]:
        """The guarantee of this run as plain values: what model cards and logs state (hf_dp.hub)."""
        return {
            "epsilon": self.get_epsilon(),
            "delta": self.target_delta,
            "target_epsilon": self.args.target_epsilon,
            "accountant": self.args.accountant,
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self.args.per_sample_max_grad_norm,
            "sample_rate": self.sample_rate,
            "sampling": "poisson" if self.args.poisson_sampling else "shuffled fixed-size batches",
            "expected_batch_size": self.expected_batch_size,
            "num_train_examples": self.num_train_examples,
            "steps": self.state.global_step if self.args.disable_dp else self.accountant.steps,
            "optimizer": self.args.dp_optimizer,
            "optimizer_kwargs": dict(self.args.dp_optimizer_kwargs),
            "clipping_mode": self.args.clipping_mode,
            "clipping_fn": self.args.clipping_fn,
            "disable_dp": self.args.disable_dp,
        }

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's card plus the privacy guarantee as YAML metadata and prose (hf_dp.hub)."""
        super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            dataset = kwargs.get("dataset") or kwargs.get("dataset_tags") or kwargs.get("dataset_args")
            add_privacy_to_model_card(
                os.path.join(self.args.output_dir, "README.md"), self.privacy_report(), dataset
            )

    def privacy_state(self) -> dict[str, Any]:
        return {
            "accountant": self.accountant.state_dict(),
            "sampler": self._batch_sampler.state_dict() if hasattr(self, "_batch_sampler") else None,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "target_delta": self.target_delta,
        }

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint, the privacy state, and each process's noise generator state."""
        super()._save_checkpoint(model, trial)
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        os.makedirs(folder, exist_ok=True)
        torch.save(
            self.privatizer.state_dict(), os.path.join(folder, _noise_state_file(self.args.process_index))
        )
        if self.args.should_save:
            with open(os.path.join(folder, PRIVACY_STATE_FILE), "w") as f:
                json.dump(self.privacy_state(), f)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, PRIVACY_STATE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: this checkpoint has no privacy state to resume from")
        with open(path) as f:
            state = json.load(f)
        noise_path = os.path.join(checkpoint, _noise_state_file(self.args.process_index))
        if not os.path.isfile(noise_path):
            raise FileNotFoundError(
                f"{noise_path} is missing: resume with the same number of processes the checkpoint was written with"
            )
        self.privatizer.load_state_dict(torch.load(noise_path, weights_only=False))
        self.accountant.load_state_dict(state["accountant"])
        if not math.isclose(state["noise_multiplier"], self.noise_multiplier, rel_tol=1e-9):
            logger.warning(
                f"hf_dp: the checkpoint trained with sigma={state['noise_multiplier']:.4g}, this run uses "
                f"sigma={self.noise_multiplier:.4g}; the accountant composes both"
            )
        if state["sampler"] is not None and hasattr(self, "_batch_sampler"):
            self._batch_sampler.load_state_dict(state["sampler"])

    # ---- data ---------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """Poisson (or, on request, shuffled fixed-size) logical batches, split into micro-batches.

        Not passed through ``accelerator.prepare``: the sampler itself splits each logical batch across ranks.
        """
        dataset, collator = self.train_dataset, self.data_collator
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        common = {
            "num_samples": self.num_train_examples,
            "steps_per_epoch": self.steps_per_epoch,
            "num_micro_batches": self.args.gradient_accumulation_steps,
            "seed": self.args.seed,
            "secure_mode": self.args.secure_mode,
            "num_replicas": self.args.world_size,
            "rank": self.args.process_index,
        }
        if self.args.poisson_sampling:
            self._batch_sampler = PoissonBatchSampler(sample_rate=self.sample_rate, **common)
        else:
            self._batch_sampler = ShuffledBatchSampler(batch_size=self.expected_batch_size, **common)
        return _EpochDataLoader(
            dataset,
            batch_sampler=self._batch_sampler,
            collate_fn=_MaskingCollator(collator, dataset),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    # ---- optimizer ----------------------------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The ``dp_optimizer`` rule (or the user's optimizer), with the privatising step attached."""
        if self.optimizer is None:
            model = model if model is not None else self.model
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
            kwargs = {"lr": self.args.learning_rate, **self.args.dp_optimizer_kwargs}
            noise_std = self.privatizer.noise_std / self.expected_batch_size
            self.optimizer = make_dp_optimizer(self.args.dp_optimizer, groups, noise_std=noise_std, **kwargs)
        self.privatizer.attach(self.optimizer)
        if self._dp_optimizer is None:
            self._dp_optimizer = self.optimizer  # before accelerate/DeepSpeed wrap it
        return self.optimizer

    # ---- the DP micro-step --------------------------------------------------------------------------

    def compute_per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """L_i for each example of the micro-batch, shape (B,). Override this (not compute_loss) to change the loss.

        A subclass that overrides ``compute_loss`` instead must return this same (B,) vector from it.
        """
        if self._uses_custom_compute_loss:
            return self.compute_loss(model, inputs)
        return per_example_loss(model, inputs)

    def _require_per_example(self, losses: Any, batch_size: int) -> None:
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or losses.shape[0] != batch_size:
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            source = "compute_loss" if self._uses_custom_compute_loss else "compute_per_example_loss"
            raise ValueError(
                f"{type(self).__name__}.{source} returned {shape}; under DP it must return one loss per example, "
                f"shape ({batch_size},), or override compute_per_example_loss instead"
            )

    def _plan(self) -> StepPlan:
        """The optimizer's plan for the current logical batch, made at its first micro-batch and then held."""
        if self._planned_at_step != self.state.global_step or self.privatizer.plan is None:
            plan = plan_for(self._dp_optimizer, self.privatizer.max_grad_norm)
            if self.is_deepspeed_enabled and (
                plan.clip_scale or len(plan.evaluations) > 1 or plan.evaluations[0].shift
            ):
                raise ValueError(
                    "scaled clipping and shifted evaluations are not supported under DeepSpeed yet"
                )
            self.privatizer.plan, self._planned_at_step = plan, self.state.global_step
        return self.privatizer.plan

    def _losses(self, model: nn.Module, inputs: dict[str, Any], batch_size: int) -> torch.Tensor:
        with self.compute_loss_context_manager():
            losses = self.compute_per_example_loss(model, inputs)
        self._require_per_example(losses, batch_size)
        return losses

    def _bookkeeping_backward(
        self, inputs: dict[str, Any], mask: torch.Tensor, plan: StepPlan
    ) -> torch.Tensor:
        """Σ_i c_i u_i into ``.grad`` with u_i = Σ_e w_e ∇L_i(θ + shift_e): every evaluation replays the same
        dropout randomness, runs on the bare module (no DDP hooks: the privatiser sums across processes)."""
        engine, module, batch_size = self.clipping_engine, self.model, mask.shape[0]
        verify = not self._verified_engine
        if len(plan.evaluations) == 1 and plan.evaluations[0].shift is None:
            with engine.record(batch_size):
                losses = self._losses(module, inputs, batch_size)
            engine.clipped_backward(
                losses, mask, verify=verify, clip_norm=plan.clip_norm, clip_scale=plan.clip_scale
            )
            self._verified_engine = True
            return losses
        if len(plan.evaluations) > 1 and self.args.device.type == "cpu":
            keep_freed_memory()  # two evaluations' buffers are reused, not re-mapped every step (cpu_heap.py)
        rng = _rng_state()
        evaluated = []
        for k, evaluation in enumerate(plan.evaluations):
            if k:
                _set_rng_state(rng)
            with self._shifted(evaluation.shift), engine.record(batch_size):
                losses = self._losses(module, inputs, batch_size)
                evaluated.append((engine.per_example_gradients(losses, verify=verify), evaluation.weight))
        engine.clip_and_accumulate(evaluated, mask, clip_norm=plan.clip_norm, clip_scale=plan.clip_scale)
        self._verified_engine = True
        return losses

    def _deepspeed_backward(
        self, model: nn.Module, inputs: dict[str, Any], mask: torch.Tensor
    ) -> torch.Tensor:
        """DEEPSPEED.md's exact scheme: norms from a pass on the bare module (no ``.grad`` touched), then
        ``engine.backward(W · Σ_i c_i L_i)`` through DeepSpeed, which averages over the W processes, so the
        client optimizer receives this rank's partition of Σ_i c_i g_i. Both passes see the same dropout."""
        batch_size = mask.shape[0]
        factors = mask
        rng = _rng_state()
        if self.clipping_engine is not None:
            with self.clipping_engine.record(batch_size):
                losses = self._losses(self.model, inputs, batch_size)
            norms = self.clipping_engine.clipped_backward(losses, accumulate=False)
            factors = clip_factors(norms, self.privatizer.max_grad_norm, self.args.clipping_fn) * mask
            _set_rng_state(rng)
        losses = self._losses(model, inputs, batch_size)
        weighted = (factors.detach().to(losses.dtype) * losses).sum() * self.args.world_size
        self.accelerator.backward(weighted, scale_wrt_gas=False)
        return losses

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Adds Σ_i c_i ∇L_i of this micro-batch to ``.grad``; returns Σ_i L_i / B̄ for logging.

        ``num_items_in_batch`` is ignored: normalising by the tokens of the whole logical batch would
        mix examples; the only normalisation is by the expected batch size, in the privatiser. The
        value returned is scaled by the number of processes, because the Trainer logs their mean.
        """
        model.train()
        self.model.train()
        inputs = self._prepare_inputs(inputs)
        mask = inputs[EXAMPLE_MASK_KEY].to(self.args.device)
        model_inputs = {k: v for k, v in inputs.items() if k != EXAMPLE_MASK_KEY}
        plan = self._plan() if self.clipping_engine is not None else None
        if self.is_deepspeed_enabled:
            # every process runs every pass, even with no real example: ZeRO's collectives must match
            losses = self._deepspeed_backward(model, model_inputs, mask)
        elif not mask.any():
            return torch.zeros((), device=self.args.device)
        elif self.clipping_engine is None:
            losses = self._losses(self.model, model_inputs, mask.shape[0])
            (losses * mask).sum().backward()
        else:
            losses = self._bookkeeping_backward(model_inputs, mask, plan)
        return (losses.detach() * mask).sum() * self.args.world_size / self.expected_batch_size


class DPTrainer(DPTrainerMixin, Trainer):
    """``transformers.Trainer`` with differential privacy (DP-SGD family), configured by ``DPTrainingArguments``."""
