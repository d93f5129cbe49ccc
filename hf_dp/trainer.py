"""DPTrainer: the Hugging Face Trainer with exact per-example clipping, Poisson sampling and accounting.

One DP step, each stage owned by its own module (docs/dp-step.md); this module only wires them to the
Trainer's hooks:

    sample     data.dp_dataloader            Poisson logical batches drawn with the run's secret key
    units      privacy_units                 which rows / tokens form one protected unit (default: a row)
    losses     compute_per_example_loss      L_i, one per unit of each micro-batch
    clip       clipping.pipeline             Σ_i c_i g_i into the gradients (norm pass × sum pass)
    release    mechanism.GaussianMechanism   + N(0, σ²C²) once, ÷ B̄, one accountant step: the only noise
    update     optim (dp_optimizer)          the update rule on ĝ: post-processing
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_dp import checkpoint
from hf_dp.accounting import PrivacyAccountant
from hf_dp.arguments import DPTrainingArguments
from hf_dp.backend import Backend
from hf_dp.budget import PrivacyBudgetCallback
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.evaluate import replay_rng, rng_state
from hf_dp.clipping.pipeline import clipped_step, several_evaluations_refused
from hf_dp.clipping.plan import StepPlanner
from hf_dp.clipping.units import PrivacyUnits
from hf_dp.cpu_heap import keep_freed_memory
from hf_dp.data import (
    dp_dataloader,
    rows_look_like_blocks,
    split_dp_keys,
    split_example_mask,
    units_of_column,
)
from hf_dp.distributed import check_deepspeed, check_fp16, check_fsdp, check_launched_world, shard_on_cpu
from hf_dp.hub import add_privacy_to_model_card
from hf_dp.loss_contract import MicroBatch, per_example_under_dp
from hf_dp.losses import per_example_loss, unwrap_model
from hf_dp.mechanism import GaussianMechanism
from hf_dp.optim.registry import decay_groups, make_dp_optimizer
from hf_dp.privacy import PrivacyPlan, epsilon_spent, plan_privacy, plan_record, privacy_report
from hf_dp.randomness import shared_secret

logger = logging.getLogger(__name__)


class DPTrainerMixin:
    """Makes a ``transformers.Trainer`` (sub)class differentially private; see ``DPTrainer``."""

    args: DPTrainingArguments
    loss_is_scaled_for_ga = True  # the release divides by B̄; nothing divides by the accumulation steps
    privacy_unit = (
        "example"  # what one dataset row is, for the guarantee (privacy.UNITS; DPDPOTrainer: "pair")
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "compute_loss" in cls.__dict__:
            cls.compute_loss = per_example_under_dp(cls.__dict__["compute_loss"])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DPTrainingArguments):
            raise TypeError("DPTrainer needs DPTrainingArguments (from hf_dp), not TrainingArguments")
        if self.compute_loss_func is not None:
            raise ValueError(
                "DPTrainer: compute_loss_func computes one loss for the whole batch; override "
                "compute_per_example_loss(model, inputs) to return one loss per example instead"
            )
        self.privacy_plan: PrivacyPlan | None = None
        self.clipping_engine: ClippingEngine | None = None
        self._mechanism: GaussianMechanism | None = None
        self._dp_optimizer: torch.optim.Optimizer | None = None
        self._micro_batch: MicroBatch | None = None
        self._optimizer_passed_in = self.optimizer  # optimizers=(optimizer, scheduler), or None
        self._drawn_examples = 0  # real examples in the logical batch in progress, over all processes
        self._unit_of_row: list[int] | None = None  # user-level DP: each dataset row's user, 0..N_u-1
        self._records_checked = False  # packed records were checked not to see each other
        self._trained = False
        if self.train_dataset is not None:  # evaluation and prediction need no privacy machinery
            self._prepare_privacy()

    def _prepare_privacy(self) -> None:
        """The plan, the ledger and the run's secret; the clipping strategy this backend needs; the callbacks."""
        check_launched_world(self.args)
        if self._fp16_under_dp:
            check_fp16(self.model, self.is_deepspeed_enabled, self.is_fsdp_enabled)
        unit, num_units = self._unit_of_rows()
        self.privacy_plan = plan_privacy(self.args, self.train_dataset, unit, num_units)
        self.accountant = PrivacyAccountant(self.args.accountant, self.privacy_plan.delta)
        self._privacy_state = checkpoint.RunPrivacyState(
            shared_secret(self.args.insecure_dp_seed),
            self.accountant,
            plan_record(self.privacy_plan, self.args),
        )
        self._zero_stage = None
        if self.is_deepspeed_enabled:
            self._zero_stage = check_deepspeed(
                self.accelerator.state.deepspeed_plugin.deepspeed_config, self.args
            )
        if self.is_fsdp_enabled:
            kwargs = self.args.activation_checkpointing_kwargs or {}
            check_fsdp(
                self.accelerator.state.fsdp_plugin.fsdp_version,
                self.args.dp_optimizer,
                bool(self.args.activation_checkpointing) and bool(kwargs.get("use_reentrant", False)),
            )
        self._planner = StepPlanner(self.privacy_plan.clip_norm)
        self._hook_clipping(self.model)
        self.add_callback(PrivacyBudgetCallback(self))

    def _unit_of_rows(self) -> tuple[str, int | None]:
        """The unit the guarantee is stated in and, for user-level DP, the number of users."""
        column = self.args.privacy_unit_column
        if column is None and self.args.rows_are_blocks is None and rows_look_like_blocks(self.train_dataset):
            logger.warning(
                "hf_dp: every training row has one length, labels equal to input_ids and no padding: blocks cut from "
                "concatenated text (run_clm's group_texts), so the guarantee is stated per block, not per record; "
                "set rows_are_blocks=False if each row is one record"
            )
            return "block", None
        if column is None:
            return ("block" if self.args.rows_are_blocks else self.privacy_unit), None
        if self.privacy_unit != "example":
            raise ValueError(
                f"privacy_unit_column groups rows into users, but a row of {type(self).__name__} is a {self.privacy_unit}; "
                "drop privacy_unit_column"
            )
        names = getattr(self.train_dataset, "column_names", None)
        if names is not None and column not in names:
            raise ValueError(
                f"privacy_unit_column={column!r} is not a column of train_dataset (it has {names})"
            )
        try:
            values = (
                self.train_dataset[column]
                if names is not None
                else [row[column] for row in self.train_dataset]
            )
        except (KeyError, TypeError):
            raise ValueError(
                f"privacy_unit_column={column!r}: the rows of train_dataset have no such key"
            ) from None
        self._unit_of_row, num_units = units_of_column(list(values))
        return "user", num_units

    def _hook_clipping(self, model: nn.Module) -> None:
        if self.clipping_engine is not None:
            self.clipping_engine.remove_hooks()
            self.clipping_engine = None
        if self.privacy_plan.private:
            self.clipping_engine = ClippingEngine(model, self.args.clipping_fn, self.args.clipping_mode)
            weakref.finalize(self, self.clipping_engine.remove_hooks)
        checkpointing = bool(self.args.activation_checkpointing) or getattr(
            unwrap_model(model), "is_activation_checkpointing", False
        )
        backend = Backend(
            self.args.world_size,
            self.args.process_index,
            zero_stage=self._zero_stage,
            fsdp=self.is_fsdp_enabled,
            checkpointing=checkpointing,
            fp16_loss_scale=self.args.dp_fp16_loss_scale if self._fp16_under_dp else None,
            device_type=self.args.device.type,
        )
        self._clipping = clipped_step(self.clipping_engine, model, backend)

    @property
    def _fp16_under_dp(self) -> bool:
        """fp16=True while training privately: our step owns the autocast and the fixed loss scale."""
        # plain TrainingArguments have no disable_dp: DPTrainerMixin refuses them after __init__
        private = not getattr(self.args, "disable_dp", True)
        return bool(self.args.fp16) and private

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        shard_on_cpu(self)  # accelerate would silently run FSDP as DDP on CPU
        if self._fp16_under_dp:
            # accelerate's GradScaler (CUDA) would unscale the clipped sum again and skip the step when it finds an
            # inf: a decision on the unnoised gradient. The DP step scales by the fixed S itself (loss_scale.py).
            self.accelerator.scaler = None

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """``model_init``'s fresh model (``train()`` builds one): the clipping hooks move to it."""
        model = super().call_model_init(trial)
        if getattr(self, "privacy_plan", None) is not None:
            self._hook_clipping(model)
        return model

    def hyperparameter_search(self, *args: Any, **kwargs: Any):
        raise ValueError(
            "DPTrainer.hyperparameter_search trains once per trial on the private data and keeps the best, which "
            "one run's guarantee does not cover (Papernot & Steinke 2022); tune on public data, then train once"
        )

    # the plan's numbers under the names the Trainer's users know
    num_train_examples = property(lambda self: self.privacy_plan.num_examples)
    expected_batch_size = property(lambda self: self.privacy_plan.expected_batch_size)
    sample_rate = property(lambda self: self.privacy_plan.sample_rate)
    steps_per_epoch = property(lambda self: self.privacy_plan.steps_per_epoch)
    planned_steps = property(lambda self: self.privacy_plan.planned_steps)
    target_delta = property(lambda self: self.privacy_plan.delta)

    _secret = property(lambda self: self._privacy_state.secret)

    @property
    def noise_multiplier(self) -> float:
        return self.privacy_plan.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, sigma: float) -> None:
        if self._mechanism is not None:
            raise RuntimeError("set the noise multiplier before training starts")
        self.privacy_plan = dataclasses.replace(self.privacy_plan, noise_multiplier=sigma)
        self._privacy_state.record = plan_record(self.privacy_plan, self.args)

    # ---- training ---------------------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any):
        """The Trainer's ``train``, once per DPTrainer (a second call would redraw the same batches). Its metrics
        (hence ``train_results.json``) carry the guarantee: ε, δ, σ, the privacy unit and the steps."""
        if self.privacy_plan is None:
            raise ValueError(
                "DPTrainer.train needs a train_dataset (evaluate and predict work without one): pass train_dataset"
            )
        if self._trained:
            raise RuntimeError(
                "train() was already called on this DPTrainer and would redraw its batches from the same secret; "
                "continue with a new DPTrainer and resume_from_checkpoint"
            )
        self._trained = True
        logger.info(
            "hf_dp: the logged training loss is the mean per-example loss of each drawn batch, without noise: it "
            "is NOT private (the released model and ε are)"
        )
        try:
            output = super().train(*args, **kwargs)
        finally:
            if self.clipping_engine is not None:
                self.clipping_engine.remove_hooks()
        output.metrics.update(self.privacy_metrics())
        return output

    def privacy_metrics(self) -> dict[str, float | int | str]:
        """The guarantee as metrics (``train_results.json``, ``all_results.json``)."""
        report = self.privacy_report()
        return {
            "epsilon": report["epsilon"],
            "delta": report["delta"],
            "noise_multiplier": report["noise_multiplier"],
            "privacy_unit": report["unit"],
            "dp_steps": report["steps"],
        }

    def get_train_dataloader(self) -> DataLoader:
        dataset, collator = self.train_dataset, self.data_collator
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        loader = dp_dataloader(
            dataset,
            collator,
            plan=self.privacy_plan,
            sampling_key=self._secret.sampling_key,
            args=self.args,
            unit_of_row=self._unit_of_row,
            max_rows_per_unit=self.args.max_examples_per_unit if self._unit_of_row is not None else None,
        )
        self._privacy_state.sampler = self._batch_sampler = loader.batch_sampler
        return loader

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The ``dp_optimizer`` rule (or the user's optimizer), released through the Gaussian mechanism."""
        if self.optimizer is None:
            model = model if model is not None else self.model
            groups = decay_groups(model, self.get_decay_parameter_names(model), self.args.weight_decay)
            if self.optimizer_cls_and_kwargs is not None:
                rule, kwargs = self.optimizer_cls_and_kwargs
                self.optimizer = rule(groups, **{"lr": self.args.learning_rate, **kwargs})
            else:
                kwargs = {"lr": self.args.learning_rate, **self.args.dp_optimizer_kwargs}
                self.optimizer = make_dp_optimizer(
                    self.args.dp_optimizer, groups, mean_noise_std=self.privacy_plan.mean_noise_std, **kwargs
                )
        if self._dp_optimizer is None:
            self._dp_optimizer = self.optimizer  # before accelerate or DeepSpeed wrap it
            self._planner.bind(self.optimizer)
            # nothing but the clipped step may have written .grad (a no-op where the framework owns it)
            self.optimizer.register_step_pre_hook(lambda *_: self._clipping.check_untouched())
            # ZeRO and FSDP: each process noises the partition (shard) it owns
            partitioned = bool(self._zero_stage) or self.is_fsdp_enabled
            backend = Backend(
                self.args.world_size,
                self.args.process_index,
                zero_stage=self._zero_stage,
                fsdp=self.is_fsdp_enabled,
            )
            assert partitioned == backend.partitioned
            self._mechanism = self._privacy_state.mechanism = GaussianMechanism.for_run(
                self.privacy_plan, self.accountant, self._secret, backend, self.args.secure_mode
            )
            released = []

            def release_before_step(opt, args, kwargs):
                plan = self._planner.current
                sums = self._clipping.take_sums()
                self._mechanism.release((p for g in opt.param_groups for p in g["params"]), plan, sums)
                if not released or released[-1] is not plan:
                    self._mechanism.account()
                    released.append(plan)

            self.optimizer.register_step_pre_hook(release_before_step)
            if getattr(self.optimizer, "evaluations_per_step", 1) > 1 and getattr(
                self._clipping, "norms_in_backward", False
            ):
                raise several_evaluations_refused(self._update_rule()[0])
            if getattr(self.optimizer, "evaluations_per_step", 1) > 1 and self.args.device.type == "cpu":
                keep_freed_memory()  # two evaluations' buffers are reused, not re-mapped every step (cpu_heap.py)
        return self.optimizer

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The parent's ``training_step``, whose ``compute_loss`` runs the clipping strategy; returns this
        micro-batch's share of the mean per-example loss of the drawn logical batch (what the Trainer logs).

        ``num_items_in_batch`` is dropped: normalising by the tokens of the whole logical batch would mix
        examples. The value is scaled by the number of processes, because the Trainer logs their mean.
        """
        inputs, mask, unit_of_row = split_dp_keys(inputs)
        units = self.privacy_units(inputs, unit_of_row)
        if units is not None and units.count != mask.shape[0]:
            raise ValueError(
                f"this micro-batch forms {units.count} privacy units but the loader drew {mask.shape[0]} examples "
                "(does the collator pad a packed row with extra position-0 tokens, e.g. pad_to_multiple_of? unset it)"
            )
        micro = self._micro_batch = MicroBatch(
            mask.to(self.args.device), units=None if units is None else units.to(self.args.device)
        )
        try:
            super().training_step(model, inputs, None)
        finally:
            self._micro_batch = None
        if micro.losses is None:
            raise RuntimeError(
                f"{type(self).__name__}.training_step did not reach DPTrainerMixin.compute_loss, so nothing was "
                "clipped: call super().training_step() and super().compute_loss()"
            )
        real = micro.mask.to(micro.losses.dtype)
        return (micro.losses * real).sum() * self.args.world_size / max(self._drawn_examples, 1)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The Trainer fetches a logical batch's micro-batches before the first backward: count its real examples
        over all processes, so that the logged loss is their mean (not private: no noise)."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._count_drawn_examples(batches)
        return batches, None

    def _count_drawn_examples(self, batches: list[dict[str, Any]]) -> None:
        drawn = torch.tensor(
            [float(split_example_mask(batch)[1].sum()) for batch in batches] or [0.0], device=self.args.device
        ).sum()
        if self.args.world_size > 1:
            drawn = self.accelerator.reduce(drawn, reduction="sum")
        self._drawn_examples = int(drawn.item())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """In a DP training step: runs the clipping strategy (or, inside it, the per-example loss). Elsewhere
        (evaluation, prediction) it is the parent's ``compute_loss``."""
        micro = self._micro_batch
        if micro is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if micro.evaluating:
            return self.compute_per_example_loss(model, inputs)
        return self._dp_backward(model, inputs, micro)

    def compute_per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """L_u for each privacy unit of the micro-batch, shape (U,) (or one per row when units are whole rows:
        a unit's loss is then their mean): the extension point for your own loss."""
        micro = self._micro_batch
        return per_example_loss(
            model,
            inputs,
            label_smoothing=self.args.label_smoothing_factor,
            units=None if micro is None else micro.units,
        )

    def privacy_units(self, inputs: dict[str, Any], unit_of_row: torch.Tensor | None) -> PrivacyUnits | None:
        """How a micro-batch's rows and tokens form privacy units; None: one unit per row. Users come from the
        loader (``privacy_unit_column``); records packed into one row by padding-free collation (position ids
        restarting at 0 inside a row, e.g. DataCollatorWithFlattening) are one unit each. Override to group
        otherwise (DPDPOTrainer: a pair's two rows)."""
        if unit_of_row is not None:
            return PrivacyUnits.of_rows(unit_of_row)
        position_ids = inputs.get("position_ids")
        if (
            isinstance(position_ids, torch.Tensor)
            and position_ids.dim() == 2
            and (position_ids[:, 1:] == 0).any()
        ):
            return PrivacyUnits.of_records(position_ids)
        return None

    def _dp_backward(self, model: nn.Module, inputs: dict[str, Any], micro: MicroBatch) -> torch.Tensor:
        """The clipping strategy on this micro-batch; returns what the parent's training_step back-propagates."""

        losses_of = micro.per_example_losses(self.compute_loss, inputs, f"{type(self).__name__}.compute_loss")
        if micro.units is not None and not micro.units.per_row and not self._records_checked:
            self._check_records_apart(losses_of, inputs, micro.units)
        step = self._clipping.run(losses_of, micro.mask, self._planner.current, model, micro.units)
        micro.losses = step.losses
        if step.backward is not None:
            return step.backward
        return torch.zeros((), device=micro.mask.device, requires_grad=True)  # .grad already holds the sum

    def _check_records_apart(self, losses_of, inputs: dict[str, Any], units: PrivacyUnits) -> None:
        """Per-record clipping of a packed row is exact only if no record's loss reads another record (attention
        kept within records). Checked once, forward only: each record's loss must not move when the input
        embeddings of the records of the other parity are perturbed (same dropout masks; RNG left as it was)."""
        embeddings = unwrap_model(self.model).get_input_embeddings()
        module = getattr(self._clipping, "module", None) or self.model
        parity = units.unit_of_token % 2
        state = rng_state()

        def losses_with(perturbed: int | None) -> torch.Tensor:
            def perturb(_module, _args, output):
                where = (units.unit_of_token >= 0) & (parity == perturbed)
                noise = torch.randn(
                    output.shape, generator=generator, dtype=output.dtype, device=output.device
                )
                return output + noise * where[..., None].to(output.dtype)

            handle = None if perturbed is None else embeddings.register_forward_hook(perturb)
            replay_rng(state)
            try:
                with torch.no_grad():
                    return losses_of(module).double()
            finally:
                if handle is not None:
                    handle.remove()

        generator = torch.Generator(device=self.args.device).manual_seed(0)
        plain = losses_with(None)
        record_parity = torch.arange(units.count, device=plain.device) % 2
        for perturbed in (0, 1):
            moved = (losses_with(perturbed) - plain).abs() > 1e-5 * (1 + plain.abs())
            crossing = moved & (record_parity != perturbed)
            if crossing.any():
                raise ValueError(
                    f"packed record {int(crossing.nonzero()[0])} of a row reads the tokens of other records (attention "
                    "crosses records), so clipping per record would not bound its influence: pass position_ids and "
                    "no attention_mask with an attention that keeps packed sequences apart (sdpa, eager, flash), and "
                    "use_cache=False"
                )
        replay_rng(state)
        self._records_checked = True

    def train_one_step(self, micro_batches: list[dict[str, Any]]) -> float:
        """One logical batch outside ``Trainer.train`` (benchmarks, audits): every micro-batch's DP backward, the
        release (noised AND accounted), the update. Returns the logged loss. Not under DeepSpeed."""
        if self.is_deepspeed_enabled:
            raise ValueError(
                "train_one_step drives the optimizer itself, which DeepSpeed's engine owns; use train()"
            )
        if self.optimizer is None:
            self.create_optimizer()
        self._count_drawn_examples(micro_batches)
        loss = sum(float(self.training_step(self.model, batch)) for batch in micro_batches)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._planner.end()
        return loss

    # ---- logging and the guarantee ----------------------------------------------------------------

    def get_epsilon(self) -> float:
        """ε spent so far at ``self.target_delta`` (inf for a run without noise)."""
        return epsilon_spent(self.privacy_plan, self.accountant)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.privacy_plan is not None:
            logs = {**logs, "epsilon": self.get_epsilon()}
        if self.clipping_engine is not None and self.clipping_engine.nonfinite_examples:
            # like the loss, a count over the drawn batches without noise: NOT private
            logs["nonfinite_examples"] = self.clipping_engine.nonfinite_examples
        super().log(logs, *args, **kwargs)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float | None:
        """Under DP the Trainer would log the norm of the clipped sum BEFORE noise, an unprivatised statistic."""
        if self.privacy_plan is not None and self.privacy_plan.private:
            return None
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        return None if norm is None else norm / self.privacy_plan.expected_batch_size

    def privacy_report(self) -> dict[str, Any]:
        if self.privacy_plan is None:
            raise ValueError("this DPTrainer has no train_dataset, so it trains nothing and has no guarantee")
        steps = self.accountant.steps if self.privacy_plan.private else self.state.global_step
        randomness = "secure_mode" if self.args.secure_mode else self._secret.source
        return privacy_report(
            self.privacy_plan, self.accountant, self.args, steps, randomness, self._update_rule()
        )

    def _update_rule(self) -> tuple[str, dict[str, Any]]:
        """The name and kwargs of the rule fed ĝ: the user's optimizer (class or instance) or the dp_optimizer."""
        if self.optimizer_cls_and_kwargs is not None:
            rule, kwargs = self.optimizer_cls_and_kwargs
            return f"{rule.__module__}.{rule.__qualname__}", dict(kwargs)
        if self._optimizer_passed_in is not None:
            rule = type(self._optimizer_passed_in)
            return f"{rule.__module__}.{rule.__qualname__}", {}
        return self.args.dp_optimizer, dict(self.args.dp_optimizer_kwargs)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero() and self.privacy_plan is not None:
            dataset = kwargs.get("dataset") or kwargs.get("dataset_tags") or kwargs.get("dataset_args")
            add_privacy_to_model_card(
                os.path.join(self.args.output_dir, "README.md"), self.privacy_report(), dataset
            )

    # ---- checkpoints: the privacy state, private ------------------------------------------------------

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self.state.stateful_callbacks[checkpoint.LEDGER_KEY] = checkpoint.public_ledger(
            self.accountant.state_dict()
        )
        super()._save_checkpoint(model, trial)
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        self._privacy_state.save(folder, self.args.process_index, main=self.args.should_save)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """The Trainer uploads whole checkpoint folders (hub_strategy checkpoint / all_checkpoints): hand it a
        hard-linked copy without the privacy state, in a folder the model upload ignores ("_*")."""
        clear = self.push_in_progress is None or self.push_in_progress.is_done()
        staged = checkpoint.stage_without_privacy_state(checkpoint_folder, self.args.output_dir, clear)
        super()._push_from_checkpoint(staged)

    def _load_optimizer_and_scheduler(self, folder: str | None) -> None:
        super()._load_optimizer_and_scheduler(folder)
        if folder is not None:
            self._privacy_state.restore(folder, self.state.global_step, self.args.process_index)


class DPTrainer(DPTrainerMixin, Trainer):
    """``transformers.Trainer`` with differential privacy (DP-SGD family), configured by ``DPTrainingArguments``."""
