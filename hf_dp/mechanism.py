"""The Gaussian mechanism of DP-SGD: the one place where noise is added and the one place where ε is spent.

Abadi et al. 2016: ĝ = (Σ_i c_i g_i + N(0, σ²C² I)) / B̄, where the clipping strategy has left the clipped
sum Σ_i c_i g_i in ``.grad`` and B̄ is the EXPECTED logical batch size (the realised one would leak the batch
size). A plan that clips in a scaled geometry ‖s ⊙ g_i‖ ≤ C gets noise isotropic in the scaled space, std
σC/s_j on coordinate j. Each released logical batch is one step of the subsampled Gaussian mechanism
(σ, q) in the accountant; everything after the release is post-processing. See docs/dp-step.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_dp.accounting import PrivacyAccountant
from hf_dp.clipping.geometry import owned_scale
from hf_dp.distributed import sum_across_processes
from hf_dp.noise import GaussianNoise
from hf_dp.clipping.plan import StepPlan, StepPlanner


class GaussianMechanism:
    """Releases the clipped sums of a logical batch; ``noise`` and ``accountant`` are None without DP.

    ``sum_across_processes`` (DDP: replicated gradients) sums the per-process clipped sums first, and every
    process then adds the SAME noise (one shared secret). Partitioned gradients (DeepSpeed ZeRO) arrive
    already reduced, and each process adds independent noise to the part it owns.
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        expected_batch_size: float,
        sample_rate: float,
        noise: GaussianNoise | None,
        accountant: PrivacyAccountant | None,
        sum_across_processes: Callable[[list[torch.Tensor]], None] | None = None,
        low_precision_sums: dict[nn.Parameter, torch.Tensor] | None = None,
    ) -> None:
        if expected_batch_size <= 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}")
        if (noise is None) != (accountant is None):
            raise ValueError(
                "a private mechanism needs both a noise source and an accountant, a non-private one neither"
            )
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        self.sample_rate = sample_rate
        self.noise = noise
        self.accountant = accountant
        self.sum_across_processes = sum_across_processes
        self.low_precision_sums = low_precision_sums if low_precision_sums is not None else {}
        self._accounted: StepPlan | None = None

    @classmethod
    def for_run(
        cls,
        plan,
        accountant: PrivacyAccountant,
        secret,
        args,
        partitioned: bool,
        low_precision_sums: dict[nn.Parameter, torch.Tensor] | None = None,
    ) -> GaussianMechanism:
        """The mechanism of a training run: noise keyed by the run's secret, one key for all processes when
        their gradients are replicated (summed here first), one per process when they are partitioned."""
        private = plan.private
        key = secret.noise_key(args.process_index if partitioned else None)
        return cls(
            noise_multiplier=plan.noise_multiplier,
            expected_batch_size=plan.expected_batch_size,
            sample_rate=plan.sample_rate,
            noise=GaussianNoise(key, secure_mode=args.secure_mode) if private else None,
            accountant=accountant if private else None,
            sum_across_processes=sum_across_processes if args.world_size > 1 and not partitioned else None,
            low_precision_sums=low_precision_sums,
        )

    @property
    def private(self) -> bool:
        return self.accountant is not None

    def sum_noise_std(self, plan: StepPlan) -> float:
        """σC: the noise std per coordinate of the clipped SUM (in the plan's scaled space)."""
        return self.noise_multiplier * plan.clip_norm if self.private else 0.0

    def mean_noise_std(self, plan: StepPlan) -> float:
        """σC/B̄: the noise std per coordinate of ĝ, what the update rule receives."""
        return self.sum_noise_std(plan) / self.expected_batch_size

    def release(self, params: Iterable[nn.Parameter], plan: StepPlan) -> None:
        """.grad ← (.grad + N(0, σ²C²/s²)) / B̄ for every trainable parameter, then one accountant step per plan.

        A missing ``.grad`` counts as a zero clipped sum (an empty batch still gets noise: skipping it would
        reveal that the batch was empty). A bf16/fp16 parameter's clipped sum arrives in float32
        (``low_precision_sums``) and is noised in float32; only the released ĝ is cast to its dtype, which is
        post-processing (a noise draw in bf16 would itself be quantised to 8 significant bits). Several releases
        of one plan (DeepSpeed ZeRO-3 steps its client optimizer once per parameter sub-group) are one logical
        batch, accounted once.
        """
        params = [p for p in params if p.requires_grad]
        sums = [self._clipped_sum(p) for p in params]
        if self.sum_across_processes is not None:
            self.sum_across_processes(sums)
        std = self.sum_noise_std(plan)
        for p, total in zip(params, sums, strict=True):
            if std > 0:
                owned = _owned_part(total)  # FSDP: this process's shard; its key is its own
                noise = self.noise.sample(owned.shape, std, owned.device, owned.dtype)
                scale = plan.clip_scale.get(p) if plan.clip_scale else None
                owned.add_(noise if scale is None else noise / owned_scale(scale, total).to(noise))
            total.div_(self.expected_batch_size)
            p.grad = total if total.dtype == p.dtype else total.to(p.dtype)
        if self.private and plan is not self._accounted:
            self.accountant.step(self.noise_multiplier, self.sample_rate)
            self._accounted = plan

    def _clipped_sum(self, p: nn.Parameter) -> torch.Tensor:
        """The parameter's clipped sum in at least float32: its float32 sum (bf16/fp16), its ``.grad``, or zeros."""
        wide = self.low_precision_sums.pop(p, None)
        if wide is not None:
            return wide if p.grad is None else wide.add_(p.grad.float())
        if p.grad is not None:
            return p.grad if p.grad.dtype == torch.promote_types(p.dtype, torch.float32) else p.grad.float()
        return torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))

    def attach(self, optimizer: torch.optim.Optimizer, planner: StepPlanner) -> None:
        """Release the planner's current plan before every ``optimizer.step()``; the update rule stays stock."""
        if getattr(optimizer, "_hf_dp_mechanism", None) is not None:
            return
        optimizer._hf_dp_mechanism = self

        def release_before_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            self.release((p for group in opt.param_groups for p in group["params"]), planner.current)

        optimizer.register_step_pre_hook(release_before_step)

    def state_dict(self) -> dict:
        return {"noise": self.noise.state_dict() if self.noise is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """The noise stream of a checkpoint. The ledger comes back with it, so a release made before the restore
        (torch's optimizer-state loading under FSDP steps the optimizer once on zero gradients) is forgotten:
        the next release is accounted."""
        self._accounted = None
        if self.noise is not None and state.get("noise") is not None:
            self.noise.load_state_dict(state["noise"])


def _owned_part(total: torch.Tensor) -> torch.Tensor:
    """The part of a gradient this process owns and noises: an FSDP2 DTensor's local shard (a view), else all."""
    return total.to_local() if isinstance(total, DTensor) else total
