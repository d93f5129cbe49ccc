"""peft's other methods on a tiny Llama: each exact against brute force (float64, both clipping modes, some
examples clipped), or refused in one line: before training where the method cannot work (multitask prompt tuning,
BOFT; DoRA, p-tuning and prefix tuning under checkpointing), at the first step where an adapter's parameter read
outside its module inside an activation checkpoint is recomputed otherwise (IA3, VeRA, LoKr, AdaLoRA, HRA)."""

from __future__ import annotations

import peft
import pytest
import torch
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.errors import UnsupportedModuleError
from hf_dp.clipping.pipeline import clipped_step
from tests import models, oracle
from tests.test_checkpointing import checkpointed_steps
from tests.test_engine import assert_close
from tests.test_model_families import float64_throughout
from tests.trainer_utils import make_trainer

ATTENTION = ["q_proj", "v_proj"]
EXACT = {
    "ia3": lambda: peft.IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
    ),
    "lokr": lambda: peft.LoKrConfig(r=2, alpha=4, target_modules=ATTENTION),
    "vera": lambda: peft.VeraConfig(r=4, target_modules=ATTENTION),
    "adalora": lambda: peft.AdaLoraConfig(r=2, target_modules=ATTENTION, total_step=10),
    "oft": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=ATTENTION),
    "hra": lambda: peft.HRAConfig(r=2, target_modules=ATTENTION),
    "ln_tuning": lambda: peft.LNTuningConfig(target_modules=["input_layernorm"]),
    "prefix_tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    "dora": lambda: peft.LoraConfig(r=2, target_modules=ATTENTION, use_dora=True),
    "lora_embedding": lambda: peft.LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]),
    "p_tuning": lambda: peft.PromptEncoderConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=8
    ),
}
CHECKPOINTED = (
    "oft",
    "ln_tuning",
    "prompt_tuning",
    "lora_embedding",
)  # the others read an adapter's parameter outside its module (refused below)


def adapted(config: peft.PeftConfig, monkeypatch) -> nn.Module:
    torch.manual_seed(0)
    model = models.llama()
    float64_throughout(model, monkeypatch)
    model = peft.get_peft_model(model, config)
    for param in model.parameters():
        if param.requires_grad:
            nn.init.normal_(param, std=0.1)  # several adapters start at zero or identity: trivial gradients
    return model.to(torch.float64).train()


@pytest.mark.parametrize(
    ("method", "mode", "checkpointing"),
    [(method, mode, False) for method in EXACT for mode in ("ghost", "per_sample")]
    + [(method, "ghost", True) for method in CHECKPOINTED],
)
def test_a_dp_step_with_each_peft_method_equals_brute_force(method, mode, checkpointing, monkeypatch):
    model = adapted(EXACT[method](), monkeypatch)
    batch = models.token_batch()
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = norms.median().item()  # some examples clipped, some not
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    assert reference
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model, mode=mode), model, Backend(checkpointing=checkpointing))
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)


@pytest.mark.parametrize("method", ["ia3", "vera", "lokr", "adalora", "hra"])
def test_an_adapter_read_outside_its_module_inside_a_checkpoint_is_refused(method, monkeypatch):
    # its recomputation read the parameter itself where the first forward read it broadcast to the batch: was
    # torch's CheckpointError, 60 lines deep (DeBERTa-v3's relative embeddings, read so, recompute alike and pass)
    model = adapted(EXACT[method](), monkeypatch)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, Backend(checkpointing=True))
    with pytest.raises(
        UnsupportedModuleError,
        match=r"recomputed other tensors than its forward saved, where trainable parameters are read outside the forward of the module that owns them \(base_model\.model",
    ):
        checkpointed_steps(model, models.token_batch(), 1.0, strategy=step, steps=1)


@pytest.mark.parametrize(
    ("config", "checkpointing", "message"),
    [
        (
            peft.MultitaskPromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, num_tasks=2),
            False,
            r"MULTITASK_PROMPT_TUNING has no per-example gradients in hf_dp",
        ),
        (
            peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=8),
            True,
            r"P_TUNING with activation checkpointing: its prompt encoder's output",
        ),
        (
            peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
            True,
            r"PREFIX_TUNING with activation checkpointing",
        ),
        (
            peft.LoraConfig(r=2, target_modules=ATTENTION, use_dora=True),
            True,
            r"DoRA with activation checkpointing: its weight norm reads the adapters on an identity matrix",
        ),
        (
            peft.BOFTConfig(boft_block_size=4, target_modules=ATTENTION),
            False,
            r"BOFT forms the adapted weight",
        ),
    ],
    ids=[
        "multitask_prompt_tuning",
        "p_tuning_checkpointed",
        "prefix_tuning_checkpointed",
        "dora_checkpointed",
        "boft",
    ],
)
def test_a_peft_method_without_per_example_gradients_is_refused_before_training(
    tmp_path, config, checkpointing, message
):
    # before: "freeze lora_A" (DoRA), a bmm size error (BOFT), a CheckpointError (prefix tuning)
    model = peft.get_peft_model(models.llama(), config)
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, model=model, noise_multiplier=1.0, gradient_checkpointing=checkpointing)


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning"])
def test_virtual_tokens_predict_nothing_as_in_peft_s_own_loss(method: str, monkeypatch, tmp_path) -> None:
    """Prompt tuning and p-tuning put num_virtual_tokens prompts before each row; peft labels them -100 in its own
    loss, and so does the per-example loss: its token-weighted mean is peft's loss. A DP trainer step runs (the
    first step's checks included)."""
    from hf_dp.losses import per_example_loss

    model = adapted(EXACT[method](), monkeypatch)
    batch = models.token_batch()
    ours = per_example_loss(model, dict(batch))
    counted = (batch["labels"] != -100).sum(dim=1)  # the last virtual token predicts the first label too
    # transformers' causal-LM loss casts the logits to float32
    torch.testing.assert_close(((ours * counted).sum() / counted.sum()).float(), model(**batch).loss)
    trainer = make_trainer(tmp_path, model=model.float(), noise_multiplier=1.0, max_steps=1)
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_dora_trainer_step_runs_and_dora_is_refused_with_group_wise_clipping(monkeypatch, tmp_path) -> None:
    """DoRA's magnitude takes the torch.func fallback and its adapters their linear rules (exact above); its weight
    norm's read of the adapters on an identity matrix gets no gradient (peft detaches it) and is let be."""
    model = adapted(EXACT["dora"](), monkeypatch).float()
    trainer = make_trainer(tmp_path, model=model, noise_multiplier=1.0, max_steps=1)
    trainer.train()
    assert trainer.state.global_step == 1
    with pytest.raises(ValueError, match="DoRA with group-wise clipping") as info:
        make_trainer(tmp_path / "groups", model=model, noise_multiplier=1.0, clipping_groups="layer")
    assert "\n" not in str(info.value)


def test_dora_through_zero2_equals_brute_force(monkeypatch) -> None:
    """The clipped sums handed to DeepSpeed ZeRO-2 as terms linear in each parameter, back-propagated as its engine
    would (tests/test_checkpointing.step_sums)."""
    from dataclasses import replace

    from tests.test_checkpointing import ZERO2

    model = adapted(EXACT["dora"](), monkeypatch)
    batch = models.token_batch()
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = norms.median().item()
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    backend = replace(ZERO2, checkpointing=False)
    step = clipped_step(ClippingEngine(model), model, backend)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)


def test_lora_on_an_embedding_leaves_the_padding_row_without_gradient(monkeypatch) -> None:
    """peft's LoRA on an embedding reads its A itself (``F.embedding(ids, A.T)``, a table shared by all examples):
    it is indexed per example (shared_outputs._shared_embedding), and the padding row, which F.embedding leaves
    without gradient, stays so where an example attends to a padding id and learns from it."""
    model = adapted(EXACT["lora_embedding"](), monkeypatch)
    batch = models.token_batch()
    assert model.get_base_model().model.embed_tokens.base_layer.padding_idx == models.PAD
    batch["input_ids"][:, 1] = models.PAD  # attended, and predicted from
    batch["attention_mask"][:, 1] = 1
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = norms.median().item()
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    name = next(n for n in reference if "lora_embedding_A" in n)
    assert reference[name][:, models.PAD].abs().max() == 0 and reference[name].abs().max() > 0
    step = clipped_step(ClippingEngine(model), model, Backend())
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
