"""PrivateRun: one private training run, built once from the arguments, the model, the data and the ``Backend``.

It owns what the guarantee rests on (the plan, the ledger, the secret, the step planner, the clipped step, the
mechanism) and the lifecycle of one DP step (Abadi et al. 2016), in this order:

    open     planner.current      the update rule's plan for the logical batch, at its first micro-batch
    clip     clip()               each micro-batch's Σ_u c_u g_u, one clip per privacy unit
    release  release()            before the update: the .grad check, then (Σ c_u g_u + N(0, σ²C²)) / B̄, then
                                  one ledger step (the only noise, the only ε spent)
    close    end_step()           after the update: the next logical batch asks the rule again

The trainer only forwards the Trainer's hooks here; the audit, the budget callback and the tests read the
public fields below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from hf_dp.accounting import PrivacyAccountant
from hf_dp.backend import Backend
from hf_dp.budget import PrivacyBudgetCallback
from hf_dp.checkpoint import LEDGER_KEY, RunPrivacyState, public_ledger
from hf_dp.checkpoint_files import newest_complete, resume_argument, resume_point
from hf_dp.clipping.checks import check_examples_alone, check_records_apart
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.plan import StepPlanner
from hf_dp.cpu_heap import keep_freed_memory
from hf_dp.data import EpochDataLoader, dp_dataloader
from hf_dp.distributed import lost_process, reshard_after_forward_only
from hf_dp.inputs_fit import check_inputs_fit
from hf_dp.loss_contract import MicroBatch
from hf_dp.mechanism import GaussianMechanism, noise_mechanism_of
from hf_dp.optim.registry import make_dp_optimizer, shifted_evaluations
from hf_dp.planned_setting import PlannedSetting, refuse_compiled
from hf_dp.privacy import PrivacyPlan, epsilon_spent, plan_privacy, plan_record, privacy_report
from hf_dp.privacy_units import DatasetUnits
from hf_dp.randomness import RunSecret, shared_secret

logger = logging.getLogger(__name__)

UpdateRule = tuple[str, dict[str, Any]]  # the name and kwargs of the rule fed ĝ, as the model card states it


class PrivateRun:
    """The run's privacy machinery; ``build`` makes it, ``bind_optimizer`` attaches the release to the rule."""

    def __init__(
        self,
        args,
        backend: Backend,
        plan: PrivacyPlan,
        accountant: PrivacyAccountant,
        state: RunPrivacyState,
        units: DatasetUnits,
    ) -> None:
        self.args, self.backend, self.plan, self.accountant, self.state = (
            args,
            backend,
            plan,
            accountant,
            state,
        )
        self.units = units
        self.planner = StepPlanner(plan.clip_norm)
        self.engine: ClippingEngine | None = None
        self.clipping = None  # the clipped step for this backend (clipping.pipeline)
        self.mechanism: GaussianMechanism | None = None
        self.optimizer: torch.optim.Optimizer | None = None  # the DP update rule, before accelerate wraps it
        self.update_rule: UpdateRule = (args.dp_optimizer, dict(args.dp_optimizer_kwargs))
        self.records_checked = False  # packed records were checked not to read each other
        self.inputs_checked = False  # the first micro-batch was checked to fit the model
        self.examples_checked = False  # examples were checked to give the same loss in a batch as alone
        self._accounted = False  # this logical batch's release is in the ledger
        self._trained = False
        self.planned: PlannedSetting | None = (
            None  # the arguments, data and model the plan and hooks were made for
        )

    @classmethod
    def build(cls, args, model: nn.Module, dataset, backend: Backend, units: DatasetUnits) -> PrivateRun:
        """The plan (σ calibrated for the planned steps), the ledger, the secret drawn now, the clipping hooks."""
        refuse_compiled(model)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                "the model has no trainable parameters, so there is nothing to fine-tune: unfreeze the weights to "
                "train (requires_grad=True) or add an adapter (peft)"
            )
        noise_mechanism_of(args.noise_mechanism)
        plan = plan_privacy(args, dataset, units.name, units.count)
        accountant = PrivacyAccountant(args.accountant, plan.delta)
        state = RunPrivacyState(shared_secret(args.insecure_dp_seed), accountant, plan_record(plan, args))
        run = cls(args, backend, plan, accountant, state, units)
        run.planned = PlannedSetting.of(args, dataset, model)
        run.hook(model)
        return run

    @property
    def secret(self) -> RunSecret:
        return self.state.secret

    def hook(self, model: nn.Module, checkpointing: bool | None = None) -> None:
        """Clip ``model``'s gradients (again, for ``model_init``'s fresh model): the engine's hooks and the clipped
        step this backend needs."""
        self.close()
        if checkpointing is not None:
            self.backend = dataclasses.replace(self.backend, checkpointing=checkpointing)
        if self.plan.private:
            self.engine = clipping_engine(model, self.args, self.backend)
            weakref.finalize(self, self.engine.remove_hooks)
        self.clipping = clipped_step(self.engine, model, self.backend)

    def close(self) -> None:
        """Remove the clipping hooks (after training; before hooking a new model)."""
        if self.engine is not None:
            self.engine.remove_hooks()

    def set_noise_multiplier(self, sigma: float) -> None:
        """σ set by hand before the optimizer exists (e.g. to continue a checkpoint at its own σ)."""
        if self.mechanism is not None:
            raise RuntimeError("set the noise multiplier before training starts")
        self.plan = dataclasses.replace(self.plan, noise_multiplier=sigma)
        self.state.record = plan_record(self.plan, self.args)

    def start_training(self, resume_from_checkpoint: str | bool | None, trainer) -> str | None:
        """Once per run: a second ``train()`` would redraw the same batches from the same secret; the ``trainer``'s
        args, dataset and model still those planned for (``PlannedSetting.check``). Returns the checkpoint to resume
        from: only a complete one (``checkpoint_files.resume_point``). Without one, the argument
        ``resume_from_checkpoint`` (the Trainer leaves it to scripts; "true": the newest complete checkpoint)."""
        self.planned.check(trainer.args, trainer.train_dataset, trainer.model)
        if resume_from_checkpoint is None:
            resume_from_checkpoint = resume_argument(self.args.resume_from_checkpoint)
        resume = resume_point(resume_from_checkpoint, self.args.output_dir)
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
        return resume

    def check_driven_by_hand(self) -> None:
        """``DPTrainer.train_one_step`` steps the optimizer itself, which DeepSpeed's engine owns: refused there."""
        if self.backend.deepspeed:
            raise ValueError(
                "train_one_step drives the optimizer itself, which DeepSpeed's engine owns; use train()"
            )

    @contextlib.contextmanager
    def training(self, trainer_state) -> Iterator[None]:
        """Around ``Trainer.train``: a collective that fails because another process died or hung becomes one
        ``ProcessLostError`` line (distributed.lost_process); the clipping hooks come off at the end."""
        try:
            yield
        except Exception as error:
            newest = newest_complete(self.args.output_dir)
            lost = lost_process(error, self.args, trainer_state.global_step, newest)
            if lost is None:
                raise
            raise lost from error
        finally:
            self.close()

    def finished(self, state, control) -> bool:
        """Resumed from the run's last checkpoint: the Trainer's epoch loop checks ``max_steps`` only after a
        step, so it would take (and account) one step more than planned. Draw nothing and stop instead."""
        if state.global_step < state.max_steps:
            return False
        control.should_training_stop = True
        return True

    # ---- the step's lifecycle ---------------------------------------------------------------------

    def bind_optimizer(self, optimizer: torch.optim.Optimizer, update_rule: UpdateRule) -> None:
        """Release every logical batch into ``optimizer`` (the rule stays stock): one pre-hook, ``release``."""
        if self.optimizer is not None:
            return
        refuse_shifted_evaluations(update_rule[0], self.clipping, self.engine, self.backend)
        if getattr(optimizer, "evaluations_per_step", 1) > 1 and self.backend.device_type == "cpu":
            keep_freed_memory()  # two evaluations' buffers are reused, not re-mapped every step (cpu_heap.py)
        self.optimizer, self.update_rule = optimizer, update_rule
        self.planner.bind(optimizer)
        mechanism = noise_mechanism_of(self.plan.noise_mechanism)
        self.mechanism = self.state.mechanism = mechanism.for_run(
            self.plan, self.accountant, self.secret, self.backend, self.args
        )
        optimizer.register_step_pre_hook(lambda opt, *_: self.release(opt))

    def clip(
        self, losses_of, micro: MicroBatch, model: nn.Module, base: nn.Module, inputs: dict[str, Any]
    ) -> torch.Tensor:
        """One micro-batch's clipped sum under the logical batch's plan (opened here at its first micro-batch);
        returns what the Trainer's backward must back-propagate (a zero when ``.grad`` already holds the sum).
        ``base``: the transformers model under its wrappers, whose input embeddings the records check perturbs.
        ``inputs``: the micro-batch, checked once to fit the model (token ids, positions, labels).
        ``micro.alone``: some of its examples alone, checked once to give the losses they give in it."""
        if not self.inputs_checked:
            check_inputs_fit(base, inputs)
            self.inputs_checked = True
        checked = False
        if micro.alone is not None and not self.examples_checked:
            low_precision = bool(self.args.bf16 or self.args.fp16)
            module = self.clipping.module or model
            check_examples_alone(losses_of, micro.alone, self.backend, module, base, low_precision)
            self.examples_checked = checked = True
        if micro.units is not None and not micro.units.per_row and not self.records_checked:
            check_records_apart(
                base.get_input_embeddings(), self.clipping.module or model, losses_of, micro.units
            )
            self.records_checked = checked = True
        if checked and self.backend.fsdp:
            reshard_after_forward_only(model)  # the checks' forwards had no backward
        step = self.clipping.run(losses_of, micro.mask, self.planner.current, model, micro.units)
        micro.losses = step.losses
        if step.backward is not None:
            return step.backward
        return torch.zeros((), device=micro.mask.device, requires_grad=True)

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the update: nothing but the clipped step wrote ``.grad``; then noise and one ledger step per
        logical batch (ZeRO-3 steps its client optimizer once per parameter sub-group: one release each)."""
        self.clipping.check_untouched()
        params = (p for group in optimizer.param_groups for p in group["params"])
        self.mechanism.release(params, self.planner.current, self.clipping.take_sums())
        if not self._accounted:
            self.mechanism.account()
            self._accounted = True

    def restore(self, folder: str, global_step: int, process_index: int) -> None:
        """The checkpoint's privacy state (``RunPrivacyState.restore``), then a closed step: loading the optimizer
        may step it once (torch's distributed checkpoint fills an empty FSDP optimizer state with a zero-lr
        step), a release that must not leave its batch marked accounted, or the next real step goes unaccounted."""
        self.state.restore(
            folder, global_step, process_index
        )  # the mechanism's state too: that step is undone
        self._close()

    def end_step(self) -> None:
        """The logical batch is released and applied: close its plan (and the mechanism's step)."""
        if self._accounted:
            self.mechanism.end_step()
        self._close()

    def _close(self) -> None:
        self.planner.end()
        self._accounted = False

    def callbacks(self) -> list[TrainerCallback]:
        return [_EndOfStep(self), PrivacyBudgetCallback(self)]

    # ---- the guarantee ---

    def log_fields(self, logs: dict[str, float]) -> dict[str, float]:
        """ε on every log line; the count of examples clipped to zero for overflowing (like the loss, a count over
        the drawn batches without noise: NOT private)."""
        logs = {**logs, "epsilon": self.epsilon()}
        if self.engine is not None and self.engine.sums.nonfinite_examples:
            logs["nonfinite_examples"] = self.engine.sums.nonfinite_examples
        return logs

    def record_public_ledger(self, trainer_state) -> None:
        """Before a checkpoint: what ``trainer_state.json`` carries of the ledger, the accountant's history and δ
        (no secret)."""
        trainer_state.stateful_callbacks[LEDGER_KEY] = public_ledger(self.accountant.state_dict())

    def epsilon(self) -> float:
        """ε spent so far at the plan's δ (inf for a run without noise)."""
        return epsilon_spent(self.plan, self.accountant)

    def report(self, global_step: int) -> dict[str, Any]:
        """The guarantee as plain values: what the model card, the metrics and the logs state."""
        steps = self.mechanism.step if self.mechanism is not None and self.plan.private else global_step
        randomness = (
            "secure_mode"
            if self.args.secure_mode and self.secret.source == "os_entropy"
            else self.secret.source
        )
        report = privacy_report(self.plan, self.accountant, self.args, steps, randomness, self.update_rule)
        groups = self.engine.groups if self.engine is not None else None
        if groups is not None:
            report["clipping_groups"] = groups.describe(self.args.per_sample_max_grad_norm)
        return report


def sampled_loader(run: PrivateRun, dataset, collator) -> EpochDataLoader:
    """The logical batches of ``run``'s plan, drawn with its secret sampling key (users: by user)."""
    users = run.units.unit_of_row
    loader = dp_dataloader(
        dataset,
        collator,
        plan=run.plan,
        sampling_key=run.secret.sampling_key,
        partition_key=run.secret.partition_key,
        args=run.args,
        unit_of_row=users,
        max_rows_per_unit=run.args.max_examples_per_unit if users is not None else None,
    )
    run.state.sampler = loader.batch_sampler
    return loader


def clipping_engine(model: nn.Module, args, backend: Backend) -> ClippingEngine:
    """The model's clipping engine with the run's clipping function, mode and groups; group-wise clipping is refused
    in one line where the parameters are partitioned (ZeRO-3), and so is a module without a layer
    rule under ZeRO-3 (its call rule or the torch.func fallback re-runs it on weights ZeRO-3 keeps partitioned).
    The modules that take the torch.func fallback are logged once, with what they cost."""
    refuse_peft_method(model, backend)
    engine = ClippingEngine(
        model,
        args.clipping_fn,
        args.clipping_mode,
        grouping=args.clipping_groups,
        group_norms=args.clipping_group_norms,
        clip_norm=args.per_sample_max_grad_norm,
    )
    if engine.groups is not None and getattr(getattr(model, "active_peft_config", None), "use_dora", False):
        engine.remove_hooks()
        raise ValueError(
            "peft's DoRA with group-wise clipping: its weight norm reads the adapters on an identity matrix, which "
            "the norm pass inside the backward does not follow; use clipping_groups='all', or LoRA"
        )
    if engine.groups is not None and backend.zero_stage == 3:
        engine.remove_hooks()
        raise ValueError(
            f"clipping_groups={args.clipping_groups!r} runs on one process, with DDP, DeepSpeed ZeRO-0/1/2 and "
            "FSDP2, not with ZeRO-3 yet: use clipping_groups='all' there, or ZeRO-2 or FSDP2"
        )
    without_rule = [module for module, rule in engine.layers.rules.items() if rule is None]
    if without_rule and backend.zero_stage == 3:
        engine.remove_hooks()
        raise ValueError(
            f"{engine.layers.where(without_rule[0])} has no layer rule, and its per-example gradients (a call rule "
            "or the torch.func fallback) are not formed under DeepSpeed ZeRO-3, which keeps its weights partitioned: "
            "use ZeRO-2 or FSDP2, or freeze it"
        )
    report = engine.fallback_report()
    if report is not None:
        logger.warning(report)
    return engine


def refuse_peft_method(model: nn.Module, backend: Backend) -> None:
    """The peft methods whose per-example gradients are not formed, refused in one line before training: the
    prompt-learning methods other than prompt tuning, p-tuning and prefix tuning; p-tuning's encoder and prefix
    tuning's key-value prefixes, shared by all examples, are not followed through a checkpoint's recomputation;
    BOFT's butterfly factors are computed from the adapters on tensors shared by all examples, next to each
    example's input; DoRA's weight norm reads the adapters on an identity matrix, a use whose output it detaches,
    which the norm pass inside the backward (activation checkpointing, FSDP2, group-wise clipping) does not
    follow."""
    checkpointing = backend.checkpointing
    config = getattr(model, "active_peft_config", None)
    if config is None:
        return
    method = str(getattr(config.peft_type, "value", config.peft_type))
    if method == "BOFT":
        raise ValueError(
            "peft's BOFT forms the adapted weight from the adapters applied to tensors shared by all examples, whose "
            "per-example gradients are not formed: use LoRA"
        )
    if getattr(config, "use_dora", False) and (checkpointing or backend.fsdp):
        raise ValueError(
            f"peft's DoRA with {'activation checkpointing' if checkpointing else 'FSDP2'}: its weight norm reads the "
            "adapters on an identity matrix, which the norm pass inside the backward does not follow; turn "
            "gradient checkpointing off, use DDP or DeepSpeed, or use LoRA (use_dora=False)"
        )
    if not getattr(config, "is_prompt_learning", False):
        return
    if method not in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING"):
        raise ValueError(
            f"peft's {method} has no per-example gradients in hf_dp: use prompt tuning, p-tuning, prefix tuning or "
            "LoRA for DP fine-tuning"
        )
    if checkpointing and method != "PROMPT_TUNING":
        shared = "key-value prefixes" if method == "PREFIX_TUNING" else "prompt encoder's output"
        raise ValueError(
            f"peft's {method} with activation checkpointing: its {shared}, shared by all examples, is not followed "
            "through a checkpoint's recomputation; turn gradient checkpointing off, or use prompt tuning or LoRA"
        )


def refuse_shifted_evaluations(rule: str, clipping, engine: ClippingEngine | None, backend: Backend) -> None:
    """A rule that evaluates each example at two parameter points (DiSK, its ``RuleSpec``) needs book-keeping's
    norms of the combination: refused in one line before training where the step would not form them."""
    if not shifted_evaluations(rule):
        return
    if engine is not None and engine.groups is not None:
        raise ValueError(
            f"{rule} evaluates each example at two parameter points (DiSK), whose combination group-wise clipping "
            "does not clip yet: use clipping_groups='all' or another dp_optimizer"
        )
    if clipping.norms_in_backward or backend.framework_owns_gradients:
        raise ValueError(
            f"{rule} evaluates each example at two parameter points (DiSK), which activation checkpointing, "
            "DeepSpeed and FSDP do not support yet: turn activation_checkpointing off, train on one process or "
            "with DDP, or pick another dp_optimizer"
        )


def update_rule_of(args, optimizer_cls_and_kwargs, optimizer_passed_in) -> UpdateRule:
    """The name and kwargs of the rule fed ĝ: the user's optimizer (class or instance) or the dp_optimizer."""
    if optimizer_cls_and_kwargs is not None:
        rule, kwargs = optimizer_cls_and_kwargs
        return f"{rule.__module__}.{rule.__qualname__}", dict(kwargs)
    if optimizer_passed_in is not None:
        rule = type(optimizer_passed_in)
        return f"{rule.__module__}.{rule.__qualname__}", {}
    return args.dp_optimizer, dict(args.dp_optimizer_kwargs)


def build_update_rule(args, groups: list[dict[str, Any]], optimizer_cls_and_kwargs, mean_noise_std: float):
    """The Trainer's ``optimizer_cls_and_kwargs`` over ``groups``, else the ``dp_optimizer`` rule."""
    if optimizer_cls_and_kwargs is not None:
        rule, kwargs = optimizer_cls_and_kwargs
        return rule(groups, **{"lr": args.learning_rate, **kwargs})
    kwargs = {"lr": args.learning_rate, **args.dp_optimizer_kwargs}
    return make_dp_optimizer(args.dp_optimizer, groups, mean_noise_std=mean_noise_std, **kwargs)


class _EndOfStep(TrainerCallback):
    """Closes each logical batch's plan once the Trainer has applied its update."""

    def __init__(self, run: PrivateRun) -> None:
        self.run = run

    def on_step_end(self, args, state, control, **kwargs):
        self.run.end_step()
        return control
