"""The privatising step shared by every DP optimizer: noise once per logical batch, then normalise.

DP-SGD (Abadi et al. 2016): ĝ = (Σ_i c_i g_i + N(0, σ²C² I)) / B̄, where the engine has left the
clipped sum Σ_i c_i g_i in ``.grad`` and B̄ is the EXPECTED logical batch size (never the realised
one, which would leak the batch size). Everything after this is post-processing.

A step plan (``hf_dp.optim.plan``) may change C for the step (DP²'s phases) and clip in a scaled
geometry ‖s ⊙ g_i‖ ≤ C (scale-then-privatize, DP²): the noise is then isotropic in the scaled space,
i.e. std σC/s_j on coordinate j of the un-scaled sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_dp.clipping.scale import dense_scale
from hf_dp.noise import GaussianNoise
from hf_dp.optim.plan import StepPlan


class GradientPrivatizer:
    """Runs as a step pre-hook of a torch optimizer, so the optimizer itself stays a stock one."""

    def __init__(
        self,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        noise: GaussianNoise,
        sum_across_processes: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        if expected_batch_size <= 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}")
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.expected_batch_size = expected_batch_size
        self.noise = noise
        self.sum_across_processes = sum_across_processes
        self.steps = 0
        self.plan: StepPlan | None = None  # set by the trainer for each logical batch

    @property
    def clip_norm(self) -> float:
        return self.plan.clip_norm if self.plan is not None else self.max_grad_norm

    @property
    def noise_std(self) -> float:
        """Per-coordinate std of the noise on the SUM, σC (in the scaled space if the plan scales)."""
        return self.noise_multiplier * self.clip_norm

    def privatize(self, params: list[torch.nn.Parameter]) -> None:
        """.grad ← (.grad + N(0, σ²C²)) / B̄ for every trainable parameter; a missing .grad counts as zero.

        Under DDP the per-process clipped sums are first summed across processes (``sum_across_processes``)
        and every process then adds the SAME noise (same seed), so the replicas stay identical.
        """
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.sum_across_processes is not None:
            self.sum_across_processes([p.grad for p in params])
        for p in params:
            if self.noise_std > 0:
                noise = self.noise.sample(p.shape, self.noise_std, p.device, p.grad.dtype)
                scale = self.plan.clip_scale.get(p) if self.plan and self.plan.clip_scale else None
                p.grad.add_(noise if scale is None else noise / dense_scale(scale).to(noise))
            p.grad.div_(self.expected_batch_size)
        self.steps += 1

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Privatise before every ``optimizer.step()`` (the trainer keeps the noise state in checkpoints)."""
        if getattr(optimizer, "_hf_dp_privatizer", None) is not None:
            return
        optimizer._hf_dp_privatizer = self

        def pre_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            self.privatize([p for group in opt.param_groups for p in group["params"]])

        optimizer.register_step_pre_hook(pre_step)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "noise": self.noise.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.noise.load_state_dict(state["noise"])
