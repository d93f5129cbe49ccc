"""The privatising step shared by every DP optimizer: noise once per logical batch, then normalise.

DP-SGD (Abadi et al. 2016): ĝ = (Σ_i c_i g_i + N(0, σ²C² I)) / B̄, where the engine has left the
clipped sum Σ_i c_i g_i in ``.grad`` and B̄ is the EXPECTED logical batch size (never the realised
one, which would leak the batch size). Everything after this is post-processing.
"""

from __future__ import annotations

import torch

from hf_dp.noise import GaussianNoise

STATE_KEY = "hf_dp_privatizer"


class GradientPrivatizer:
    """Runs as a step pre-hook of a torch optimizer, so the optimizer itself stays a stock one."""

    def __init__(
        self,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        noise: GaussianNoise,
    ) -> None:
        if expected_batch_size <= 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}")
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.expected_batch_size = expected_batch_size
        self.noise = noise
        self.steps = 0

    @property
    def noise_std(self) -> float:
        """Per-coordinate std of the noise on the SUM, σC."""
        return self.noise_multiplier * self.max_grad_norm

    def privatize(self, params: list[torch.nn.Parameter]) -> None:
        """.grad ← (.grad + N(0, σ²C²)) / B̄ for every trainable parameter; a missing .grad counts as zero."""
        for p in params:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.noise_std > 0:
                p.grad.add_(self.noise.sample(p.shape, self.noise_std, p.device, p.grad.dtype))
            p.grad.div_(self.expected_batch_size)
        self.steps += 1

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Privatise before every ``optimizer.step()`` and keep the noise state in its state_dict."""
        if getattr(optimizer, "_hf_dp_privatizer", None) is not None:
            return
        optimizer._hf_dp_privatizer = self

        def pre_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            self.privatize([p for group in opt.param_groups for p in group["params"]])

        def save(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
            state_dict[STATE_KEY] = self.state_dict()
            return state_dict

        def load(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
            state_dict = dict(state_dict)
            if STATE_KEY in state_dict:
                self.load_state_dict(state_dict.pop(STATE_KEY))
            return state_dict

        optimizer.register_step_pre_hook(pre_step)
        optimizer.register_state_dict_post_hook(save)
        optimizer.register_load_state_dict_pre_hook(load)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "noise": self.noise.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.noise.load_state_dict(state["noise"])
