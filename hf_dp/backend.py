"""Where the model trains, as the DP step needs to know it: one value instead of flags threaded through layers.

The clipping table (``clipping.pipeline``), the mechanism (whose noise key is shared or per process) and the
argument checks read a ``Backend``; nothing below the trainer asks the Trainer or accelerate again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    """The run's processes, gradient ownership, activation checkpointing and fp16 loss scale."""

    world_size: int = 1
    process_index: int = 0
    zero_stage: int | None = None  # DeepSpeed's ZeRO stage; None without DeepSpeed
    fsdp: bool = False  # FSDP2 (fully_shard): parameters and gradients are DTensor shards
    checkpointing: bool = False  # activation checkpointing (HF's or torch.utils.checkpoint)
    fp16_loss_scale: float | None = None  # fp16 under DP: the fixed loss scale S (clipping/loss_scale.py)
    device_type: str = "cpu"

    @property
    def deepspeed(self) -> bool:
        return self.zero_stage is not None

    @property
    def framework_owns_gradients(self) -> bool:
        """DeepSpeed and FSDP reduce (and partition) gradients in their own backward: the weighted pass runs
        through the wrapped model, and the norm pass must not write ``.grad``."""
        return self.deepspeed or self.fsdp

    @property
    def partitioned(self) -> bool:
        """Each process owns part of every gradient (ZeRO ≥ 1, FSDP2) and noises that part with its own key."""
        return bool(self.zero_stage) or self.fsdp

    @property
    def replicated(self) -> bool:
        """Several processes hold whole gradients (DDP, ZeRO-0): their clipped sums are summed, one noise."""
        return self.world_size > 1 and not self.partitioned
