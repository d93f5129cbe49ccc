"""peft LoRA through DPTrainer: only the adapters (and a modules_to_save head) are trained, clipped and
noised, and the trained adapters save, load into a fresh base and merge with unchanged outputs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from torch import nn
from torch.utils.data import Dataset

from hf_dp.clipping.engine import ClippingEngine
from hf_dp.losses import per_example_loss
from tests import models, oracle
from tests.engine_steps import per_example_norms
from tests.trainer_utils import TokenRows, make_trainer, pad_collate, snapshot

BASE_SEED = 11


class LabelledRows(TokenRows):
    """TokenRows with a sequence label (i mod 2) for the classifier."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "label": i % 2}


def classification_collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    batch = pad_collate(examples)
    batch["labels"] = torch.tensor([e["label"] for e in examples])
    return batch


def gpt2_base() -> nn.Module:
    torch.manual_seed(BASE_SEED)
    return models.gpt2()


def bert_base() -> nn.Module:
    torch.manual_seed(BASE_SEED)
    return models.bert_classifier(num_labels=2)


def gpt2_lora(base: nn.Module) -> nn.Module:
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=4,
        lora_alpha=8,
        target_modules=["c_attn", "c_proj"],
        lora_dropout=0.0,
        fan_in_fan_out=True,
    )
    return get_peft_model(base, config)


def bert_lora(base: nn.Module) -> nn.Module:
    """SEQ_CLS puts the classifier head in modules_to_save: a trainable copy, saved with the adapters."""
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0
    )
    return get_peft_model(base, config)


CASES: dict[str, tuple[Callable, Callable, Dataset, Callable]] = {
    "gpt2": (gpt2_base, gpt2_lora, TokenRows(32), pad_collate),
    "bert_classifier": (bert_base, bert_lora, LabelledRows(32), classification_collate),
}


def is_adapter(name: str) -> bool:
    return "lora_" in name or "modules_to_save" in name


@pytest.fixture(params=list(CASES), scope="module")
def trained(request, tmp_path_factory):
    """A LoRA model trained 3 DP steps (ε = 8) and its trainer, with the parameters before training."""
    base, wrap, dataset, collate = CASES[request.param]
    model = wrap(base())
    before = snapshot(model)
    tmp_path = tmp_path_factory.mktemp(request.param)
    trainer = make_trainer(tmp_path, dataset=dataset, model=model, target_epsilon=8.0, max_steps=3)
    trainer.data_collator = collate
    trainer.train()
    return request.param, trainer, before


def test_only_adapters_are_trainable_clipped_and_optimised(trained):
    _, trainer, _ = trained
    named = dict(trainer.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert {id(named[n]) for n in trainable} == {id(p) for p in trainer.dp.engine.parameters}
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(named[n]) for n in trainable}


def test_frozen_weights_are_bit_identical_and_get_no_noise(trained):
    """Exactly the adapters train (every LoRA matrix and modules_to_save copy moves, nothing else does)."""
    _, trainer, before = trained
    after = dict(trainer.model.named_parameters())
    for name, param in after.items():
        assert param.requires_grad == is_adapter(name), name
        if param.requires_grad:
            assert not torch.equal(param, before[name]), f"{name} did not train"
        else:
            assert torch.equal(param, before[name]), f"frozen {name} changed"
            assert param.grad is None, f"frozen {name} received a gradient (or noise)"


def _all_parameter_norms(model: nn.Module, batch: dict) -> torch.Tensor:
    """‖∇L_i‖ over EVERY parameter, frozen ones included: what the clipping must NOT use."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    try:
        return oracle.per_example(model, batch, max_norm=1e9)[1]
    finally:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)


def test_clipped_norms_involve_only_the_adapters(trained):
    name, trainer, _ = trained
    model = trainer.model
    engine = ClippingEngine(model)  # the trainer's own engine left the model when training ended
    batch = models.classification_batch(2) if name == "bert_classifier" else models.token_batch()
    model.eval()
    with engine.record(batch["input_ids"].shape[0]):
        losses = per_example_loss(model, batch)
    norms = per_example_norms(engine, [(engine.per_example_gradients(losses), 1.0)])
    _, adapter_norms = oracle.per_example(model, batch, max_norm=1e9)
    torch.testing.assert_close(norms, adapter_norms.to(norms), rtol=1e-4, atol=1e-7)
    assert (_all_parameter_norms(model, batch) > 1.01 * adapter_norms).all()


def _outputs(model: nn.Module, batch: dict) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return model(**inputs).logits


def test_adapters_save_load_into_a_fresh_base_and_merge(trained, tmp_path):
    name, trainer, _ = trained
    base, _, _, _ = CASES[name]
    batch = models.classification_batch(2) if name == "bert_classifier" else models.token_batch()
    expected = _outputs(trainer.model, batch)
    trainer.model.save_pretrained(tmp_path / "adapter")
    assert (Path(tmp_path) / "adapter" / "adapter_model.safetensors").is_file()

    fresh = base()
    if name == "bert_classifier":  # a different head, so the saved modules_to_save copy must replace it
        torch.manual_seed(123)
        fresh.classifier.reset_parameters()
    assert not torch.allclose(_outputs(fresh, batch), expected)
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    torch.testing.assert_close(_outputs(loaded, batch), expected, rtol=0, atol=0)

    merged = loaded.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_outputs(merged, batch), expected, rtol=1e-5, atol=1e-6)


def test_float32_adapters_on_a_bf16_base_train_with_float32_arguments(tmp_path):
    # peft's default: adapters in float32 on a bf16 base; the first step's sum check took float32's tolerance from
    # the adapters' outputs and refused the 0.14% of the base's bf16 backward as "gradient from outside the forward"
    torch.manual_seed(0)
    base = models.gpt2().to(torch.bfloat16)
    model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    )
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    trainer = make_trainer(tmp_path, model=model, noise_multiplier=1.0)
    trainer.train()
    assert trainer.state.global_step == 2
