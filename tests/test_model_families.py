"""The decoder families people fine-tune, each tiny and in float64: a checkpointed DP step (the checked first step,
then the tail skipped and the layers run one by one where the check allowed it) equals brute force, one backward
per example, in one process and as ZeRO-2 takes the step (what it hands DeepSpeed, back-propagated as its backward
would)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.rules import is_rms_norm
from tests import models
from tests.test_checkpointing import ONE_PROCESS, ZERO2, checkpointed_steps
from tests.test_engine import assert_close

# name: (config class, model class, fields beyond models.DECODER_SIZES, whether its layers run one by one)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}, True),  # x̂ ⊙ (1 + w), √d-scaled embeddings
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}, True),  # q_norm, k_norm on the heads
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, True),  # fused qkv and gate_up projections
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}, True),  # post-norms, soft-capping
    # q_norm and k_norm (per head) follow all three projections: no points, their weights go with the attention's
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}, True),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, True),  # norms after attention and MLP
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}, True),  # scaled residuals and logits
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, True),
    "phi": ("PhiConfig", "PhiForCausalLM", {}, True),  # attention and MLP in parallel from one norm
    # parallel residual: the attention reaches the output around the second norm's input, so the layers chain
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, False),
}


def float64_throughout(model: nn.Module, monkeypatch) -> None:
    """These RMSNorms, and eager attention's softmax (Gemma 2), compute in float32 whatever the model's dtype; each
    norm class's forward is replaced by the same function in the input's dtype (checked against the original in
    float32 first), and a float64 softmax stays float64, so that brute force and the step can be compared to 1e-9."""
    softmax = torch.nn.functional.softmax

    def float64_softmax(x: torch.Tensor, *args, dtype: torch.dtype | None = None, **kwargs) -> torch.Tensor:
        return softmax(x, *args, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", float64_softmax)
    for cls in {type(m) for m in model.modules() if is_rms_norm(m)}:
        offset = "Gemma" in cls.__name__  # x̂ ⊙ (1 + w)

        def forward(self, x: torch.Tensor, offset: bool = offset) -> torch.Tensor:
            eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
            x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return x_hat * (1.0 + self.weight) if offset else self.weight * x_hat

        probe = copy.deepcopy(next(m for m in model.modules() if type(m) is cls)).float()
        x = torch.randn(3, 4, probe.weight.shape[0])
        with torch.no_grad():
            probe.weight.normal_()  # Gemma's start at 0, which would hide a missing 1 + w
            torch.testing.assert_close(forward(probe, x), cls.forward(probe, x), rtol=1e-5, atol=1e-6)
        monkeypatch.setattr(cls, "forward", forward)


@pytest.mark.parametrize("backend", ["one process", "zero2"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_checkpointed_step_of_each_family_matches_brute_force(
    monkeypatch, family: str, backend: str
) -> None:
    config_class, model_class, fields, layerwise = FAMILIES[family]
    config = getattr(transformers, config_class)(**models.DECODER_SIZES, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    float64_throughout(model, monkeypatch)
    model = model.double().train()
    batch = models.token_batch()
    _, norms = models.brute_force(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()  # every example clipped
    reference, _ = models.brute_force(model, batch, max_norm=max_norm)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, ONE_PROCESS if backend == "one process" else ZERO2)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=3):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    assert step.calibration.skips_tail is True
    assert step.calibration.layerwise is layerwise
