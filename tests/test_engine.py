"""The norm engine's clipped sum equals brute force (one backward per example), layer by layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_dp.clipping.engine import ClippingEngine, UnsupportedModuleError
from hf_dp.losses import per_example_loss
from tests import models, oracle
from tests.engine_steps import clipped_backward, per_example_norms

MODELS = {
    "gpt2_tied": (models.gpt2, lambda: models.token_batch()),
    "bert_classifier": (models.bert_classifier, lambda: models.classification_batch(3)),
    "bert_mlm": (models.bert_mlm, lambda: models.token_batch(causal=False)),
    "roberta_classifier": (models.roberta_classifier, lambda: models.classification_batch(2, pad=1)),
    "modernbert_classifier": (models.modernbert_classifier, lambda: models.classification_batch(3)),
    "llama": (models.llama, lambda: models.token_batch()),
    "gemma": (models.gemma, lambda: models.token_batch()),
    "t5": (models.t5, lambda: models.seq2seq_batch()),
    "gpt2_lora": (models.gpt2_lora, lambda: models.token_batch()),
    "mixtral_lora_attention": (models.mixtral_lora_attention, lambda: models.token_batch()),
}
# float64 is exact up to summation order (~1e-16; T5's attention masking reaches 1e-10). T5LayerNorm and
# GemmaRMSNorm compute in float32 whatever the model's dtype (Gemma's weight gradient too), so T5 and Gemma are
# compared in float32; so is Mixtral, whose experts' grouped GEMM takes no float64.
TOLERANCE = {torch.float64: 1e-8, torch.float32: 2e-5}
DTYPE = {"t5": torch.float32, "gemma": torch.float32, "mixtral_lora_attention": torch.float32}


def engine_clipped_sum(model, batch, max_norm, mode, dtype=torch.float64):
    engine = ClippingEngine(model, mode=mode)
    model.zero_grad(set_to_none=True)
    with engine.record(batch["input_ids"].shape[0]):
        losses = per_example_loss(model, batch)
    norms = clipped_backward(engine, losses, max_norm, verify=True)
    engine.remove_hooks()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}
    return grads, norms.double()


def assert_close(ours: dict, reference: dict, rtol: float, floor: float) -> None:
    """Relative error per parameter, with an absolute floor for exactly-zero true gradients (key biases)."""
    largest = max(r.norm().item() for r in reference.values())
    for name, ref in reference.items():
        error = (ours[name] - ref).norm().item()
        assert error <= rtol * max(ref.norm().item(), floor * largest), f"{name}: error {error:.3g}"


@pytest.mark.parametrize("mode", ["ghost", "per_sample"])
@pytest.mark.parametrize("clipping", ["active", "inactive"])
@pytest.mark.parametrize("name", list(MODELS))
def test_clipped_sum_matches_brute_force(name: str, clipping: str, mode: str) -> None:
    build, make_batch = MODELS[name]
    dtype = DTYPE.get(name, torch.float64)
    model = build().to(dtype).eval()
    batch = make_batch()
    reference, ref_norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = 0.5 * ref_norms.min().item() if clipping == "active" else 10 * ref_norms.max().item()
    reference, ref_norms = oracle.per_example(model, batch, max_norm=max_norm)
    ours, norms = engine_clipped_sum(model, batch, max_norm, mode)
    torch.testing.assert_close(norms, ref_norms, rtol=TOLERANCE[dtype], atol=0)
    assert_close(ours, reference, rtol=TOLERANCE[dtype], floor=1e-3 if dtype == torch.float32 else 1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_layer_materialised_inside_the_backward_matches_brute_force(monkeypatch, name: str) -> None:
    """Layers whose B explicit per-example gradients are smaller than their output gradient (T > d_in: the LM
    head at long context) form them inside the backward and keep neither input nor output gradient; forced
    here for every layer with a rule (tied GPT-2: the head's explicit part meets the embedding's index part)."""
    monkeypatch.setattr("hf_dp.clipping.bookkeeping.MATERIALISE_BELOW_OUTPUT_SHARE", float("inf"))
    build, make_batch = MODELS[name]
    dtype = DTYPE.get(name, torch.float64)
    model = build().to(dtype).eval()
    batch = make_batch()
    _, ref_norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = 0.5 * ref_norms.min().item()
    reference, ref_norms = oracle.per_example(model, batch, max_norm=max_norm)
    engine = ClippingEngine(model)
    with engine.record(batch["input_ids"].shape[0]) as recording:
        losses = per_example_loss(model, batch)
    kept = [call.module for call in recording._calls]
    assert all(
        engine.layers.rules[module] is None for module in kept
    )  # only the torch.func fallback's are kept
    model.zero_grad(set_to_none=True)
    norms = clipped_backward(engine, losses, max_norm, verify=True)
    engine.remove_hooks()
    ours = {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(norms.double(), ref_norms, rtol=TOLERANCE[dtype], atol=0)
    assert_close(ours, reference, rtol=TOLERANCE[dtype], floor=1e-3 if dtype == torch.float32 else 1e-6)


def test_only_trained_parameters_are_materialised_in_the_backward(monkeypatch) -> None:
    """BiTFiT (biases trained, weights frozen): a Linear's bias is formed in the backward, its frozen weight's
    B × d_out × d_in per-example gradients are never built."""
    from hf_dp.clipping.per_example import OuterProductSum

    built = []
    materialise = OuterProductSum.materialise
    monkeypatch.setattr(
        OuterProductSum, "materialise", lambda self, a, b: built.append(1) or materialise(self, a, b)
    )
    model = models.bert_classifier().double().eval()
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith("bias"))  # every biased module is then taken in the backward
    batch = models.classification_batch(3)
    _, ref_norms = oracle.per_example(model, batch, max_norm=1e9)
    engine = ClippingEngine(model)
    with engine.record(batch["input_ids"].shape[0]) as recording:
        losses = per_example_loss(model, batch)
    assert (
        recording._anchor is not None
    )  # the token-wise layers were taken in the backward (the pooler is not)
    model.zero_grad(set_to_none=True)
    norms = clipped_backward(engine, losses, 1e9)
    engine.remove_hooks()
    assert not built
    torch.testing.assert_close(norms.double(), ref_norms, rtol=1e-8, atol=0)


def test_a_long_sequence_materialises_the_lm_head_in_the_backward() -> None:
    """Unforced: with T > d_in the head's (and every linear layer's) per-example gradients are formed inside the
    backward; with T < d_in they are kept factored for book-keeping."""
    for length, expected in ((40, True), (10, False)):
        model = models.llama().double().eval()
        batch = models.token_batch(batch=3, length=length)
        engine = ClippingEngine(model)
        with engine.record(3) as recording:
            per_example_loss(model, batch)
        recorded = {engine.layers.module_names[call.module] for call in recording._calls}
        engine.remove_hooks()
        assert ("lm_head" not in recorded) == expected, recorded


@pytest.mark.parametrize("mode", ["ghost", "per_sample"])
def test_float32_gpt2_within_float_tolerance(mode: str) -> None:
    model = models.gpt2().eval()
    batch = models.token_batch(batch=6, length=12)
    reference, ref_norms = oracle.per_example(model, batch, max_norm=1.0)
    ours, norms = engine_clipped_sum(model, batch, 1.0, mode)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    assert_close(ours, reference, rtol=1e-5, floor=1e-3)


def test_tied_embedding_cross_term_is_included() -> None:
    """GPT-2's wte is also lm_head: the norm is of the SUM of both uses, not the sum of their norms."""
    model = models.gpt2().double().eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    batch = models.token_batch()
    _, ref_norms = oracle.per_example(model, batch, max_norm=1e9)
    _, norms = engine_clipped_sum(model, batch, 1e9, "ghost")
    torch.testing.assert_close(norms, ref_norms, rtol=1e-10, atol=0)
    untied = models.gpt2().double().eval()
    untied.load_state_dict(model.state_dict())
    untied.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    _, untied_norms = oracle.per_example(untied, batch, max_norm=1e9)
    assert (untied_norms - ref_norms).abs().max() > 1e-3, "the cross term should change the norm"


def test_padding_idx_row_gets_zero_gradient() -> None:
    """Autograd gives Embedding(padding_idx) row zero gradient; so must every per-example gradient."""
    model = models.bert_classifier().double().eval()
    batch = models.classification_batch(3)
    assert (batch["input_ids"] == models.PAD).any()
    ours, _ = engine_clipped_sum(model, batch, 1.0, "ghost")
    pad_row = ours["bert.embeddings.word_embeddings.weight"][models.PAD]
    assert pad_row.abs().max() == 0
    reference, _ = oracle.per_example(model, batch, max_norm=1.0)
    torch.testing.assert_close(
        ours["bert.embeddings.word_embeddings.weight"],
        reference["bert.embeddings.word_embeddings.weight"],
        rtol=1e-10,
        atol=1e-14,
    )


def test_broadcast_position_ids_stay_per_example() -> None:
    """GPT-2 passes position_ids of batch size 1; an explicit (1, T) input must not merge examples."""
    model = models.gpt2().double().eval()
    batch = models.token_batch()
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None, :]
    batch_for_brute = {k: v for k, v in batch.items() if k != "position_ids"}
    reference, ref_norms = oracle.per_example(model, batch_for_brute, max_norm=0.3)
    ours, norms = engine_clipped_sum(model, batch, 0.3, "ghost")
    torch.testing.assert_close(norms, ref_norms, rtol=1e-10, atol=0)
    assert_close(ours, reference, rtol=1e-9, floor=1e-6)


class _Scale(nn.Module):
    """A module with its own parameter and no rule: handled by the torch.func fallback."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.gain)


class _TinyClassifier(nn.Module):
    def __init__(self, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.scale = _Scale(8)
        self.norm = norm if norm is not None else nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.scale(self.embed(input_ids)).mean(dim=1)
        return self.head(self.norm(h))


def _tiny_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"], reduction="none")


def test_functorch_fallback_for_modules_without_rule() -> None:
    model = _TinyClassifier().double()
    batch = {"input_ids": torch.randint(0, 20, (6, 5)), "labels": torch.arange(6) % 3}
    reference, ref_norms = oracle.per_example(model, batch, max_norm=0.2, loss_fn=_tiny_loss)
    engine = ClippingEngine(model)
    with engine.record(6):
        losses = _tiny_loss(model, batch)
    norms = clipped_backward(engine, losses, 0.2, verify=True)
    torch.testing.assert_close(norms.double(), ref_norms, rtol=1e-10, atol=0)
    assert_close({n: p.grad for n, p in model.named_parameters()}, reference, rtol=1e-9, floor=1e-9)


def test_batch_norm_is_refused_with_advice() -> None:
    with pytest.raises(
        UnsupportedModuleError, match="BatchNorm1d.*use GroupNorm or LayerNorm|GroupNorm or LayerNorm"
    ):
        ClippingEngine(_TinyClassifier(norm=nn.BatchNorm1d(8)))


def test_fallback_can_be_refused_naming_the_parameter() -> None:
    with pytest.raises(UnsupportedModuleError, match="scale.gain.*_Scale"):
        ClippingEngine(_TinyClassifier(), allow_functorch_fallback=False)


class _SideUse(nn.Module):
    """Uses its Linear's weight directly as well: a path no hook sees."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) + x @ self.head.weight


def test_parameter_used_outside_its_module_is_caught() -> None:
    model = _SideUse()
    engine = ClippingEngine(model)
    with engine.record(3):
        losses = model(torch.randn(3, 4)).pow(2).sum(dim=1)
    with pytest.raises(UnsupportedModuleError, match="head.weight gets gradient from outside"):
        clipped_backward(engine, losses, 1.0, verify=True)


def test_example_mask_drops_placeholder_examples() -> None:
    model = models.gpt2().double().eval()
    batch = models.token_batch(batch=4)
    engine = ClippingEngine(model)
    with engine.record(4):
        losses = per_example_loss(model, batch)
    clipped_backward(engine, losses, 0.5, example_mask=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    ours = {n: p.grad.double() for n, p in model.named_parameters()}
    kept = {k: v[[0, 2]] for k, v in batch.items()}
    model.zero_grad(set_to_none=True)
    reference, _ = oracle.per_example(model, kept, max_norm=0.5)
    assert_close(ours, reference, rtol=1e-9, floor=1e-6)


def test_automatic_clipping_matches_brute_force() -> None:
    """Automatic clipping (Bu et al. 2022): c_i = C / (‖g_i‖ + 0.01)."""
    model = models.gpt2().double().eval()
    batch = models.token_batch()
    named = dict(model.named_parameters())
    reference, _ = oracle.per_example(model, batch, 0.7, clipping_fn="automatic")
    engine = ClippingEngine(model, clipping_fn="automatic")
    with engine.record(batch["input_ids"].shape[0]):
        losses = per_example_loss(model, batch)
    clipped_backward(engine, losses, 0.7)
    assert_close({n: p.grad for n, p in named.items()}, reference, rtol=1e-9, floor=1e-6)


def test_norms_agree_with_opacus_per_sample_gradients() -> None:
    """Independent check: Opacus' hooks-mode per-sample gradients on RoBERTa (which Opacus supports)."""
    from opacus import GradSampleModule

    model = models.roberta_classifier().eval()
    batch = models.classification_batch(2, pad=1)
    engine = ClippingEngine(model)
    with engine.record(batch["input_ids"].shape[0]):
        losses = per_example_loss(model, batch)
    norms = per_example_norms(engine, [(engine.per_example_gradients(losses), 1.0)])
    engine.remove_hooks()

    opacus_model = GradSampleModule(
        models.roberta_classifier().train(), loss_reduction="sum"
    )  # records in train mode only
    opacus_model._module.load_state_dict(model.state_dict())
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = opacus_model(**inputs).logits
    nn.functional.cross_entropy(logits, batch["labels"], reduction="sum").backward()
    opacus_norms = torch.sqrt(
        sum(
            p.grad_sample.flatten(1).pow(2).sum(1)
            for p in opacus_model.parameters()
            if p.requires_grad and p.grad_sample is not None
        )
    )
    # Opacus' embedding sampler gives the padding row a gradient; RoBERTa's position ids skip the pad index,
    # and the word-embedding pad row is the only difference, so compare after removing it from both sides.
    word = opacus_model._module.roberta.embeddings.word_embeddings.weight
    pad_row_sq = word.grad_sample[:, 1].pow(2).sum(dim=1)
    torch.testing.assert_close(norms, torch.sqrt(opacus_norms.pow(2) - pad_row_sq), rtol=1e-4, atol=1e-6)


def test_lora_only_adapters_are_clipped() -> None:
    model = models.gpt2_lora()
    engine = ClippingEngine(model)
    clipped = {id(p) for p in engine.parameters}
    for name, p in model.named_parameters():
        assert (id(p) in clipped) == ("lora_" in name), name


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.gru = nn.GRU(6, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(input_ids))
        return self.head(hidden[:, -1])


def test_a_trainable_gru_is_refused_naming_it_and_a_frozen_one_trains() -> None:
    """The torch.func fallback cannot run a fused recurrent kernel per example: refuse before training."""
    model = _Recurrent().double()
    with pytest.raises(UnsupportedModuleError, match=r"gru \(GRU\) is a trainable recurrent layer") as info:
        ClippingEngine(model)
    assert "\n" not in str(info.value)
    model.gru.requires_grad_(False)
    engine = ClippingEngine(model)
    batch = {"input_ids": torch.randint(0, 20, (4, 7)), "labels": torch.tensor([0, 1, 2, 1])}

    def loss(m, b):
        return nn.functional.cross_entropy(m(b["input_ids"]), b["labels"], reduction="none")

    reference, ref_norms = oracle.per_example(model, batch, max_norm=0.3, loss_fn=loss)
    with engine.record(4):
        losses = loss(model, batch)
    norms = clipped_backward(engine, losses, 0.3, verify=True)
    torch.testing.assert_close(norms, ref_norms.to(norms), rtol=1e-9, atol=1e-12)


class _Gain(nn.Module):
    """y = x ⊙ w: a user's own layer that no built-in rule knows."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_a_registered_rule_for_a_users_module_is_exact(monkeypatch) -> None:
    from hf_dp.clipping import rules
    from hf_dp.clipping.per_example import Materialised

    monkeypatch.setattr(rules, "_RULES", dict(rules._RULES))  # the registration ends with the test
    calls = []

    @rules.register_rule(_Gain)
    def gain_rule(module, x, grad_out):
        calls.append(module)
        return {"weight": Materialised((grad_out * x).reshape(x.shape[0], -1, x.shape[-1]).sum(dim=1))}

    model = nn.Sequential(nn.Embedding(20, 8), _Gain(8), nn.Linear(8, 3)).double()
    batch = {"input_ids": torch.randint(0, 20, (5, 4)), "labels": torch.tensor([0, 1, 2, 1, 0])}

    def loss(m, b):
        return nn.functional.cross_entropy(m(b["input_ids"]).mean(dim=1), b["labels"], reduction="none")

    reference, ref_norms = oracle.per_example(model, batch, max_norm=0.2, loss_fn=loss)
    engine = ClippingEngine(model, allow_functorch_fallback=False)  # the rule, not the fallback
    with engine.record(5):
        losses = loss(model, batch)
    norms = clipped_backward(engine, losses, 0.2, verify=True)
    assert calls and rules.rule_for(model[1]) is gain_rule
    torch.testing.assert_close(norms, ref_norms.to(norms), rtol=1e-9, atol=1e-12)
    assert_close({n: p.grad for n, p in model.named_parameters()}, reference, rtol=1e-9, floor=1e-9)


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_an_rms_norms_rule_runs_the_norm_once_a_call_after_its_first(monkeypatch, name: str) -> None:
    """x̂ comes from one run of the module with the weight that makes it the identity on x̂ (1 for x̂ ⊙ w, 0 for
    Gemma's x̂ ⊙ (1 + w)), found once per module; the rule's G_i equals Σ_t ∂y_t ⊙ x̂_t from the module's math."""
    from hf_dp.clipping import rules

    norm = getattr(models, name)().model.norm.double()
    norm.weight.data.normal_()
    forward, runs = type(norm).forward, []
    monkeypatch.setattr(type(norm), "forward", lambda self, x: runs.append(x.shape) or forward(self, x))
    x, grad_out = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(3, 5, 16, dtype=torch.float64)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    wide = x.float()  # both modules normalise in float32 whatever the model's dtype
    x_hat = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).double()
    expected = (grad_out * x_hat).sum(dim=1)
    assert rules.rule_for(norm) is rules.rms_norm_rule
    for call in range(2):
        runs.clear()
        gradient = rules.rms_norm_rule(norm, x, grad_out)["weight"].grads
        assert len(runs) == (2 if call == 0 else 1)  # the first call also probes which weight is the identity
        torch.testing.assert_close(gradient, expected, rtol=1e-12, atol=1e-12)


def test_a_scaled_word_embeddings_rule_counts_its_scale() -> None:
    """Gemma's embedding multiplies the looked-up rows by √d in its own forward: a matcher picks the scaled rule
    over the nn.Embedding rule its class inherits, else the first step's check refuses the model."""
    from hf_dp.clipping import rules

    embedding = models.gemma().model.embed_tokens
    assert rules.rule_for(embedding) is rules.scaled_embedding_rule
    assert rules.rule_for(nn.Embedding(4, 2)) is rules.embedding_rule
