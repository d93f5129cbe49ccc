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
from hf_dp.backend import Backend
from hf_dp.clipping.geometry import owned_scale
from hf_dp.clipping.plan import StepPlan
from hf_dp.clipping.sums import ClippedSums
from hf_dp.distributed import sum_across_processes
from hf_dp.noise import GaussianNoise


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

    @classmethod
    def for_run(
        cls, plan, accountant: PrivacyAccountant, secret, backend: Backend, secure_mode: bool
    ) -> GaussianMechanism:
        """The mechanism of a training run: noise keyed by the run's secret, one key for all processes when
        their gradients are replicated (summed here first), one per process when they are partitioned."""
        private = plan.private
        key = secret.noise_key(backend.process_index if backend.partitioned else None)
        return cls(
            noise_multiplier=plan.noise_multiplier,
            expected_batch_size=plan.expected_batch_size,
            sample_rate=plan.sample_rate,
            noise=GaussianNoise(key, secure_mode=secure_mode) if private else None,
            accountant=accountant if private else None,
            sum_across_processes=sum_across_processes if backend.replicated else None,
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

    def release(self, params: Iterable[nn.Parameter], plan: StepPlan, sums: ClippedSums) -> None:
        """.grad ← (Σ_i c_i g_i + N(0, σ²C²/s²)) / B̄ for every trainable parameter; does not account (``account``).

        A missing clipped sum counts as zero (an empty batch still gets noise: skipping it would reveal that the
        batch was empty). A bf16/fp16 parameter's clipped sum arrives in float32 (``ClippedSums.wide``) and is
        noised in float32; only the released ĝ is cast to its dtype, which is post-processing.
        """
        params = [p for p in params if p.requires_grad]
        totals = [sums.of(p) for p in params]
        if self.sum_across_processes is not None:
            self.sum_across_processes(totals)
        std = self.sum_noise_std(plan)
        for p, total in zip(params, totals, strict=True):
            if std > 0:
                owned = _owned_part(total)  # FSDP: this process's shard; its key is its own
                noise = self.noise.sample(owned.shape, std, owned.device, owned.dtype)
                scale = plan.clip_scale.get(p) if plan.clip_scale else None
                owned.add_(noise if scale is None else noise / owned_scale(scale, total).to(noise))
            total.div_(self.expected_batch_size)
            p.grad = total if total.dtype == p.dtype else total.to(p.dtype)

    def account(self) -> None:
        """One step of the subsampled Gaussian mechanism (σ, q) in the ledger: once per released logical batch."""
        if self.private:
            self.accountant.step(self.noise_multiplier, self.sample_rate)

    def state_dict(self) -> dict:
        return {"noise": self.noise.state_dict() if self.noise is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """The noise stream of a checkpoint (the ledger comes back with the accountant)."""
        if self.noise is not None and state.get("noise") is not None:
            self.noise.load_state_dict(state["noise"])


def _owned_part(total: torch.Tensor) -> torch.Tensor:
    """The part of a gradient this process owns and noises: an FSDP2 DTensor's local shard (a view), else all."""
    return total.to_local() if isinstance(total, DTensor) else total
