"""DPTrainer: the Hugging Face Trainer with exact per-example clipping, Poisson sampling and accounting.

Trainer hooks only: each forwards to ``self.dp``, the run's ``PrivateRun`` (run.py), which owns the DP step
(docs/dp-step.md); docs/architecture.md maps the modules.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_dp.arguments import DPTrainingArguments, check_trainer_call
from hf_dp.checkpoint_files import stage_without_privacy_state
from hf_dp.clipping.units import PrivacyUnits
from hf_dp.data import ALONE_KEY, count_drawn_examples, split_dp_keys
from hf_dp.distributed import backend_of, shard_on_cpu, uses_checkpointing, weights_on_each_node
from hf_dp.hub import add_privacy_to_trainer_card
from hf_dp.loss_contract import MicroBatch, examples_alone, per_example_under_dp
from hf_dp.losses import per_example_loss, unwrap_model
from hf_dp.optim.registry import decay_groups
from hf_dp.privacy import privacy_metrics
from hf_dp.privacy_units import dataset_units, micro_batch_units
from hf_dp.run import PrivateRun, UpdateRule, build_update_rule, sampled_loader, update_rule_of

logger = logging.getLogger(__name__)


class DPTrainerMixin:
    """Makes a ``transformers.Trainer`` (sub)class differentially private; see ``DPTrainer``."""

    args: DPTrainingArguments
    loss_is_scaled_for_ga = True  # the release divides by B̄; nothing divides by the accumulation steps
    # what one dataset row is, for the guarantee (privacy.UNITS; DPDPOTrainer: "pair")
    privacy_unit = "example"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "compute_loss" in cls.__dict__:
            cls.compute_loss = per_example_under_dp(cls.__dict__["compute_loss"])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_trainer_call(type(self), DPTrainerMixin, args, kwargs)
        self.dp: PrivateRun | None = None  # None: evaluation and prediction need no privacy machinery
        self._micro_batch: MicroBatch | None = None
        self._drawn_examples = 0  # real examples in the logical batch in progress, over all processes
        super().__init__(*args, **kwargs)
        self._optimizer_passed_in = self.optimizer  # optimizers=(optimizer, scheduler), or None
        if self.train_dataset is not None:
            units = dataset_units(self.args, self.train_dataset, self.privacy_unit, type(self).__name__)
            self.dp = PrivateRun.build(self.args, self.model, self.train_dataset, backend_of(self), units)
            for callback in self.dp.callbacks():
                self.add_callback(callback)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        shard_on_cpu(self)  # accelerate would silently run FSDP as DDP on CPU
        if self.args.fp16 and not self.args.disable_dp:
            # GradScaler skips a step on an inf of the UNNOISED sum; DP uses a fixed S (clipping/loss_scale.py)
            self.accelerator.scaler = None

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """``model_init``'s fresh model (``train()`` builds one): the clipping hooks move to it."""
        model = super().call_model_init(trial)
        if getattr(self, "dp", None) is not None:
            self.dp.hook(model, uses_checkpointing(self.args, model))
        return model

    def hyperparameter_search(self, *args: Any, **kwargs: Any):
        raise ValueError(
            "DPTrainer.hyperparameter_search trains once per trial on the private data and keeps the best, which "
            "one run's guarantee does not cover (Papernot & Steinke 2022); tune on public data, then train once"
        )

    # the plan's numbers under the names the Trainer's users know
    privacy_plan = property(lambda self: None if self.dp is None else self.dp.plan)
    accountant = property(lambda self: self.dp.accountant)
    num_train_examples = property(lambda self: self.dp.plan.num_examples)
    expected_batch_size = property(lambda self: self.dp.plan.expected_batch_size)
    sample_rate = property(lambda self: self.dp.plan.sample_rate)
    steps_per_epoch = property(lambda self: self.dp.plan.steps_per_epoch)
    planned_steps = property(lambda self: self.dp.plan.planned_steps)
    target_delta = property(lambda self: self.dp.plan.delta)
    noise_multiplier = property(lambda self: self.dp.plan.noise_multiplier)

    # ---- training ---------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """The Trainer's ``train``, once per DPTrainer, from a complete checkpoint (``PrivateRun.start_training``);
        its metrics carry the guarantee; a process that dies or hangs stops the others (``PrivateRun.training``)."""
        resume = self._private_run("train").start_training(resume_from_checkpoint, self)
        with self.dp.training(self.state):
            output = super().train(resume, *args, **kwargs)
        output.metrics.update(self.privacy_metrics())
        return output

    def get_train_dataloader(self) -> DataLoader:
        dataset, collator = self.train_dataset, self.data_collator
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        return sampled_loader(self.dp, dataset, collator)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The ``dp_optimizer`` rule (or the user's optimizer), released through the Gaussian mechanism."""
        if self.optimizer is None:
            model = model if model is not None else self.model
            groups = decay_groups(model, self.get_decay_parameter_names(model), self.args.weight_decay)
            self.optimizer = build_update_rule(
                self.args, groups, self.optimizer_cls_and_kwargs, self.dp.plan.mean_noise_std
            )
        self.dp.bind_optimizer(self.optimizer, self._update_rule())  # before accelerate or DeepSpeed wrap it
        return self.optimizer

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The parent's ``training_step``, whose ``compute_loss`` runs the clipped step; returns the micro-batch's
        share of the logged loss. ``num_items_in_batch`` is dropped: normalising by the tokens of the whole
        logical batch would mix examples."""
        alone = inputs.get(ALONE_KEY)
        inputs, mask, unit_of_row = split_dp_keys(inputs)
        micro = MicroBatch.of(mask, self.privacy_units(inputs, unit_of_row), self.args.device)
        self._micro_batch = micro
        micro.alone = examples_alone(self, alone, inputs, micro.units)  # PrivateRun.clip checks
        try:
            super().training_step(model, inputs, None)
        finally:
            self._micro_batch = None
        return micro.logged_loss(type(self).__name__, self.args.world_size, self._drawn_examples)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Count the logical batch's real examples over all processes: the logged loss is their mean."""
        done = self.dp.finished(self.state, self.control)  # resumed at max_steps: no step past the plan
        batches, _ = ([], None) if done else super().get_batch_samples(epoch_iterator, num_batches, device)
        self._drawn_examples = count_drawn_examples(batches, self.args.device, self.accelerator.reduce)
        return batches, None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """In a DP step: the clipped step (inside it: the per-example loss); else the parent's ``compute_loss``."""
        micro = self._micro_batch
        if micro is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if micro.evaluating:
            return self.compute_per_example_loss(model, inputs)
        return self._clipped_step(model, inputs, micro)

    def compute_per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """L_u for each privacy unit of the micro-batch, shape (U,) (or one per row when units are whole rows:
        a unit's loss is then their mean): the extension point for your own loss."""
        micro = self._micro_batch
        units = None if micro is None else micro.units
        return per_example_loss(model, inputs, label_smoothing=self.args.label_smoothing_factor, units=units)

    def privacy_units(self, inputs: dict[str, Any], unit_of_row: torch.Tensor | None) -> PrivacyUnits | None:
        """How a micro-batch's rows and tokens form privacy units (``privacy_units.micro_batch_units``); None: one
        unit per row. Override to group otherwise (DPDPOTrainer: a pair's two rows)."""
        return micro_batch_units(inputs, unit_of_row)

    def _clipped_step(self, model: nn.Module, inputs: dict[str, Any], micro: MicroBatch) -> torch.Tensor:
        """The clipped step on this micro-batch; returns what the parent's training_step back-propagates."""
        losses_of = micro.per_example_losses(self.compute_loss, inputs, f"{type(self).__name__}.compute_loss")
        return self.dp.clip(losses_of, micro, model, unwrap_model(self.model), inputs)

    def train_one_step(self, micro_batches: list[dict[str, Any]]) -> float:
        """One logical batch outside ``Trainer.train`` (benchmarks, audits): every micro-batch's clipped step, the
        release (noised AND accounted), the update. Returns the logged loss. Not under DeepSpeed."""
        self._private_run("train_one_step").check_driven_by_hand()
        if self.optimizer is None:
            self.create_optimizer()
        self._drawn_examples = count_drawn_examples(micro_batches, self.args.device, self.accelerator.reduce)
        loss = sum(float(self.training_step(self.model, batch)) for batch in micro_batches)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.dp.end_step()
        return loss

    # ---- logging and the guarantee ----------------------------------------------------------------

    def get_epsilon(self) -> float:
        """ε spent so far at ``self.target_delta`` (inf for a run without noise)."""
        return self.dp.epsilon()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        super().log(logs if self.dp is None else self.dp.log_fields(logs), *args, **kwargs)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float | None:  # transformers 5.2x
        """Under DP the Trainer would log the norm of the clipped sum BEFORE noise, an unprivatised statistic."""
        if self.dp is not None and self.dp.plan.private:
            return None
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        return None if norm is None else norm / self.dp.plan.expected_batch_size

    def privacy_report(self) -> dict[str, Any]:
        return self._private_run("privacy_report").report(self.state.global_step)

    def privacy_metrics(self) -> dict[str, float | int | str]:
        """The guarantee as metrics (``train_results.json``, ``all_results.json``)."""
        return privacy_metrics(self.privacy_report())

    def _private_run(self, hook: str) -> PrivateRun:
        if self.dp is None:
            raise ValueError(
                f"DPTrainer.{hook} needs a train_dataset (evaluate and predict work without one)"
            )
        return self.dp

    def _update_rule(self) -> UpdateRule:
        return update_rule_of(self.args, self.optimizer_cls_and_kwargs, self._optimizer_passed_in)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero() and self.dp is not None:
            add_privacy_to_trainer_card(self.args.output_dir, self.privacy_report(), kwargs)

    # ---- checkpoints: the privacy state, private ------------------------------------------------------

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint (with the public ledger), the private state, then the completion marker."""
        self.dp.record_public_ledger(self.state)
        folder = f"{self._get_output_dir(trial=trial)}/{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        with self.dp.state.saving(folder, self.args, self.state):
            super()._save_checkpoint(model, trial)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's model files; with ``save_on_each_node``, on every machine."""
        with weights_on_each_node(self.model, self.args):
            super()._save(output_dir, state_dict)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """The Trainer uploads whole checkpoint folders (hub_strategy checkpoint / all_checkpoints): hand it a
        hard-linked copy without the privacy state, in a folder the model upload ignores ("_*")."""
        clear = self.push_in_progress is None or self.push_in_progress.is_done()
        staged = stage_without_privacy_state(checkpoint_folder, self.args.output_dir, clear)
        super()._push_from_checkpoint(staged)

    def _load_optimizer_and_scheduler(self, folder: str | None) -> None:
        super()._load_optimizer_and_scheduler(folder)
        if folder is not None:
            self.dp.restore(folder, self.state.global_step, self.args.process_index)


class DPTrainer(DPTrainerMixin, Trainer):
    """``transformers.Trainer`` with differential privacy (DP-SGD family), configured by ``DPTrainingArguments``."""
