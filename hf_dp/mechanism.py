"""The Gaussian mechanism of DP-SGD: the one place where noise is added and the one place where ε is spent.

Abadi et al. 2016: ĝ = (Σ_i c_i g_i + N(0, σ²C² I)) / B̄, where the clipping strategy has left the clipped
sum Σ_i c_i g_i in ``.grad`` and B̄ is the EXPECTED logical batch size (the realised one would leak the batch
size). A plan that clips in a scaled geometry ‖s ⊙ g_i‖ ≤ C gets noise isotropic in the scaled space, std
σC/s_j on coordinate j. Each released logical batch is one step of the subsampled Gaussian mechanism
(σ, q) in the accountant; everything after the release is post-processing. See docs/dp-step.md.

``BandMFMechanism`` correlates the noise across steps (DP-BandMF, Choquette-Choo et al. 2023): the release at step
t adds x_t = (z_t − Σ_{j=1..b−1} c_j x_{t−j}) / c_0, the streaming form of C⁻¹z for a banded Toeplitz strategy C
whose largest column norm is 1; with cyclic Poisson sampling over b groups each example's columns are disjoint,
so the run is accounted as DP-SGD with ⌈n/b⌉ steps at rate p = bB̄/N. See docs/correlated-noise.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_dp.accounting import PrivacyAccountant
from hf_dp.backend import Backend
from hf_dp.bandmf import BandedToeplitz
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
        self.step = 0  # the logical batches released: t of the next release

    @classmethod
    def for_run(
        cls, plan, accountant: PrivacyAccountant, secret, backend: Backend, args
    ) -> GaussianMechanism:
        """The mechanism of a training run: noise keyed by the run's secret, one key for all processes when
        their gradients are replicated (summed here first), one per process when they are partitioned."""
        private = plan.private
        key = secret.noise_key(backend.process_index if backend.partitioned else None)
        return cls(
            noise_multiplier=plan.noise_multiplier,
            expected_batch_size=plan.expected_batch_size,
            sample_rate=plan.sample_rate,
            noise=GaussianNoise(key, secure_mode=args.secure_mode) if private else None,
            accountant=accountant if private else None,
            sum_across_processes=sum_across_processes if backend.replicated else None,
            **cls.options(plan, args),
        )

    @classmethod
    def options(cls, plan, args) -> dict:
        """The keyword arguments this mechanism takes beyond the Gaussian mechanism's."""
        return {}

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
        owned = [_owned_part(total) for total in totals]  # FSDP: this process's shard; its key is its own
        if std > 0:
            self._add_noise(params, totals, owned, std, plan)
        _divide_all(owned, self.expected_batch_size)
        for p, total in zip(params, totals, strict=True):
            p.grad = total if total.dtype == p.dtype else total.to(p.dtype)

    def _add_noise(
        self,
        params: list[nn.Parameter],
        totals: list[torch.Tensor],
        owned: list[torch.Tensor],
        std: float,
        plan: StepPlan,
    ) -> None:
        """Each owned sum += its noise (over s_j in a scaled geometry). The noise is drawn parameter by parameter in
        their order, as ever (the same stream, the same values), and added a bucket of at most
        ``_NOISE_BUCKET_FLOATS`` at a time: one launch a bucket on CUDA, the drawn noise alive a bucket at a time."""
        parts: list[torch.Tensor] = []
        noises: list[torch.Tensor] = []
        floats = 0
        for p, total, part in zip(params, totals, owned, strict=True):
            noise = self.noise_for(part, std)
            scale = plan.clip_scale.get(p) if plan.clip_scale else None
            parts.append(part)
            noises.append(noise if scale is None else noise / owned_scale(scale, total).to(noise))
            floats += part.numel()
            if floats >= _NOISE_BUCKET_FLOATS:
                _add_all(parts, noises)
                parts, noises, floats = [], [], 0
        _add_all(parts, noises)

    def noise_for(self, owned: torch.Tensor, std: float) -> torch.Tensor:
        """The noise added to one owned clipped sum (in the plan's scaled space): fresh N(0, std²)."""
        return self.noise.sample(owned.shape, std, owned.device, owned.dtype)

    def account(self) -> None:
        """One step of the subsampled Gaussian mechanism (σ, q) in the ledger: once per released logical batch."""
        if self.private:
            self.accountant.step(self.noise_multiplier, self.sample_rate)

    def end_step(self) -> None:
        """The logical batch's release is complete (all of its parameter groups)."""
        self.step += 1

    def state_dict(self) -> dict:
        return {"noise": self.noise.state_dict() if self.noise is not None else None, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """The noise stream and the step of a checkpoint (the ledger comes back with the accountant)."""
        if self.noise is not None and state.get("noise") is not None:
            self.noise.load_state_dict(state["noise"])
        self.step = int(state["step"])


class BandMFMechanism(GaussianMechanism):
    """DP-BandMF (Choquette-Choo et al. 2023): x_t = (z_t − Σ_{j=1..b−1} c_j x_{t−j}) / c_0, z_t ~ N(0, σ²C²I).

    Keeps, for every owned clipped sum, its b − 1 previous noise outputs (float32, or the parameter's dtype if
    wider): they are noise, as secret as the key, and live only in the checkpoint's private noise state. The
    ledger takes one DP-SGD step at rate p every b releases (steps 0, b, 2b, …): the most any example of a cyclic
    Poisson group can take part in. The owned sums of one release are told apart by their order, which the
    optimizer's parameter groups fix (ZeRO-3 releases its sub-groups one after the other within a step).
    """

    def __init__(self, *, strategy: BandedToeplitz, buffers_on_cpu: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.coefs = strategy.coefs
        self.bands = strategy.bands
        self.buffers_on_cpu = buffers_on_cpu
        self._past: list[list[torch.Tensor]] = []  # per owned sum: x_{t−1}, x_{t−2}, … (at most b − 1)
        self._slot = 0  # the next owned sum of this release

    @classmethod
    def options(cls, plan, args) -> dict:
        return {"strategy": plan.strategy, "buffers_on_cpu": args.bandmf_buffers_on_cpu}

    def noise_for(self, owned: torch.Tensor, std: float) -> torch.Tensor:
        work = torch.promote_types(owned.dtype, torch.float32)
        x = self.noise.sample(owned.shape, std, owned.device, work)
        if self.bands == 1:
            return x.to(owned.dtype)
        if self._slot == len(self._past):
            self._past.append([])
        past = self._past[self._slot]
        self._slot += 1
        if past and past[0].shape != owned.shape:
            raise RuntimeError(
                f"hf_dp: the correlated noise of a {tuple(past[0].shape)} gradient was kept, a {tuple(owned.shape)} one "
                "is released in its place: the trainable parameters changed during the run; keep them fixed"
            )
        home = torch.device("cpu") if self.buffers_on_cpu else x.device
        past[:] = [t.to(home) for t in past]  # a no-op but after loading a checkpoint
        for c, previous in zip(self.coefs[1:], past, strict=False):
            x.sub_(previous.to(x.device, non_blocking=True), alpha=c)
        x.div_(self.coefs[0])
        if len(past) == self.bands - 1:
            kept = past.pop()
            kept.copy_(x)
        else:
            kept = x.to(home, copy=True)
        past.insert(0, kept)
        return x.to(owned.dtype)

    def account(self) -> None:
        if self.private and self.step % self.bands == 0:
            self.accountant.step(self.noise_multiplier, self.sample_rate)

    def end_step(self) -> None:
        super().end_step()
        self._slot = 0

    def buffer_bytes(self) -> int:
        """The memory of the kept noise: (b − 1) × owned trainable parameters × 4 bytes in float32."""
        return sum(t.numel() * t.element_size() for past in self._past for t in past)

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "coefs": list(self.coefs),
            "past": [[t.detach().cpu() for t in past] for past in self._past],
        }

    def load_state_dict(self, state: dict) -> None:
        """The stream, the step and the kept noise of a checkpoint: the run continues the same noise sequence."""
        super().load_state_dict(state)
        if "past" not in state or list(state["coefs"]) != list(self.coefs):
            raise ValueError(
                "hf_dp: the checkpoint's noise state is not this run's BandMF strategy (another mechanism or other "
                "coefficients); resume with the checkpoint's noise_mechanism and num_bands"
            )
        self._slot = 0
        self._past = [[t.clone() for t in past] for past in state["past"]]


# The registry of noise mechanisms, by the name DPTrainingArguments.noise_mechanism takes (register_noise_mechanism).
NOISE_MECHANISMS: dict[str, type[GaussianMechanism]] = {}


def register_noise_mechanism(name: str, mechanism: type[GaussianMechanism]) -> None:
    """Make ``noise_mechanism=name`` build ``mechanism`` (``for_run``; its ``options`` reads its arguments)."""
    if name in NOISE_MECHANISMS:
        raise ValueError(f"noise mechanism {name!r} is already registered; pick another name")
    NOISE_MECHANISMS[name] = mechanism


register_noise_mechanism("independent", GaussianMechanism)
register_noise_mechanism("bandmf", BandMFMechanism)


def noise_mechanism_of(name: str) -> type[GaussianMechanism]:
    """The registered mechanism ``name``, or a one-line refusal naming the known ones."""
    if name not in NOISE_MECHANISMS:
        raise ValueError(f"noise_mechanism={name!r} is unknown; use one of {list(NOISE_MECHANISMS)}")
    return NOISE_MECHANISMS[name]


# Drawn noise waits for its addition in buckets of at most this many floats (256 MB in float32) beyond the last draw.
_NOISE_BUCKET_FLOATS = 64 * 1024 * 1024


def _add_all(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    """t += o for each pair, as ``t.add_(o)`` adds them one at a time; one launch on CUDA for tensors of one dtype."""
    if tensors:
        torch._foreach_add_(tensors, others)


def _divide_all(tensors: list[torch.Tensor], divisor: float) -> None:
    """t /= divisor for each t: one launch per device and dtype on CUDA (on CPU, ``div_`` on each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for group in groups.values():
        torch._foreach_div_(group, divisor)


def _owned_part(total: torch.Tensor) -> torch.Tensor:
    """The part of a gradient this process owns and noises: an FSDP2 DTensor's local shard (a view), else all."""
    return total.to_local() if isinstance(total, DTensor) else total
