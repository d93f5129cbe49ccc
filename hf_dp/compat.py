"""What every ``TrainingArguments`` field means under DP: honoured, mapped, refused or without effect.

A user who swaps ``Trainer`` → ``DPTrainer`` keeps passing the flags they know; none may be silently ignored.
Each field of transformers' ``TrainingArguments`` has one entry in ``FIELD_POLICIES``; the tests fail when a
transformers release adds a field nobody classified. docs/trainer-arguments.md is the table for users.

- ``honoured``: the Trainer (or our code) does what the flag says, under DP too;
- ``mapped``: translated onto the DP machinery (``optim`` → ``dp_optimizer``, ``adam_*`` → its kwargs);
- ``refused``: a value other than the accepted ones stops the run before training, in one line;
- ``no_effect``: meaningless under DP sampling; a non-default value gets one warning saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

Status = Literal["honoured", "mapped", "refused", "no_effect"]


def _off(value: Any) -> bool:
    return not value


@dataclass(frozen=True)
class FieldPolicy:
    status: Status
    why: str = ""
    accepts: Callable[[Any], bool] = lambda value: (
        True
    )  # values allowed (refused) / without warning (no_effect)


def _honoured(why: str = "") -> FieldPolicy:
    return FieldPolicy("honoured", why)


def _refused(why: str, accepts: Callable[[Any], bool] = _off) -> FieldPolicy:
    return FieldPolicy("refused", why, accepts)


def _no_effect(why: str, accepts: Callable[[Any], bool]) -> FieldPolicy:
    return FieldPolicy("no_effect", why, accepts)


_EVAL = "evaluation only: the eval set is not protected by the guarantee (use held-out or public data)"
_DATALOADER = "passed to the DP data loader"
_NOT_PRIVATE_LOG = (
    "logged; computed from the drawn batch WITHOUT noise, so it is not private (docs/privacy.md)"
)
_CHECKPOINTING = (
    "exact: per-example norms inside a first backward, then Σ_i c_i L_i back-propagated (docs/clipping.md)"
)

FIELD_POLICIES: dict[str, FieldPolicy] = {
    # what is trained, for how long, at which rate
    "output_dir": _honoured(),
    "per_device_train_batch_size": _honoured("× accumulation × processes = the expected Poisson batch B̄"),
    "num_train_epochs": _honoured("planned steps = epochs × ⌈N/B̄⌉, for which σ is calibrated"),
    "max_steps": _honoured("planned steps, for which σ is calibrated"),
    "gradient_accumulation_steps": _honoured(
        "micro-batches of one logical batch; one release per logical batch"
    ),
    "learning_rate": _honoured("the DP rule's lr"),
    "lr_scheduler_type": _honoured("schedules the DP rule's lr (post-processing)"),
    "lr_scheduler_kwargs": _honoured("schedules the DP rule's lr (post-processing)"),
    "warmup_steps": _honoured("schedules the DP rule's lr (post-processing)"),
    "weight_decay": _honoured("decoupled decay on the decay group of the DP rule (post-processing)"),
    # the update rule
    "optim": FieldPolicy(
        "mapped", "adamw_torch(_fused) → dp_optimizer 'adamw', sgd → 'sgd'; other names refused"
    ),
    "optim_args": _refused(
        "is not read by the DP rules; put the options in dp_optimizer_kwargs", lambda v: v is None
    ),
    "optim_target_modules": _refused(
        "selects GaLore/APOLLO-style projected optimizers, which have no DP version here; use dp_optimizer",
        lambda v: v is None,
    ),
    "adam_beta1": FieldPolicy(
        "mapped", "betas[0] of a DP rule that has betas (refused for one that has none)"
    ),
    "adam_beta2": FieldPolicy(
        "mapped", "betas[1] of a DP rule that has betas (refused for one that has none)"
    ),
    "adam_epsilon": FieldPolicy("mapped", "eps of a DP rule that has eps (refused for one that has none)"),
    "max_grad_norm": _refused(
        "would clip the noisy aggregate gradient; set it to 0 and use per_sample_max_grad_norm for the per-example clip"
    ),
    "label_smoothing_factor": _honoured("applied inside each example's loss L_i (cross-entropy losses only)"),
    "average_tokens_across_devices": _no_effect(
        "L_i is the mean over example i's own tokens, so no token count is shared across examples or devices",
        lambda v: v is True,
    ),
    # precision, memory, kernels
    "bf16": _honoured("autocast; per-example norms and the noisy sum stay fp32"),
    "fp16": _honoured(
        "fp16 autocast with a FIXED loss scale dp_fp16_loss_scale instead of the GradScaler (which would skip steps "
        "on the unnoised gradient); norms and the noisy sum stay fp32 (docs/clipping.md). Refused with DeepSpeed "
        "and FSDP"
    ),
    "bf16_full_eval": _honoured(_EVAL),
    "fp16_full_eval": _honoured(_EVAL),
    "tf32": _honoured(),
    "activation_checkpointing": _honoured(_CHECKPOINTING),
    "activation_checkpointing_kwargs": _honoured("reentrant or not, every_n_layers, offload: all exact"),
    "gradient_checkpointing": _honoured("deprecated alias of activation_checkpointing; " + _CHECKPOINTING),
    "gradient_checkpointing_kwargs": _honoured("deprecated alias of activation_checkpointing_kwargs"),
    "torch_compile": _refused(
        "would compile the model, but the DP step runs the bare module with per-layer hooks; leave it False"
    ),
    "torch_compile_backend": _refused(
        "turns torch_compile on, which is refused under DP", lambda v: v is None
    ),
    "torch_compile_mode": _refused("turns torch_compile on, which is refused under DP", lambda v: v is None),
    "use_liger_kernel": _refused(
        "fuses the LM head and the loss into kernels that bypass per-example clipping; leave it False"
    ),
    "liger_kernel_config": _honoured("read only with use_liger_kernel, which is refused"),
    "use_cache": _honoured(),
    "neftune_noise_alpha": _refused(
        "scales each example's embedding noise by the batch's padded length, so one example changes the others' "
        "gradients and the sensitivity is no longer C; leave it None",
        lambda v: v is None,
    ),
    "torch_empty_cache_steps": _honoured(),
    "auto_find_batch_size": _refused(
        "would shrink the batch after σ was calibrated for it; set per_device_train_batch_size yourself"
    ),
    # logging
    "logging_strategy": _honoured("ε is added to every log"),
    "logging_steps": _honoured("ε is added to every log"),
    "logging_first_step": _honoured(),
    "log_on_each_node": _honoured(),
    "logging_nan_inf_filter": _honoured(),
    "include_num_input_tokens_seen": _honoured(_NOT_PRIVATE_LOG),
    "log_level": _honoured(),
    "log_level_replica": _honoured(),
    "disable_tqdm": _honoured(),
    "report_to": _honoured("ε reaches the trackers as train/epsilon"),
    "run_name": _honoured(),
    "project": _honoured(),
    "trackio_space_id": _honoured(),
    "trackio_bucket_id": _honoured(),
    "trackio_static_space_id": _honoured(),
    # evaluation
    "eval_strategy": _honoured(_EVAL),
    "eval_steps": _honoured(_EVAL),
    "eval_delay": _honoured(_EVAL),
    "per_device_eval_batch_size": _honoured(_EVAL),
    "prediction_loss_only": _honoured(_EVAL),
    "eval_on_start": _honoured(_EVAL),
    "eval_do_concat_batches": _honoured(_EVAL),
    "eval_use_gather_object": _honoured(_EVAL),
    "eval_accumulation_steps": _honoured(_EVAL),
    "include_for_metrics": _honoured(_EVAL),
    "batch_eval_metrics": _honoured(_EVAL),
    # checkpoints and the Hub
    "save_only_model": _honoured(
        "the privacy state is still saved; without the optimizer's a resume from it is refused in one line"
    ),
    "save_strategy": _honoured("every checkpoint carries the privacy state"),
    "save_steps": _honoured("every checkpoint carries the privacy state"),
    "save_on_each_node": _honoured(),
    "save_total_limit": _honoured(),
    "enable_jit_checkpoint": _honoured("the SIGTERM checkpoint carries the privacy state"),
    "push_to_hub": _honoured("uploads never include the privacy state (the run's secret)"),
    "hub_token": _honoured(),
    "hub_private_repo": _honoured(),
    "hub_model_id": _honoured(),
    "hub_strategy": _honoured("checkpoint uploads are staged without the privacy state"),
    "hub_always_push": _honoured(),
    "hub_revision": _honoured(),
    "load_best_model_at_end": _honoured("selects on the eval set: " + _EVAL),
    "metric_for_best_model": _honoured(_EVAL),
    "greater_is_better": _honoured(_EVAL),
    "ignore_data_skip": _refused(
        "would replay the epoch's first Poisson batches on resume, which the accountant counts as fresh draws"
    ),
    "restore_callback_states_from_checkpoint": _honoured(),
    "resume_from_checkpoint": _honoured(
        "by train() itself when not passed to it ('true': the newest complete checkpoint); restores and checks "
        "the privacy state (ledger, secret, sampler epoch, noise state)"
    ),
    # randomness
    "full_determinism": _honoured("model init and dropout; the noise and batches come from the run's secret"),
    "seed": _honoured("model init and dropout only; the noise and batches come from the run's secret"),
    "data_seed": _refused(
        "would seed the batches, which come from the run's secret under DP; use insecure_dp_seed for "
        "reproducible experiments",
        lambda v: v is None,
    ),
    # devices and processes
    "use_cpu": _honoured(),
    "accelerator_config": _honoured(),
    "parallelism_config": _refused(
        "tensor/context/sequence parallelism splits examples across processes, which per-example clipping does "
        "not support yet; use DDP or DeepSpeed ZeRO",
        lambda v: v is None,
    ),
    "ddp_find_unused_parameters": _honoured(),
    "ddp_bucket_cap_mb": _honoured(),
    "ddp_broadcast_buffers": _honoured(),
    "ddp_static_graph": _honoured(),
    "ddp_backend": _honoured(),
    "ddp_timeout": _honoured("on CPU too (gloo): how long a process that stops answering is waited for"),
    "fsdp": _honoured("FSDP2 only (fsdp_config version 2); checked before training (docs/distributed.md)"),
    "fsdp_config": _honoured("version 2 required; FSDP1's flat parameters are refused"),
    "deepspeed": _honoured("ZeRO-1/2/3; checked before training (docs/distributed.md)"),
    "debug": _honoured(),
    "skip_memory_metrics": _honoured(),
    "local_rank": _honoured(),
    # data
    "dataloader_drop_last": _no_effect(
        "every step is a freshly sampled logical batch (Poisson: random size), so there is no last batch to drop",
        _off,
    ),
    "dataloader_num_workers": _honoured(_DATALOADER),
    "dataloader_pin_memory": _honoured(_DATALOADER),
    "dataloader_persistent_workers": _honoured(_DATALOADER),
    "dataloader_prefetch_factor": _honoured(_DATALOADER),
    "dataloader_multiprocessing_context": _honoured(_DATALOADER),
    "dataloader_in_order": _honoured(_DATALOADER),
    "remove_unused_columns": _honoured(),
    "label_names": _honoured(),
    "train_sampling_strategy": _refused(
        "would replace the sampling the accountant assumes: batches are Poisson-sampled (or shuffled fixed-size "
        "with poisson_sampling=False); leave it 'random'",
        lambda v: v == "random",
    ),
    "length_column_name": _no_effect(
        "is read only by train_sampling_strategy='group_by_length', which DP sampling replaces",
        lambda v: v == "length",
    ),
    # scripts
    "do_train": _honoured("read by training scripts"),
    "do_eval": _honoured("read by training scripts; eval-only runs need no train set"),
    "do_predict": _honoured("read by training scripts; predict-only runs need no train set"),
}

# HF's optim names that mean a DP rule here (the rule then runs on the privatised gradient)
OPTIM_TO_DP = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"}
_DEFAULT_OPTIMS = ("adamw_torch", "adamw_torch_fused")
_ADAM_DEFAULTS = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}


def check_fields(args: Any) -> None:
    """Refuse (one line) the fields ``args`` sets that DP cannot honour; warn for those without effect."""
    for name, policy in FIELD_POLICIES.items():
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if policy.accepts(value):
            continue
        if policy.status == "refused":
            raise ValueError(f"DPTrainingArguments: {name}={value!r} {policy.why}")
        if policy.status == "no_effect":
            logger.warning(f"hf_dp: {name}={value!r} has no effect under DP: {policy.why}")


def resolve_dp_optimizer(dp_optimizer: str | None, optim: str) -> str:
    """``dp_optimizer`` from HF's ``optim`` when it is not given; a one-line error where the two disagree."""
    optim = str(getattr(optim, "value", optim))
    mapped = OPTIM_TO_DP.get(optim)
    if dp_optimizer is None:
        if mapped is None:
            raise ValueError(
                f"DPTrainingArguments: optim={optim!r} has no DP version; set dp_optimizer to a registered rule "
                "(e.g. 'adamw', 'sgd', 'adam_bc', 'dp2') or optim to adamw_torch or sgd"
            )
        return mapped
    if optim not in _DEFAULT_OPTIMS and mapped != dp_optimizer:
        raise ValueError(
            f"DPTrainingArguments: optim={optim!r} and dp_optimizer={dp_optimizer!r} name different rules; "
            "drop optim (dp_optimizer is the rule that runs under DP)"
        )
    return dp_optimizer


def adam_kwargs(args: Any) -> dict[str, Any]:
    """HF's ``adam_beta1/2`` and ``adam_epsilon``, where the user changed them, as a DP rule's ``betas``/``eps``;
    a one-line error where they disagree with ``dp_optimizer_kwargs``."""
    changed = {name for name, default in _ADAM_DEFAULTS.items() if getattr(args, name) != default}
    mapped: dict[str, Any] = {}
    if changed & {"adam_beta1", "adam_beta2"}:
        mapped["betas"] = (args.adam_beta1, args.adam_beta2)
    if "adam_epsilon" in changed:
        mapped["eps"] = args.adam_epsilon
    for key, value in mapped.items():
        given = args.dp_optimizer_kwargs.get(key)
        if given is not None and (tuple(given) if isinstance(given, list | tuple) else given) != value:
            raise ValueError(
                f"DPTrainingArguments: adam_* ({key}={value}) and dp_optimizer_kwargs[{key!r}]={given!r} disagree; "
                "set one of them"
            )
    return mapped
