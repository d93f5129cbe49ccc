"""What DP needs from multi-process training: a cross-process sum, DeepSpeed / FSDP settings that keep DP exact, a
bounded wait for a process that dies or hangs (``ProcessLostError``), and checkpoints on every machine.

Under DDP every process holds its share's clipped sum in ``.grad``; they are summed once per logical
batch and every process adds the same noise (replicated gradients). Under DeepSpeed ZeRO the gradient
goes through ``engine.backward`` (the two-pass clipping strategy) and each process adds independent noise
to the partition it owns; FSDP2 likewise, to the shard of each parameter it owns. See docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_dp.backend import Backend
from hf_dp.losses import unwrap_model
from hf_dp.optim.registry import scaled_geometry, shifted_evaluations


def sum_across_processes(tensors: list[torch.Tensor]) -> None:
    """In place: every tensor becomes its sum over all processes (one all-reduce per dtype)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def reshard_after_forward_only(model: nn.Module) -> None:
    """FSDP2 keeps its root unit's parameters unsharded from a forward until that forward's backward; after a
    forward without one (a first-step check under no_grad) every unit is resharded here, or the update rule would
    meet whole tensors where it keeps shards."""
    from torch.distributed.fsdp import FSDPModule  # here: only an FSDP2 run needs it

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def join_process_group(args) -> None:
    """Create the CPU (gloo) process group with ``ddp_timeout``, which transformers passes only to accelerator
    process groups: without it a process that stops answering is waited for gloo's default 30 minutes."""
    launched = all(key in os.environ for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
    cpu = args.use_cpu or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
    mpi = args.ddp_backend in (None, "mpi") and dist.is_mpi_available()  # accelerate's choice on CPU
    if not launched or int(os.environ["WORLD_SIZE"]) < 2 or not cpu or mpi or dist.is_initialized():
        return
    if args.ddp_backend not in (None, "gloo"):
        return
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=args.ddp_timeout))


class ProcessLostError(RuntimeError):
    """A process of a multi-process run died or stopped answering: the others stop, and the run resumes from its
    newest complete checkpoint."""


def lost_process(
    error: BaseException, args, global_step: int, newest_checkpoint: str | None
) -> ProcessLostError | None:
    """The one-line error for a collective that failed because another process died or hung, else None."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    text = str(error)
    communication = isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and ("gloo" in text or "NCCL" in text)
    )
    if not communication:
        return None
    cause = next(
        (line.split("] ", 1)[-1] for line in text.splitlines() if line.strip()), type(error).__name__
    )
    resume = (
        f"continue from the newest checkpoint complete for every process (here: {newest_checkpoint})"
        if newest_checkpoint
        else "start again (no complete checkpoint yet)"
    )
    return ProcessLostError(
        f"DPTrainer: process {dist.get_rank()} of {dist.get_world_size()} lost the others during step "
        f"{global_step + 1} ({cause.split('. ')[0]}): a process died or did not answer within "
        f"ddp_timeout={args.ddp_timeout} s; relaunch every process with resume_from_checkpoint=True to {resume}"
    )


def zero_stage(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def check_launched_world(args, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse a job whose processes each train alone: on CPU without ``use_cpu`` the Trainer ignores the launcher's
    process group, so every process would draw its own batches and noise and write its own model."""
    launched = int(environ.get("WORLD_SIZE", "1"))
    if launched != args.world_size:
        raise ValueError(
            f"DPTrainer: the launcher started {launched} processes (WORLD_SIZE) but the Trainer sees "
            f"{args.world_size}; on CPU pass use_cpu=True (--use_cpu) so that they train together"
        )


def check_deepspeed(config: dict[str, Any], args) -> int:
    """Refuse what DeepSpeed cannot run exactly (before training), allow our torch optimizer; the ZeRO stage."""
    check_deepspeed_config(config)
    if scaled_geometry(args.dp_optimizer) or shifted_evaluations(args.dp_optimizer):
        what, instead = (
            ("a clip scale from its optimizer state", "FSDP2, DDP")
            if scaled_geometry(args.dp_optimizer)
            else ("evaluations away from θ", "DDP")
        )
        raise ValueError(
            f"dp_optimizer={args.dp_optimizer!r} ({what}) is not supported under DeepSpeed, whose optimizer holds "
            f"flattened partitions, not the layers' parameters (docs/distributed.md); use {instead} or another "
            "dp_optimizer"
        )
    config.setdefault("zero_allow_untested_optimizer", True)  # DeepSpeed calls any torch optimizer "untested"
    return zero_stage(config)


def check_deepspeed_config(config: dict[str, Any]) -> None:
    """Refuse DeepSpeed settings that would change or void the DP step, before training starts."""

    def enabled(section: str) -> bool:
        return config.get(section, {}).get("enabled", False) is True

    if "optimizer" in config:
        raise ValueError(
            "the DeepSpeed config has an 'optimizer' section: DeepSpeed would replace DPTrainer's optimizer and "
            "no noise would be added; remove it and choose the optimizer with dp_optimizer"
        )
    clipping = config.get("gradient_clipping", 0.0)
    if clipping not in (0, 0.0, "auto"):
        raise ValueError(
            f"DeepSpeed gradient_clipping={clipping} would clip the aggregate gradient; set it to 0 or 'auto' "
            "(per-example clipping is per_sample_max_grad_norm)"
        )
    if enabled("fp16"):
        raise ValueError(
            "DeepSpeed fp16 skips a step when its dynamic loss scale overflows, a decision taken on the unnoised "
            "gradient (private data); use bf16 (bf16.enabled) or float32"
        )
    zero = config.get("zero_optimization", {})
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key, {}).get("device", "none") not in ("none", None):
            raise ValueError(
                f"DeepSpeed zero_optimization.{key} is not supported by DPTrainer yet; remove it"
            )
    if config.get("gradient_predivide_factor", 1.0) != 1.0:
        raise ValueError("DeepSpeed gradient_predivide_factor must be 1.0 under DPTrainer")


def check_fp16(model: torch.nn.Module, deepspeed: bool, fsdp: bool) -> None:
    """Refuse what ``fp16=True`` under DP cannot run exactly (before training): its fixed loss scale lives in the
    one-process / DDP step, and autocast needs float32 master weights."""
    if deepspeed or fsdp:
        raise ValueError(
            f"fp16=True under {'DeepSpeed' if deepspeed else 'FSDP'}: its fp16 loss scaler skips a step when the "
            "unnoised gradient overflows (a decision on private data) and DP's fixed loss scale is not wired there; "
            "use bf16=True"
        )
    low = next((p.dtype for p in model.parameters() if p.requires_grad and p.dtype != torch.float32), None)
    if low is not None:
        raise ValueError(
            f"fp16=True autocasts float32 weights, but the model trains {low} parameters; load it in float32, or "
            "drop fp16=True (bf16/fp16 weights train without it, their clipped sum and noise in float32)"
        )


def check_fsdp(fsdp_version: int, dp_optimizer: str, reentrant_checkpointing: bool = False) -> None:
    """Refuse what FSDP cannot run exactly under DP (before training)."""
    if reentrant_checkpointing:
        raise ValueError(
            "FSDP with reentrant activation checkpointing: the norm pass differentiates towards its taps only, which "
            "reentrant checkpointing cannot do; pass activation_checkpointing_kwargs={'use_reentrant': False}"
        )
    if fsdp_version != 2:
        raise ValueError(
            f"FSDP version {fsdp_version}: FSDP1 flattens the parameters into one FlatParameter per unit, which "
            'per-parameter clipping cannot see through; use FSDP2 (fsdp_config={"version": 2}, or fsdp_version: 2 '
            "in the accelerate config)"
        )
    if shifted_evaluations(dp_optimizer):
        raise ValueError(
            f"dp_optimizer={dp_optimizer!r} (two evaluations per step, clipped as one) is not supported under FSDP, "
            "whose norm pass computes each layer's norm inside one backward (docs/distributed.md); use DDP or "
            "another dp_optimizer"
        )


def shard_on_cpu(trainer) -> None:
    """accelerate enables FSDP only on accelerator devices: on CPU it silently runs DDP, dropping the Trainer's FSDP
    plugin. For a multi-process CPU run with ``fsdp`` set (or launched with an FSDP config), build that plugin and switch the shared accelerate state
    to FSDP, so that ``accelerator.prepare`` really shards the model with ``fully_shard`` (gloo)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    args = trainer.args
    from_launcher = (
        os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    )  # accelerate launch, FSDP config
    if (args.fsdp_plugin_args is None and not from_launcher) or trainer.is_fsdp_enabled:
        return
    if trainer.accelerator.state.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin(**(args.fsdp_plugin_args or {}))  # or all from the launcher's env
    if trainer.accelerator.state.mixed_precision != "no":  # what AcceleratorState does for FSDP on GPUs
        plugin.set_mixed_precision(trainer.accelerator.state.mixed_precision)
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    trainer.is_fsdp_enabled = True


def several_nodes(args) -> bool:
    """Whether the run's processes span more than one machine (the launcher's LOCAL_WORLD_SIZE < world size)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size)) < args.world_size


def check_save_on_each_node(args, fsdp: bool, deepspeed_config: dict[str, Any] | None) -> None:
    """``save_on_each_node`` over several machines: FSDP2's checkpoint is one set of shards that every process
    needs on resume, so one folder per machine cannot hold it (refused); DeepSpeed writes its model states on
    each machine (``checkpoint.use_node_local_storage``)."""
    if not (args.save_on_each_node and several_nodes(args)):
        return
    if fsdp:
        raise ValueError(
            "save_on_each_node with FSDP2 on several machines: every process writes its own shard of the model "
            "and optimizer, and resuming needs all of them; use one output_dir shared by every machine"
        )
    if deepspeed_config is not None:
        deepspeed_config.setdefault("checkpoint", {})["use_node_local_storage"] = True


@contextlib.contextmanager
def weights_on_each_node(model: torch.nn.Module, args) -> Iterator[None]:
    """transformers' ``save_pretrained`` writes only on global rank 0 once a process group exists, which would
    leave every other machine's checkpoint (``save_on_each_node``) without weights: there each machine's main
    process writes them too."""
    if not (args.save_on_each_node and args.should_save and args.process_index != 0):
        yield
        return
    models = [m for m in model.modules() if hasattr(m, "should_save_on_this_rank")]
    for m in models:
        m.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        for m in models:
            del m.should_save_on_this_rank


def backend_of(trainer) -> Backend:
    """The run's ``Backend`` from the Trainer's accelerator, refusing what DeepSpeed, FSDP and fp16 cannot run
    exactly under DP (before training)."""
    args = trainer.args
    zero = None
    if trainer.is_deepspeed_enabled:
        zero = check_deepspeed(trainer.accelerator.state.deepspeed_plugin.deepspeed_config, args)
    deepspeed = (
        trainer.accelerator.state.deepspeed_plugin.deepspeed_config if trainer.is_deepspeed_enabled else None
    )
    check_save_on_each_node(args, trainer.is_fsdp_enabled, deepspeed)
    if trainer.is_fsdp_enabled:
        kwargs = args.activation_checkpointing_kwargs or {}
        reentrant = bool(args.activation_checkpointing) and bool(kwargs.get("use_reentrant", False))
        check_fsdp(trainer.accelerator.state.fsdp_plugin.fsdp_version, args.dp_optimizer, reentrant)
    fp16 = bool(args.fp16) and not args.disable_dp
    if fp16:
        check_fp16(trainer.model, trainer.is_deepspeed_enabled, trainer.is_fsdp_enabled)
    return Backend(
        world_size=args.world_size,
        process_index=args.process_index,
        zero_stage=zero,
        fsdp=trainer.is_fsdp_enabled,
        checkpointing=uses_checkpointing(args, trainer.model),
        fp16_loss_scale=args.dp_fp16_loss_scale if fp16 else None,
        device_type=args.device.type,
    )


def uses_checkpointing(args, model: torch.nn.Module) -> bool:
    """Activation checkpointing, asked for in the arguments or already enabled on the model."""
    return bool(args.activation_checkpointing) or getattr(
        unwrap_model(model), "is_activation_checkpointing", False
    )
