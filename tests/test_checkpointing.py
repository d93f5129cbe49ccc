"""Activation checkpointing with exact per-example clipping: the norms come from inside a first backward.

Compared with brute force (one backward per example, checkpointing off) in float64, for HF's reentrant and
non-reentrant checkpointing and for a model checkpointed by its user with torch.utils.checkpoint.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine, UnsupportedModuleError
from hf_dp.clipping.layerwise import LayerPoints
from hf_dp.clipping.pipeline import Calibration, clipped_step
from hf_dp.clipping.plan import Evaluation, Shift, StepPlan
from hf_dp.clipping.sum_passes import BodySum
from hf_dp.losses import per_example_loss, unwrap_model
from tests import models
from tests.test_clipping_geometry import factored_scales
from tests.test_engine import _SideUse, assert_close
from tests.trainer_utils import make_trainer, snapshot


def llama_lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        models.llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    )


MODELS = {
    "gpt2_tied": (models.gpt2, lambda: models.token_batch()),
    "bert_classifier": (models.bert_classifier, lambda: models.classification_batch(3)),
    "roberta_classifier": (models.roberta_classifier, lambda: models.classification_batch(2, pad=1)),
    "llama": (models.llama, lambda: models.token_batch()),
    "llama_lora": (llama_lora, lambda: models.token_batch()),
    "gemma": (models.gemma, lambda: models.token_batch()),  # x̂ ⊙ (1 + w) norms, √d-scaled tied embeddings
}


@pytest.fixture(autouse=True)
def float64_rms_norm(monkeypatch):
    """HF's LlamaRMSNorm and GemmaRMSNorm compute in float32 whatever the model's dtype; in float64 here, so
    that a float64 Llama or Gemma is float64 throughout and brute force can be compared to 1e-9 (our RMSNorm
    rule runs the module's own forward, so it follows)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def gemma_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._norm(hidden_states) * (1.0 + self.weight)

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)
    monkeypatch.setattr(GemmaRMSNorm, "forward", gemma_forward)


def step_sums(strategy, model, losses_of, mask, plan) -> dict[str, torch.Tensor]:
    """One micro-batch through ``strategy``, its clipped sum per name. Where the step hands a framework what to
    back-propagate, this runs it as DeepSpeed's backward would (× W, which the framework's mean removes)."""
    model.zero_grad(set_to_none=True)
    step = strategy.run(losses_of, mask, plan, model)
    world = 1
    if step.backward is not None:
        step.backward.backward()
        world = strategy.backend.world_size
    sums = {n: p.grad.double() / world for n, p in model.named_parameters() if p.requires_grad}
    strategy.check_untouched()  # what the release does before the gradients are consumed
    return sums


def checkpointed_steps(
    model, batch, max_norm, plan=None, strategy=None, loss_fn=per_example_loss, steps=2, forwards=None
) -> list[dict[str, torch.Tensor]]:
    """The micro-batch through the book-keeping strategy with norms in the backward, ``steps`` times: the first
    step checks (two whole passes), later ones skip the tail where the check allowed it. Each step's clipped sum
    per name; ``forwards`` (a list) gets each step's number of forwards."""
    engine = strategy.engine if strategy else ClippingEngine(model)
    strategy = strategy or clipped_step(engine, model, Backend(checkpointing=True))
    mask = torch.ones(batch["input_ids"].shape[0])
    sums, calls = [], []

    def losses_of(module):
        calls.append(None)
        return loss_fn(module, batch)

    for _ in range(steps):
        before = len(calls)
        sums.append(step_sums(strategy, model, losses_of, mask, plan or StepPlan(max_norm)))
        if forwards is not None:
            forwards.append(len(calls) - before)
    engine.remove_hooks()
    return sums


ONE_PROCESS, ZERO2 = Backend(checkpointing=True), Backend(world_size=2, zero_stage=2, checkpointing=True)


def steps_match_brute_force(
    model, batch, reentrant: bool, steps: int = 3, forwards=None, backend: Backend = ONE_PROCESS
):
    """Brute force's clipped sum at half the smallest example norm (every example clipped), then ``steps``
    checkpointed steps of one strategy, each equal to it to 1e-9; the strategy, for what its first step decided."""
    _, norms = models.brute_force(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = models.brute_force(model, batch, max_norm=max_norm)
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    strategy = clipped_step(ClippingEngine(model), model, backend)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=strategy, steps=steps, forwards=forwards):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    return strategy


def checkpointed_step(model, batch, max_norm, **kwargs) -> dict[str, torch.Tensor]:
    """One micro-batch, one (first, checked) step."""
    return checkpointed_steps(model, batch, max_norm, steps=1, **kwargs)[0]


def framework_steps(model, batch, max_norm, backend, **kwargs):
    """``checkpointed_steps`` with the step of ``backend``; the sums, and the step."""
    strategy = clipped_step(ClippingEngine(model), model, backend)
    return checkpointed_steps(model, batch, max_norm, strategy=strategy, **kwargs), strategy


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_checkpointed_clipped_sum_matches_brute_force(name: str, reentrant: bool) -> None:
    build, make_batch = MODELS[name]
    model = build().double().train()  # HF checkpoints only in training mode; dropout is off in these models
    batch = make_batch()
    _, norms = models.brute_force(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()  # every example clipped
    reference, _ = models.brute_force(model, batch, max_norm=max_norm)
    unwrap_model(model).activation_checkpointing_enable({"use_reentrant": reentrant})
    assert unwrap_model(model).is_activation_checkpointing
    for ours in checkpointed_steps(model, batch, max_norm):  # the checked first step, then the tail skipped
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)


def test_checkpointed_scaled_geometry_matches_brute_force() -> None:
    """Scale-then-privatize and DP² clip ‖s ⊙ g_i‖: the scale is folded into each layer's norm in the backward."""
    torch.manual_seed(0)
    model = models.llama().double().train()
    batch = models.token_batch()
    scale = factored_scales(model)
    reference, _ = models.brute_force_combined(model, batch, 0.3, scale=scale)
    model.activation_checkpointing_enable({"use_reentrant": False})
    for ours in checkpointed_steps(model, batch, 0.3, plan=StepPlan(0.3, clip_scale=scale)):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)


class _UserCheckpointed(nn.Module):
    """A model its user checkpointed by hand, block by block, with a tied input/output embedding."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Embedding(models.VOCAB, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2)
        )
        self.head = nn.Linear(8, models.VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            if self.reentrant is None:
                h = h + block(h)
            else:
                h = h + torch_checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _next_token_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Per-example mean next-token cross-entropy, in the model's own dtype."""
    logits, labels = model(batch["input_ids"])[:, :-1], batch["labels"][:, 1:]
    losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
    return losses.sum(dim=1) / (labels != -100).sum(dim=1)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_checkpointed_by_its_user_is_detected_and_exact(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = _UserCheckpointed(None).double()  # brute force runs it without checkpoints
    batch = models.token_batch()
    reference, norms = models.brute_force(model, batch, max_norm=0.5, loss_fn=_next_token_loss)
    assert norms.min() > 0.5
    model.reentrant = reentrant
    engine = ClippingEngine(model)
    strategy = clipped_step(engine, model, Backend())  # nothing told it about checkpointing
    for ours in checkpointed_steps(model, batch, 0.5, strategy=strategy, loss_fn=_next_token_loss):
        assert engine.saw_checkpointing and strategy.norms_in_backward
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    assert strategy.calibration.skips_tail  # the tied head


def _live_inner_inputs(model, engine, batch, checkpointing: bool) -> tuple[int, int]:
    """How many inputs of the decoder layers' Linear modules are still alive after the forward of a norm pass."""
    refs = []
    handles = [
        module.register_forward_hook(lambda m, args, out: refs.append(weakref.ref(args[0])))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in name
    ]
    if checkpointing:
        with engine.norms_in_backward(batch["input_ids"].shape[0]) as collector:
            losses = per_example_loss(model, batch)
            collector.begin_backward()
            gc.collect()
            alive = sum(r() is not None for r in refs)
            losses.sum().backward()
    else:
        with engine.record(batch["input_ids"].shape[0]):
            losses = per_example_loss(model, batch)
        gc.collect()
        alive = sum(r() is not None for r in refs)
    for handle in handles:
        handle.remove()
    return alive, len(refs)


def test_the_norm_pass_keeps_no_checkpointed_activation_alive() -> None:
    """Book-keeping keeps every layer input until its single backward; with checkpointing the inputs of the
    checkpointed layers are gone after the forward (the taps save them through autograd, which drops them)."""
    model = models.llama().train()
    batch = models.token_batch(batch=4, length=16)
    engine = ClippingEngine(model)
    alive, total = _live_inner_inputs(model, engine, batch, checkpointing=False)
    assert total > 0 and alive == total  # the check can fail: book-keeping holds them
    model.activation_checkpointing_enable({"use_reentrant": False})
    alive, total = _live_inner_inputs(model, engine, batch, checkpointing=True)
    assert total > 0 and alive == 0


@pytest.mark.parametrize("bf16", [False, True])
def test_a_parameter_used_outside_its_module_is_caught_with_checkpointing(bf16: bool) -> None:
    """Also under bf16 autocast, where the check allows the two passes' rounding (5% of the gradient)."""
    torch.manual_seed(0)
    model = _SideUse() if bf16 else _SideUse().double()
    batch = {"input_ids": torch.randn(3, 4, dtype=torch.float32 if bf16 else torch.float64)}
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
        pytest.raises(UnsupportedModuleError, match="head.weight gets gradient from outside"),
    ):
        checkpointed_step(model, batch, 1.0, loss_fn=lambda m, b: m(b["input_ids"]).float().pow(2).sum(dim=1))


def test_a_plan_the_table_lacks_is_an_internal_error_that_names_it() -> None:
    """Shifted evaluations need book-keeping's norms: DPTrainer refuses them with checkpointing before training
    (test_disk_with_activation_checkpointing_is_refused_before_training); a step asked anyway names the key."""
    model = models.llama().double().train()
    shift = Shift(0.1, {p: torch.zeros_like(p) for p in model.parameters()})
    plan = StepPlan(1.0, evaluations=(Evaluation(0.5, shift), Evaluation(0.5)))
    with pytest.raises(
        RuntimeError, match="internal error.*norms in backward True, need 'several evaluations'"
    ) as info:
        checkpointed_step(model, models.token_batch(), 1.0, plan=plan)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}])
def test_trainer_with_activation_checkpointing_takes_the_same_step(tmp_path, kwargs) -> None:
    """DPTrainer(activation_checkpointing=True) takes the noise-free step of the run without it, in float64."""
    steps = []
    for checkpointing in (False, True):
        torch.manual_seed(3)
        model = models.gpt2().double()
        before = snapshot(model)
        trainer = make_trainer(
            tmp_path,
            model=model,
            noise_multiplier=0.0,
            max_steps=1,
            insecure_dp_seed=5,
            activation_checkpointing=checkpointing,
            activation_checkpointing_kwargs=kwargs if checkpointing else None,
        )
        assert trainer.dp.clipping.norms_in_backward == checkpointing
        trainer.train()
        assert model.is_activation_checkpointing == checkpointing
        steps.append(torch.cat([(before[n] - p.detach()).flatten() for n, p in model.named_parameters()]))
    assert steps[0].norm() > 0
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-9, atol=1e-13)


def checkpointed_lora(reentrant: bool) -> tuple[nn.Module, dict, float, dict[str, torch.Tensor]]:
    """The float64 LoRA Llama with checkpointing on, its batch, a clip norm below every example's norm, and brute
    force's clipped sum at it."""
    torch.manual_seed(0)
    model = llama_lora().double().train()
    batch = models.token_batch()
    _, norms = models.brute_force(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = models.brute_force(model, batch, max_norm=max_norm)
    unwrap_model(model).activation_checkpointing_enable({"use_reentrant": reentrant})
    return model, batch, max_norm, reference


@pytest.mark.parametrize("reentrant", [False, True])
def test_few_trainable_weights_take_one_pass_after_the_checked_first_step(
    monkeypatch, reentrant: bool
) -> None:
    """LoRA: each example's explicit adapter gradient is kept from the norm pass, so no second pass is needed
    (the tiny test model's adapters are not small relative to it: the threshold is lifted for the test)."""
    monkeypatch.setattr("hf_dp.clipping.pipeline.KEPT_GRADIENTS_SHARE", 1e9)
    model, batch, max_norm, reference = checkpointed_lora(reentrant)
    strategy = clipped_step(ClippingEngine(model), model, Backend(checkpointing=True))
    forwards = []
    for ours in checkpointed_steps(model, batch, max_norm, strategy=strategy, forwards=forwards):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    # the first step checks the taps with two passes (the whole weighted pass, and one weighted by fixed unequal
    # weights: calibration.CheckedInGradients) and the layers one by one (for steps whose kept gradients would not
    # fit), which needs no forward with the embeddings frozen; the second takes one
    assert forwards == [3, 1]


def test_disk_with_activation_checkpointing_is_refused_before_training(tmp_path) -> None:
    trainer = make_trainer(tmp_path, noise_multiplier=1.0, dp_optimizer="disk", activation_checkpointing=True)
    with pytest.raises(ValueError, match="disk evaluates each example at two parameter points") as info:
        trainer.train()
    assert "\n" not in str(info.value)


def test_bf16_autocast_with_checkpointing_is_close_to_the_float32_step(tmp_path) -> None:
    """Autocast (installed by the Trainer around the forward) with checkpointing: the first step's check against
    autograd allows for bf16 rounding, and the step is the float32 one to bf16 precision."""
    steps = []
    for bf16 in (False, True):
        torch.manual_seed(8)
        model = models.gpt2()
        before = snapshot(model)
        make_trainer(
            tmp_path,
            model=model,
            noise_multiplier=0.0,
            max_steps=1,
            insecure_dp_seed=3,
            bf16=bf16,
            activation_checkpointing=True,
        ).train()
        steps.append(torch.cat([(before[n] - p.detach()).flatten() for n, p in model.named_parameters()]))
    assert steps[0].norm() > 0
    assert (steps[1] - steps[0]).norm() < 0.05 * steps[0].norm()


def test_bf16_first_step_check_allows_rounding_at_llm_like_shapes() -> None:
    """At 2 layers × 64, T 64 the two bf16 passes differ by up to 3.5% of a probe projection (which may land
    near 0 by chance; a check relative to it refused this model) but by 1.4% of the parameter's gradient,
    the scale the check uses now. Both steps, the second layer by layer, stay the float32 ones to bf16
    precision."""
    torch.manual_seed(0)
    model = models.llama(
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=64,
    ).train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    steps = []
    for bf16 in (False, True):
        engine = ClippingEngine(model)
        strategy = clipped_step(engine, model, Backend(checkpointing=True))
        for _ in range(2):  # the checked first step, then the tail skipped and the layers run one by one
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                sums = step_sums(
                    strategy,
                    model,
                    lambda module: per_example_loss(module, batch),
                    torch.ones(2),
                    StepPlan(0.1),
                )
            steps.append(torch.cat([sums[name].flatten() for name, _ in model.named_parameters()]))
        engine.remove_hooks()
        assert strategy.calibration.skips_tail and strategy.calibration.layerwise
    for fp32, bf16 in zip(steps[:2], steps[2:], strict=True):
        assert (bf16 - fp32).norm() < 0.02 * fp32.norm()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_no_grad_forward_inside_the_loss_changes_nothing(checkpointing: bool) -> None:
    """A frozen reference computed inside the per-example loss (DPO with the peft adapter disabled): a no_grad
    forward is not a reentrant checkpoint (book-keeping stays), and peft re-enabling the adapters' requires_grad
    as it exits cannot leak an unclipped gradient out of the norm pass."""
    torch.manual_seed(0)
    model = llama_lora().double().train()
    batch = models.token_batch(4)
    _, norms = models.brute_force(model, batch, max_norm=1e9)
    reference, _ = models.brute_force(model, batch, max_norm=0.5 * norms.min().item())
    if checkpointing:
        unwrap_model(model).activation_checkpointing_enable({"use_reentrant": False})

    def loss_with_reference(module, inputs):
        with torch.no_grad(), model.disable_adapter():
            module(**{k: v for k, v in inputs.items() if k != "labels"})
        return per_example_loss(module, inputs)

    engine = ClippingEngine(model)
    strategy = clipped_step(engine, model, Backend(checkpointing=checkpointing))
    ours = checkpointed_step(
        model, batch, 0.5 * norms.min().item(), strategy=strategy, loss_fn=loss_with_reference
    )
    assert strategy.norms_in_backward == checkpointing
    assert_close(ours, reference, rtol=1e-9, floor=1e-6)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ["llama", "gpt2_tied"])
def test_the_weighted_pass_skips_the_lm_head_after_the_checked_first_step(name: str, reentrant: bool) -> None:
    """After the first step's check, the weighted pass stops at the final norm's input and replays the norm pass's
    layer outputs: the LM head runs once a step (in the norm pass), the loss once, each checkpointed layer three
    times instead of four, and the clipped sum is still brute force's (tail.py, replay.py)."""
    build, make_batch = MODELS[name]
    model = build().double().train()
    batch = make_batch()
    _, norms = models.brute_force(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = models.brute_force(model, batch, max_norm=max_norm)
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    head_calls, loss_calls, mlp_calls = [], [], []
    model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(len(loss_calls)))
    layer = model.model.layers[0] if name == "llama" else model.transformer.h[0]
    layer.mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(len(loss_calls)))

    def counted_loss(module, batch):
        loss_calls.append(None)
        return per_example_loss(module, batch)

    engine = ClippingEngine(model)
    strategy = clipped_step(engine, model, Backend(checkpointing=True))
    first, second = checkpointed_steps(model, batch, max_norm, strategy=strategy, loss_fn=counted_loss)
    assert strategy.calibration.skips_tail and strategy.calibration.layerwise
    # step 1: norm pass, whole weighted pass, the pass weighted by fixed unequal weights, the check's forward up to
    # the first layer; step 2: norm pass, the forward up to the first layer (the embeddings' part)
    assert len(loss_calls) == 6 and head_calls == [1, 2, 3, 5]
    # a layer runs in the norm pass's forward and backward, and recomputed in the weighted pass (layerwise.py)
    assert [n for n in mlp_calls if n > 4] == [5, 5, 6]
    assert_close(second, reference, rtol=1e-9, floor=1e-6)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_frozen_head_is_skipped_from_the_last_layers_output(monkeypatch, reentrant: bool) -> None:
    """LoRA whose kept gradients do not fit and whose tail reaches down over no layer: no clipped parameter is used
    after the last checkpointed layer, so the tail starts at that layer's output. After the checked first step the
    frozen head runs once a step (the norm pass), the weighted pass runs no forward of the model (the embeddings are
    frozen: the layers are recomputed one by one, layerwise.py), and the sum is brute force's."""
    monkeypatch.setattr("hf_dp.clipping.pipeline.KEPT_GRADIENTS_SHARE", 0.0)
    monkeypatch.setattr("hf_dp.clipping.pipeline._tail_floats", lambda engine: 0)
    model, batch, max_norm, reference = checkpointed_lora(reentrant)
    base = unwrap_model(model)
    head_calls, mlp_calls, forwards = [], [], []
    base.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(len(forwards)))
    base.model.layers[-1].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(len(forwards)))
    strategy = clipped_step(ClippingEngine(model), model, Backend(checkpointing=True))
    steps = checkpointed_steps(model, batch, max_norm, strategy=strategy, forwards=forwards, steps=3)
    for ours in steps:
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    assert (
        strategy.calibration.skips_tail is True
        and strategy.calibration.tail_layers == 0
        and strategy.calibration.layerwise
    )
    # later steps: the norm pass's forward only
    assert forwards[1:] == [1, 1] and head_calls.count(1) == head_calls.count(2) == 1
    assert mlp_calls.count(2) == 3  # forward, recomputation, and the weighted pass's recomputation


@pytest.mark.parametrize("reentrant", [False, True])
def test_through_zero2_lora_runs_the_layers_below_its_tail_one_by_one(monkeypatch, reentrant: bool) -> None:
    """LoRA through ZeRO-2 whose kept gradients do not fit: the tail reaches down over the top layer (its adapters'
    per-example gradients), and the layer below runs one by one from the points' kept gradients, its adapters
    given theirs by the layer's term in the framework's backward (the embeddings are frozen: no forward of the
    model in the weighted pass). Every step is brute force's. Under a reentrant checkpoint the tail stays at the
    frozen head, which through a framework keeps the whole weighted pass."""
    monkeypatch.setattr("hf_dp.clipping.pipeline.KEPT_GRADIENTS_SHARE", 0.0)
    model, batch, max_norm, reference = checkpointed_lora(reentrant)
    layer = unwrap_model(model).model.layers[0]
    numel = sum(p.numel() for p in layer.parameters() if p.requires_grad)
    monkeypatch.setattr(
        "hf_dp.clipping.pipeline._tail_floats", lambda engine: batch["input_ids"].shape[0] * numel
    )
    forwards = []
    strategy = clipped_step(ClippingEngine(model), model, ZERO2)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=strategy, forwards=forwards, steps=3):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    assert strategy.calibration.skips_tail is strategy.calibration.layerwise is (not reentrant)
    if not reentrant:
        assert strategy.calibration.tail_layers == 1 and forwards[1:] == [
            1,
            1,
        ]  # later steps: the norm pass's forward only


@pytest.mark.parametrize("backend", [ONE_PROCESS, ZERO2], ids=["one_process", "zero2"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_block_whose_attention_reaches_its_output_directly_is_not_run_layer_by_layer(
    reentrant: bool, backend: Backend
) -> None:
    """Each layer's MLP output also adds its attention's output, so the attention reaches the layer's output around
    the residual point between attention and MLP (layerwise.py): back-propagating the attention from that point
    alone would miss that path. The first step's check finds the difference (through ZeRO-2 layer by layer against
    the chain, without writing gradients) and later steps chain the layers (replay.py); every step is brute
    force's."""
    torch.manual_seed(0)
    model = models.llama().double().train()
    batch = models.token_batch()
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(
            lambda module, args, output, layer=layer: setattr(layer, "attended", output[0])
        )
        layer.mlp.register_forward_hook(
            lambda module, args, output, layer=layer: output + 0.5 * layer.attended
        )
    strategy = steps_match_brute_force(model, batch, reentrant, backend=backend)
    assert strategy.calibration.skips_tail is True and strategy.calibration.layerwise is False


@pytest.mark.parametrize("backend", [ONE_PROCESS, ZERO2], ids=["one_process", "zero2"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_weight_shared_by_attention_and_mlp_goes_with_its_last_use(
    reentrant: bool, backend: Backend
) -> None:
    """Each layer's up_proj is its q_proj: one weight in two segments (layerwise.py). It is back-propagated from the
    layer's output only, which reaches its attention use through the residual point too: exact, layer by layer."""
    torch.manual_seed(0)
    model = models.llama(intermediate_size=16).double().train()
    for layer in model.model.layers:
        layer.mlp.up_proj.weight = layer.self_attn.q_proj.weight
    batch = models.token_batch()
    strategy = steps_match_brute_force(model, batch, reentrant, backend=backend)
    assert strategy.calibration.skips_tail and strategy.calibration.layerwise


def test_a_step_that_cannot_run_the_checked_layer_by_layer_pass_runs_the_whole_pass(monkeypatch) -> None:
    """The first step checked the layer-by-layer pass, not the chained one: a later step whose record cannot be used
    (a layer called twice, say) runs the whole weighted pass, LM head included, and stays exact."""
    torch.manual_seed(0)
    model = models.llama().double().train()
    batch = models.token_batch()
    head_calls, forwards = [], []
    model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(len(forwards)))
    usable, answers = LayerPoints.usable, []

    def usable_on_the_first_step_only(self, kept) -> bool:
        answers.append(usable(self, kept) and not answers)
        return answers[-1]

    monkeypatch.setattr(LayerPoints, "usable", usable_on_the_first_step_only)
    strategy = steps_match_brute_force(model, batch, reentrant=False, steps=2, forwards=forwards)
    assert strategy.calibration.layerwise and answers == [True, False]
    assert forwards[1] == 2 and head_calls.count(1) == 2  # the norm pass and the whole weighted pass


def test_the_layer_by_layer_pass_keeps_each_point_once_and_lets_it_go(monkeypatch) -> None:
    """Llama's points: the input of each layer's post-attention norm and each layer's output (the input norm of a
    layer follows no clipped use inside it), the first layer's input (the embeddings precede it), and the two norm
    weights of each layer; the weighted pass leaves none of them behind."""
    torch.manual_seed(0)
    model = models.llama(num_hidden_layers=3).double().train()
    batch = models.token_batch()
    model.activation_checkpointing_enable({"use_reentrant": False})
    strategy = clipped_step(ClippingEngine(model), model, Backend(checkpointing=True))
    seen = []
    original = BodySum.__call__

    def watched(self, losses_of, found, factors, batch):
        points = found.points
        seen.append(
            (
                sorted((layers.index(layer), type(norm).__name__) for layer, norm in points.gradients),
                len(points.norm_parts),
                points.first_input.gradient is not None,
            )
        )
        seen.append(points)
        kept = [part for _, part in found.tail.parts + points.norm_parts]
        seen.append(
            (found, [weakref.ref(t) for part in kept for t in vars(part).values() if torch.is_tensor(t)])
        )
        return original(self, losses_of, found, factors, batch)

    layers = list(model.model.layers)
    monkeypatch.setattr(BodySum, "__call__", watched)
    checkpointed_steps(model, batch, 1.0, strategy=strategy, steps=2)
    assert strategy.calibration.layerwise
    kept, points, (found, parts) = seen
    names = [(k, "LlamaRMSNorm") for k in range(3)] + [(k, "NoneType") for k in range(3)]
    assert kept == (sorted(names), 6, True)
    assert (points.gradients, points.norm_parts, points.first_input.gradient) == ({}, [], None)
    # the tail's and the norms' per-example gradients are let go once summed, though the norm pass's result lives on
    gc.collect()
    assert parts and found.tail is not None and not any(ref() is not None for ref in parts)


def test_through_zero2_the_layer_by_layer_pass_lets_each_kept_gradient_go_in_the_backward(
    monkeypatch,
) -> None:
    """Through ZeRO-2 each layer's term recomputes the layer in the framework's backward and hands its parameters
    their gradients there (layerwise.py): once that backward has run, no point's gradient, norm part or first
    input's gradient is left, the layers ran one by one, and the sum is brute force's."""
    torch.manual_seed(0)
    model = models.llama(num_hidden_layers=3).double().train()
    batch = models.token_batch()
    kept = []
    original = BodySum.__call__

    def watched(self, losses_of, found, factors, batch):
        kept.append((found.points, len(found.points.gradients), len(found.points.norm_parts)))
        return original(self, losses_of, found, factors, batch)

    monkeypatch.setattr(BodySum, "__call__", watched)
    strategy = steps_match_brute_force(model, batch, reentrant=False, steps=3, backend=ZERO2)
    assert strategy.calibration.layerwise and len(kept) == 2  # the steps after the checked first one
    for points, gradients, norm_parts in kept:
        assert (gradients, norm_parts) == (6, 6)
        assert points.gradients == {} and points.norm_parts == [] and points.first_input.gradient is None


def _tail_reaches(monkeypatch, model: nn.Module, rows: int, layers: int) -> None:
    """Give the tail the budget of exactly ``layers`` of the model's (equal) layers' per-example gradients."""
    numel = sum(p.numel() for p in model.model.layers[0].parameters())
    monkeypatch.setattr("hf_dp.clipping.pipeline._tail_floats", lambda engine: layers * rows * numel)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("reached", [1, 2, 3])
@pytest.mark.parametrize("zero_stage", [None, 2])
def test_the_tail_reaches_down_over_the_last_layers_its_budget_holds(
    monkeypatch, zero_stage: int | None, reached: int, reentrant: bool
) -> None:
    """Where the top layers' per-example gradients fit the budget (tail.py), the weighted pass starts at the input
    of the lowest of them: those layers run in the norm pass only, the layers below in the weighted pass's backward
    too (replayed), and the clipped sum is still brute force's, in one process and through ZeRO-2. There the first
    step checks the tail with ``autograd.grad``, which a reentrant checkpoint refuses: the tail keeps to the head."""
    torch.manual_seed(0)
    model = models.llama(num_hidden_layers=3).double().train()
    batch = models.token_batch()
    _tail_reaches(monkeypatch, model, batch["input_ids"].shape[0], reached)
    _, norms = models.brute_force(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = models.brute_force(model, batch, max_norm=max_norm)
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    loss_calls, mlp_calls = [], [[] for _ in model.model.layers]
    for k, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *_, k=k: mlp_calls[k].append(len(loss_calls)))

    def counted_loss(module, batch):
        loss_calls.append(None)
        return per_example_loss(module, batch)

    backend = Backend(world_size=2 if zero_stage else 1, zero_stage=zero_stage, checkpointing=True)
    (first, second), strategy = framework_steps(model, batch, max_norm, backend, loss_fn=counted_loss)
    reached = 0 if zero_stage and reentrant else reached
    assert strategy.calibration.skips_tail and strategy.calibration.tail_layers == reached
    assert strategy.calibration.layerwise  # one process and ZeRO-2: the layers below the tail one by one
    # step 2: forward k + 1 is the norm pass (forward and recomputation), k + 2 the weighted pass below the tail,
    # after the first step's k forwards (one of them weighted by fixed unequal weights: the attribution check, which
    # through ZeRO-2 runs with autograd.grad, so not under a reentrant checkpoint)
    below, k = len(model.model.layers) - reached, 3 if zero_stage and reentrant else 4
    assert [[n for n in calls if n > k] for calls in mlp_calls] == [[k + 1, k + 1, k + 2]] * below + [
        [k + 1, k + 1]
    ] * reached
    assert_close(first, reference, rtol=1e-9, floor=1e-6)
    assert_close(second, reference, rtol=1e-9, floor=1e-6)


def test_later_steps_reach_down_over_the_layers_the_first_step_checked(monkeypatch) -> None:
    """A loss term inside the second layer from the top is exact with the tail over two layers (it is in their
    per-example gradients) and not with the tail over one. The first step checks two layers; a later, larger batch,
    whose per-example gradients fit one layer only, still reaches over the two the check covered."""
    torch.manual_seed(0)
    model = models.llama(num_hidden_layers=3).double().train()
    small, large = models.token_batch(4), models.token_batch(8, seed=1)
    _tail_reaches(monkeypatch, model, 4, 2)
    model.model.layers[1].mlp.register_forward_hook(
        lambda module, args, output: setattr(model, "auxiliary", output.pow(2).mean(dim=(1, 2)))
    )

    def loss_fn(module, batch):
        return per_example_loss(module, batch) + model.auxiliary

    references = [
        models.brute_force(model, batch, max_norm=0.05, loss_fn=loss_fn)[0] for batch in (small, large)
    ]
    model.activation_checkpointing_enable({"use_reentrant": False})
    strategy = clipped_step(ClippingEngine(model), model, Backend(checkpointing=True))
    for batch, reference in zip((small, large), references, strict=True):
        mask = torch.ones(batch["input_ids"].shape[0])
        ours = step_sums(
            strategy, model, lambda module, batch=batch: loss_fn(module, batch), mask, StepPlan(0.05)
        )
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    assert strategy.calibration.skips_tail and strategy.calibration.tail_layers == 2


class _AuxiliaryLoss(_UserCheckpointed):
    """Its loss also reads a body activation directly (like a router's auxiliary loss), not only through the
    tail's input: skipping the tail would drop that term's gradient."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + torch_checkpoint.checkpoint(self.blocks[0], h, use_reentrant=False)
        self.auxiliary = h.pow(2).mean(dim=(1, 2))
        h = h + torch_checkpoint.checkpoint(self.blocks[1], h, use_reentrant=False)
        return self.head(h)


@pytest.mark.parametrize(
    "backend",
    [
        Backend(checkpointing=True),
        Backend(zero_stage=1, checkpointing=True),
        Backend(fsdp=True, checkpointing=True),
    ],
)
def test_a_loss_that_reaches_the_body_outside_the_tail_keeps_the_whole_weighted_pass(
    backend: Backend,
) -> None:
    """In one process the first step compares the two weighted passes; through ZeRO-1 and FSDP2 it checks the tail
    without a second backward (checks.tail_separable): each finds the term and keeps the whole pass."""
    torch.manual_seed(0)
    model = _AuxiliaryLoss(None).double()

    def loss_fn(module, batch):
        return _next_token_loss(module, batch) + module.auxiliary

    batch = models.token_batch()
    reference, norms = models.brute_force(model, batch, max_norm=0.5, loss_fn=loss_fn)
    assert norms.min() > 0.5
    sums, strategy = framework_steps(model, batch, 0.5, backend, loss_fn=loss_fn)
    for ours in sums:
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    assert strategy.calibration.skips_tail is False  # the first step's check found the difference


@pytest.mark.parametrize("backend", [Backend(checkpointing=True), Backend(zero_stage=1, checkpointing=True)])
def test_a_loss_that_reads_the_body_below_the_tail_keeps_the_whole_weighted_pass(
    monkeypatch, backend: Backend
) -> None:
    """A loss term on the first layer's input (the tail reaches down over the second layer only) reaches the body
    other than through the tail's input: through ZeRO-1 the first step's check finds it, and the whole pass stays
    exact. (A term on the tail's input itself is in its gradient there, and separable.) In one process the
    layer-by-layer pass takes that input's gradient whole, term included (layerwise.py), and is exact."""
    torch.manual_seed(0)
    model = models.llama(num_hidden_layers=2).double().train()
    batch = models.token_batch()
    _tail_reaches(monkeypatch, model, batch["input_ids"].shape[0], 1)
    model.model.layers[0].register_forward_pre_hook(
        lambda module, args: setattr(model, "auxiliary", args[0].pow(2).mean(dim=(1, 2)))
    )

    def loss_fn(module, batch):
        return per_example_loss(module, batch) + model.auxiliary

    reference, norms = models.brute_force(model, batch, max_norm=0.5, loss_fn=loss_fn)
    assert norms.min() > 0.5
    model.activation_checkpointing_enable({"use_reentrant": False})
    sums, strategy = framework_steps(model, batch, 0.5, backend, loss_fn=loss_fn)
    for ours in sums:
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    # in one process the layer below the tail runs on its own from its output, and the embeddings from the first
    # layer's input, whose kept gradient holds the term's: exact, so the tail is skipped that way
    assert strategy.calibration.skips_tail is strategy.calibration.layerwise is (backend.zero_stage is None)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("zero_stage", [None, 2])
def test_the_replayed_weighted_pass_draws_the_norm_pass_dropout_masks(
    zero_stage: int | None, reentrant: bool
) -> None:
    """With dropout on, the step that replays the layers (replay.py) and skips the head equals the whole weighted
    pass from the same random state, in one process and through ZeRO-2: each layer is recomputed under the random
    state it started from; another draw gives another sum."""
    torch.manual_seed(0)
    model = models.llama(attention_dropout=0.5).double().train()
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    batch = models.token_batch()
    strategy = clipped_step(ClippingEngine(model), model, Backend(zero_stage=zero_stage, checkpointing=True))
    mask = torch.ones(batch["input_ids"].shape[0])

    def step(seed: int, fast: bool | None) -> dict[str, torch.Tensor]:
        if fast is not None:
            strategy.force(skips_tail=fast, replays=fast)
        torch.manual_seed(seed)
        return step_sums(
            strategy, model, lambda module: per_example_loss(module, batch), mask, StepPlan(0.05)
        )

    step(0, None)  # the checked first step
    assert strategy.calibration.skips_tail
    fast, whole = step(1, True), step(1, False)
    assert_close(fast, whole, rtol=1e-9, floor=1e-9)
    other = step(2, True)  # the masks matter: another draw gives another sum
    assert max((other[n] - whole[n]).norm() for n in other) > 1e-6


@pytest.mark.parametrize(("framework", "reentrant"), [("zero2", False), ("zero2", True), ("fsdp2", False)])
@pytest.mark.parametrize("name", ["llama", "gpt2_tied"])
def test_through_zero2_and_fsdp2_the_weighted_pass_skips_the_lm_head_after_the_checked_first_step(
    name: str, framework: str, reentrant: bool
) -> None:
    """DeepSpeed ZeRO-1/2 and FSDP2 back-propagate what the step hands it. After a first step that checks the tail
    without a second backward (checks.tail_separable), the step hands it W·(⟨h, spread(c) ⊙ ∂ΣL/∂h⟩ + Σ_p ⟨p,
    Σ_i c_i G_i⟩) from a forward that stops at the tail and replays the layers: the LM head runs once a step, each
    checkpointed layer three times, and its gradient is brute force's clipped sum (× W, which the framework's mean
    removes). (FSDP2's norm pass differentiates towards its taps only, which reentrant checkpointing refuses.)"""
    build, make_batch = MODELS[name]
    model = build().double().train()
    batch = make_batch()
    _, norms = models.brute_force(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = models.brute_force(model, batch, max_norm=max_norm)
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    head_calls, mlp_calls = [], []
    model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(None))
    layer = model.model.layers[0] if name == "llama" else model.transformer.h[0]
    layer.mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(None))
    sharded = framework == "fsdp2"
    backend = Backend(world_size=2, zero_stage=None if sharded else 2, fsdp=sharded, checkpointing=True)
    (first, second), strategy = framework_steps(model, batch, max_norm, backend, steps=2)
    assert strategy.calibration.skips_tail and strategy.calibration.replays
    assert strategy.calibration.layerwise is not sharded  # ZeRO-2: the layers one by one (layerwise.py)
    # ZeRO-2 holds every parameter whole: the first step also checks the taps' attribution with autograd.grad of
    # Σ_i r_i L_i (one forward and its recomputation), which a reentrant checkpoint hides
    attribution = not sharded and not reentrant
    # step 1: norm pass, the check's forward, the whole weighted pass (3 heads); step 2: the norm pass's only
    assert len(head_calls) == 4 + attribution
    # step 1: the norm pass's forward and recomputation, the check's forward (and ZeRO-2's recomputation for the
    # layer-by-layer check), the whole pass's forward and recomputation; step 2: the norm pass's two and the
    # weighted pass's recomputation in its backward only (replayed, or layer by layer)
    assert len(mlp_calls) == 5 + (not sharded) + 3 + 2 * attribution
    assert_close(first, reference, rtol=1e-9, floor=1e-6)
    assert_close(second, reference, rtol=1e-9, floor=1e-6)


def test_through_fsdp2_the_tail_goes_into_grad_without_reading_the_tail_weights() -> None:
    """FSDP2 frees a unit's unsharded weights when it reshards them, and a forward that stops at h never gathers
    those of a unit above h (a head wrapped on its own): the weighted pass writes the tail's W·Σ_i c_i G_i into
    the unsharded weights' ``.grad`` and reads none of them. With the head's storage freed before step 2's
    weighted pass, step 2's sum is still brute force's."""
    model = models.llama().double().train()
    batch = models.token_batch()
    reference, _ = models.brute_force(model, batch, max_norm=0.05)
    model.activation_checkpointing_enable({"use_reentrant": False})
    backend = Backend(world_size=2, fsdp=True, checkpointing=True)
    strategy = clipped_step(ClippingEngine(model), model, backend)
    mask = torch.ones(batch["input_ids"].shape[0])

    def losses_of(module):
        return per_example_loss(module, batch)

    assert_close(
        step_sums(strategy, model, losses_of, mask, StepPlan(0.05)), reference, rtol=1e-9, floor=1e-6
    )
    assert strategy.calibration.skips_tail
    norm_calls = []

    def free_head(module, args):  # the second call of step 2: the weighted pass's forward reaches the tail
        norm_calls.append(None)
        if len(norm_calls) == 2:
            model.lm_head.weight.untyped_storage().resize_(0)

    model.model.norm.register_forward_pre_hook(free_head)
    second = step_sums(strategy, model, losses_of, mask, StepPlan(0.05))
    assert len(norm_calls) == 2 and model.lm_head.weight.untyped_storage().nbytes() == 0
    assert_close(second, reference, rtol=1e-9, floor=1e-6)


@pytest.mark.parametrize("reentrant", [False, True])
def test_zero3_keeps_the_tail_and_runs_the_layers(reentrant: bool) -> None:
    """ZeRO-3 gathers each module's weights only inside it, so the tail term linear in p cannot be formed: the
    weighted pass keeps the head, and runs the layers (a replayed layer would gather its weights once more). The sum
    is brute force's."""
    model = models.llama().double().train()
    batch = models.token_batch()
    reference, _ = models.brute_force(model, batch, max_norm=0.05)
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    backend = Backend(world_size=1, zero_stage=3, checkpointing=True)
    mlp_calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(None))
    sums, strategy = framework_steps(model, batch, 0.05, backend)
    assert strategy.calibration == Calibration() and not strategy.framework_may_replay
    assert len(mlp_calls) == 4 + 4
    for ours in sums:
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)


def test_a_layer_whose_output_changes_between_passes_is_not_replayed() -> None:
    """Through a framework the first step compares each checkpointed layer's output in the whole weighted pass with
    the norm pass's: a layer that draws from its own generator (not the replayed random state) differs."""
    model = models.llama().double().train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    generator = torch.Generator().manual_seed(0)
    model.model.layers[1].mlp.register_forward_hook(
        lambda _m, _a, out: out + 1e-3 * torch.randn(out.shape, generator=generator, dtype=out.dtype)
    )
    _, strategy = framework_steps(
        model, models.token_batch(), 0.05, Backend(world_size=2, fsdp=True, checkpointing=True)
    )
    assert strategy.calibration.replays is False
    # through ZeRO-2 (every parameter whole) the first step's attribution check sees the layer's gradient change
    # between passes, so the per-example norms would not bound what the weighted pass releases: refused
    with pytest.raises(UnsupportedModuleError, match="gets gradient from outside the forward .* along a probe"):
        framework_steps(model, models.token_batch(), 0.05, Backend(zero_stage=2, checkpointing=True))


@pytest.mark.parametrize(
    ("name", "checkpointing"), [("gpt2_tied", False), ("llama", False), ("llama_lora", True)]
)
def test_through_zero2_the_norm_pass_per_example_gradients_give_the_sum_in_one_pass(
    name: str, checkpointing: bool, monkeypatch
) -> None:
    """Book-keeping's factors (no checkpointing) or the kept explicit gradients (LoRA with checkpointing) are handed
    to ZeRO-0/1/2 as W·Σ_p ⟨p, Σ_i c_i G_i^p⟩: the model runs one forward a step, and the gradient is brute force's
    clipped sum (× W). An example whose clip factor is 0 (masked) is left out. (This tiny model's adapters are
    not few: the share of weights that qualifies is raised.)"""
    monkeypatch.setattr("hf_dp.clipping.pipeline.KEPT_GRADIENTS_SHARE", 1e9)
    build, make_batch = MODELS[name]
    model = build().double().train()
    batch = make_batch()
    mask = torch.ones(batch["input_ids"].shape[0])
    mask[1] = 0
    _, norms = models.brute_force(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = models.brute_force(model, batch, max_norm=max_norm, mask=mask)
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    heads = []
    model.get_output_embeddings().register_forward_hook(lambda *_: heads.append(None))
    engine = ClippingEngine(model)
    strategy = clipped_step(engine, model, Backend(world_size=2, zero_stage=2, checkpointing=checkpointing))
    for _ in range(2):
        ours = step_sums(
            strategy, model, lambda module: per_example_loss(module, batch), mask, StepPlan(max_norm)
        )
        assert_close(ours, {n: g for n, g in reference.items() if n in ours}, rtol=1e-9, floor=1e-6)
    # one forward a step; with checkpointing the first step's whole pass and its checks run first
    assert len(heads) == (5 if checkpointing else 2)
    engine.remove_hooks()
