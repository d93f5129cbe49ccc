"""peft's LoRA on a parameter (``target_parameters``, clipping/lora_params.py): adapters on MoE experts' fused weights
and on an MoE router's weight, whose wrapper reads the adapters' weights itself. Mixtral (experts stored (E, out, in))
and GPT-OSS (stored (E, in, out), which peft does not swap), every adapter with a non-zero B so that both A's and
B's gradients are live: DP steps equal the brute-force clipped sum (one backward per example) in both clipping
modes, with activation checkpointing on one process and through ZeRO-2, and the experts' adapters never take the
torch.func fallback."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping import lora_params
from hf_dp.clipping.engine import ClippingEngine, UnsupportedModuleError
from hf_dp.clipping.experts import RoutedOuterProductSum
from hf_dp.clipping.pipeline import clipped_step
from tests import models, oracle
from tests.test_checkpointing import ONE_PROCESS, ZERO2, checkpointed_steps
from tests.test_engine import assert_close
from tests.test_routed_experts import gpt_oss

TARGETS = {
    "experts": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "mixtral_router": ["mlp.gate.weight"],
    "gpt_oss_router": ["mlp.router.weight"],
}


def lora_on_parameters(family: str, targets: str, **config) -> nn.Module:
    """The family with peft's LoRA on ``TARGETS[targets]`` alone, each B drawn non-zero (peft starts it at 0)."""
    torch.manual_seed(0)
    base = models.mixtral() if family == "mixtral" else gpt_oss()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=TARGETS[targets], **config)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    return model.float().train()


CASES = [
    ("mixtral", "experts"),
    ("mixtral", "mixtral_router"),
    ("gpt_oss", "experts"),
    ("gpt_oss", "gpt_oss_router"),
]


def _reference(model: nn.Module, batch: dict, every_example_clipped: bool) -> tuple[dict, float]:
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item() if every_example_clipped else norms.median().item()
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    assert all(reference[name].norm() > 0 for name in reference if "lora_" in name)
    return reference, max_norm


@pytest.mark.parametrize("mode", ["ghost", "per_sample"])
@pytest.mark.parametrize(("family", "targets"), CASES)
def test_a_dp_step_with_lora_on_parameters_equals_brute_force(family, targets, mode, monkeypatch) -> None:
    model = lora_on_parameters(family, targets)
    batch = models.token_batch()
    reference, max_norm = _reference(model, batch, every_example_clipped=False)
    if targets == "experts":
        monkeypatch.setattr(
            lora_params,
            "functorch_per_example_grads",
            lambda *_: pytest.fail("the experts took the fallback"),
        )
        if mode == "ghost":
            monkeypatch.setattr(RoutedOuterProductSum, "materialise", lambda *_: pytest.fail("materialised"))
    engine = ClippingEngine(model, mode=mode)
    wrappers = [m for m in engine.layers.owned if lora_params.claims_nested(m)]
    assert len(wrappers) == 2 and all(
        len(engine.layers.owned[m]) == 2 * len(TARGETS[targets]) for m in wrappers
    )
    step = clipped_step(engine, model, Backend())
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours, reference, rtol=1e-4, floor=1e-6)


@pytest.mark.parametrize("backend", ["one process", "zero2"])
@pytest.mark.parametrize(("family", "targets"), [("mixtral", "experts"), ("gpt_oss", "gpt_oss_router")])
def test_a_checkpointed_step_with_lora_on_parameters_equals_brute_force(family, targets, backend) -> None:
    """The wrapper's call tapped whole inside the backward, every example clipped, three steps."""
    model = lora_on_parameters(family, targets)
    batch = models.token_batch()
    reference, max_norm = _reference(model, batch, every_example_clipped=True)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, ONE_PROCESS if backend == "one process" else ZERO2)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=3):
        assert_close(ours, reference, rtol=1e-4, floor=1e-6)


def test_two_active_adapters_on_one_parameter_are_refused_in_one_line() -> None:
    """The chain rule holds for one adapter's factors: two active at once are refused in one line on the first
    step, before anything is released."""
    model = lora_on_parameters("mixtral", "experts")
    model.add_adapter("second", LoraConfig(r=2, target_modules=[], target_parameters=TARGETS["experts"]))
    model.base_model.set_adapter(["default", "second"])
    batch = models.token_batch()
    step = clipped_step(ClippingEngine(model), model, Backend())
    with pytest.raises(UnsupportedModuleError, match="2 active adapters") as refused:
        checkpointed_steps(model, batch, 1.0, strategy=step, steps=1)
    assert "\n" not in str(refused.value)


def test_the_fallback_log_names_a_router_s_adapters_with_the_router_s_size_and_not_the_experts() -> None:
    """The router's wrapped weight W' (E × d) is what the fallback materialises per row; the experts' adapters take
    the routed rule and are not named."""
    for targets, expected in (("experts", None), ("mixtral_router", "2 × ParamWrapper (64 floats each")):
        engine = ClippingEngine(lora_on_parameters("mixtral", targets))
        report = engine.fallback_report()
        engine.remove_hooks()
        assert report is None if expected is None else expected in report
