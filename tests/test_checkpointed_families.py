"""The families added to tests/test_families.py after tests/test_model_families.py, with activation checkpointing:
a checkpointed DP step (the checked first step, then later ones with the tail skipped and, where the check allowed
it, the layers replayed or run one by one) equals brute force (one backward per example, tests/oracle.py), every
example clipped, in one process and as ZeRO-2 takes the step. ALBERT is absent: transformers gives it no activation
checkpointing. Longformer and LED are in tests/test_flattened_rows.py."""

from __future__ import annotations

import pytest
import torch

from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.pipeline import clipped_step
from tests import oracle
from tests.test_checkpointing import ONE_PROCESS, ZERO2, checkpointed_steps
from tests.test_engine import assert_close
from tests.test_families import FAMILIES, _built

# Parts of these compute in float32 whatever the model's dtype (GPT-Neo's attention scores, Cohere's and OLMo's
# LayerNorms, LongT5's local-attention softmax, FalconMamba's norms and selective scan). The checkpointed step's
# weighted pass back-propagates c_i·∂L_i through them where brute force back-propagates ∂L_i and scales after, so
# the two round differently in float32: ~1e-7 of each gradient, exact (1e-16) once those casts keep float64, and
# exact without checkpointing, whose per-example gradients come from the same unweighted backward as brute force.
FLOAT32_INSIDE = ("gpt_neo", "cohere", "olmo", "longt5", "falcon_mamba")

CHECKPOINTED_NEW = (
    "gpt_neo",
    "codegen",
    "gpt_bigcode",
    "xglm",
    "cohere",
    "olmo",
    "olmoe",
    "granitemoe",
    "qwen3_moe",
    "falcon_mamba",
    "persimmon",
    "nemotron",
    "glm",
    "mobilebert",
    "convbert",
    "roformer",
    "camembert",
    "umt5",
    "longt5",
    "mbart",
    "marian",
)


def keep_float64(monkeypatch) -> None:
    """A float64 tensor's ``.float()`` and ``.to(torch.float32)`` leave it float64 (softmax's ``dtype``:
    ``float64_throughout``)."""
    to, to_float = torch.Tensor.to, torch.Tensor.float

    def to_unless_narrowing(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    def float_unless_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to_unless_narrowing)
    monkeypatch.setattr(torch.Tensor, "float", float_unless_float64)


def test_albert_has_no_activation_checkpointing() -> None:
    """If transformers gives ALBERT checkpointing, it belongs in CHECKPOINTED_NEW."""
    build = FAMILIES["albert"][0]
    assert build().supports_gradient_checkpointing is False


def _matches_brute_force(family: str, backend: str, monkeypatch, rtol: float | None = None) -> None:
    model, batch, dtype, norms = _built(family, monkeypatch)
    max_norm = 0.5 * norms.min().item()  # every example clipped
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    model.activation_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, ONE_PROCESS if backend == "one process" else ZERO2)
    if rtol is None:
        rtol = 1e-4 if dtype == torch.float32 else 1e-6 if family in FLOAT32_INSIDE else 1e-9
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=3):
        assert_close(ours, reference, rtol=rtol, floor=1e-6)
    assert model.is_activation_checkpointing
    assert step.calibration.skips_tail is True


@pytest.mark.parametrize("backend", ["one process", "zero2"])
@pytest.mark.parametrize("family", CHECKPOINTED_NEW)
def test_a_checkpointed_step_of_each_new_family_matches_brute_force(
    family: str, backend: str, monkeypatch
) -> None:
    _matches_brute_force(family, backend, monkeypatch)


@pytest.mark.parametrize("backend", ["one process", "zero2"])
@pytest.mark.parametrize("family", FLOAT32_INSIDE)
def test_the_float32_inside_families_are_exact_once_they_keep_float64(
    family: str, backend: str, monkeypatch
) -> None:
    """Their 1e-6 is the models' float32 rounding: with those casts kept in float64, 1e-9."""
    keep_float64(monkeypatch)
    _matches_brute_force(family, backend, monkeypatch, rtol=1e-9)
