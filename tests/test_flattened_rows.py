"""Layers that see the tokens of all examples as rows of one dimension (OPT's feed-forward block, MoE routers, routed
and shared experts), embeddings that compute the rows they look up (OPT's and BART's learned positions) and layers
applied to an input shared by all examples (T5's and MPNet's relative attention bias): one DP step, clipping
active, equals the brute-force clipped sum (one backward per example, tests/oracle.py), with book-keeping and,
where every trainable layer has a rule and the family supports it, with activation checkpointing. Longformer's and
LED's self-attention project time-major (T, B, d) inputs, their batch dimension 1. Rows put there
by an operation the tracker does not follow are refused, and rows credited to the wrong example are caught by the
first step's weighted check (clipping/rows.py, clipping/shared.py, checks.check_engine_sum)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping import rows as rows_module
from hf_dp.clipping.engine import ClippingEngine, UnsupportedModuleError
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.plan import StepPlan
from tests import models, oracle
from tests.test_checkpointing import ONE_PROCESS, ZERO2, checkpointed_steps, step_sums
from tests.test_engine import assert_close
from tests.test_model_families import float64_throughout


def opt() -> nn.Module:
    config = transformers.OPTConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_dim=32,
        vocab_size=models.VOCAB,
        pad_token_id=models.PAD,
        max_position_embeddings=32,
        word_embed_proj_dim=16,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return transformers.OPTForCausalLM(config)


def bart() -> nn.Module:
    sizes = {
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
    }
    sizes |= {"encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 32, "dropout": 0.0}
    config = transformers.BartConfig(vocab_size=models.VOCAB, d_model=16, pad_token_id=models.PAD, **sizes)
    return transformers.BartForConditionalGeneration(config)


def mpnet() -> nn.Module:
    config = transformers.MPNetConfig(
        **models._ENCODER, num_labels=3, pad_token_id=1, max_position_embeddings=40
    )
    return transformers.MPNetForSequenceClassification(config)


def mamba() -> nn.Module:
    config = transformers.MambaConfig(
        vocab_size=models.VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, pad_token_id=models.PAD
    )
    return transformers.MambaForCausalLM(config)


def zamba() -> nn.Module:
    """Hybrid layers [0, 2] each hold a checkpointed Mamba decoder layer (checkpoints nested in checkpoints) and call
    one attention block (its weights tied between them) on the hidden state concatenated with the embeddings."""
    config = transformers.ZambaConfig(
        vocab_size=models.VOCAB,
        hidden_size=16,
        num_hidden_layers=3,
        layers_block_type=["hybrid", "linear_attention", "hybrid"],
        num_attention_heads=2,
        num_key_value_heads=2,
        attention_head_dim=16,
        intermediate_size=32,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        n_mamba_heads=1,
        attn_layer_period=1,
        attn_layer_offset=0,
        pad_token_id=models.PAD,
        max_position_embeddings=32,
        use_cache=False,
    )
    return transformers.ZambaForCausalLM(config)


def qwen2_moe() -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        **models.DECODER_SIZES,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    )
    return transformers.Qwen2MoeForCausalLM(config)


def longformer() -> nn.Module:
    """Its self-attention projects the hidden states time-major, (T, B, d), and its global query a (G, B, d) tensor
    written from them (the batch's longest padded to G: zero rows)."""
    config = transformers.LongformerConfig(
        **models._ENCODER, num_labels=3, pad_token_id=1, max_position_embeddings=40, attention_window=4
    )
    return transformers.LongformerForSequenceClassification(config)


def led() -> nn.Module:
    sizes = {
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
    }
    sizes |= {"encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "dropout": 0.0, "attention_window": 4}
    sizes |= {"max_encoder_position_embeddings": 32, "max_decoder_position_embeddings": 32}
    config = transformers.LEDConfig(vocab_size=models.VOCAB, d_model=16, pad_token_id=models.PAD, **sizes)
    return transformers.LEDForConditionalGeneration(config)


def led_batch() -> dict[str, torch.Tensor]:
    """Global attention on each source's first token, and on a second one in example 1: the batch pads the others'
    global tokens to two (``max_num_global_attn_indices``), which brute force, one example at a time, does not."""
    batch = models.seq2seq_batch()
    global_attention = torch.zeros_like(batch["input_ids"])
    global_attention[:, 0] = 1
    global_attention[1, 3] = 1
    return batch | {"global_attention_mask": global_attention}


# name: (builder, batch, dtype, rtol); MoE in float32: its grouped GEMM takes no float64
FAMILIES = {
    "opt": (opt, models.token_batch, torch.float64, 1e-9),
    "bart": (bart, models.seq2seq_batch, torch.float64, 1e-9),
    "t5": (lambda: models.t5(freeze_relative_bias=False), models.seq2seq_batch, torch.float64, 1e-9),
    "mpnet": (mpnet, lambda: models.classification_batch(3, pad=1), torch.float64, 1e-9),
    "longformer": (longformer, lambda: models.classification_batch(3, pad=1), torch.float64, 1e-9),
    "led": (led, led_batch, torch.float64, 1e-9),
    "mixtral": (models.mixtral, models.token_batch, torch.float32, 1e-4),
    "qwen2_moe": (qwen2_moe, models.token_batch, torch.float32, 1e-4),
    # its mixer computes A, D and the time step in float32 (``A_log.float()``): brute force runs it per example,
    # the checkpointed weighted pass on the batch, and float32 rounds the two differently
    "mamba": (mamba, models.token_batch, torch.float64, 1e-6),
    "zamba": (zamba, models.token_batch, torch.float64, 1e-6),  # Mamba's mixer, as above
}
# the families that support checkpointing (MPNet does not); the MoE routers take the torch.func fallback and the fused
# experts their call rule, each inside the backward when the gradients of all their outputs arrive (fallback.py)
CHECKPOINTED = ("opt", "bart", "t5", "longformer", "led", "mixtral", "qwen2_moe", "mamba", "zamba")


def _model_and_reference(family: str, monkeypatch):
    build, batch_of, dtype, rtol = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    float64_throughout(model, monkeypatch)  # T5's norms compute their variance in float32
    model = model.to(dtype).train()
    batch = batch_of()
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()  # every example clipped
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    return model, batch, max_norm, reference, rtol


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_book_keeping_step_equals_brute_force(family: str, monkeypatch) -> None:
    model, batch, max_norm, reference, rtol = _model_and_reference(family, monkeypatch)
    step = clipped_step(ClippingEngine(model), model, Backend())
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours, reference, rtol=rtol, floor=1e-6)
    assert step.engine.row_tracking.on is (family != "bart")  # BART's rows are all the batch's own


@pytest.mark.parametrize("backend", ["one process", "zero2"])
@pytest.mark.parametrize("family", CHECKPOINTED)
def test_a_checkpointed_step_equals_brute_force(family: str, backend: str, monkeypatch) -> None:
    model, batch, max_norm, reference, rtol = _model_and_reference(family, monkeypatch)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, ONE_PROCESS if backend == "one process" else ZERO2)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=3):
        assert_close(ours, reference, rtol=rtol, floor=1e-6)


def test_tracking_stops_after_a_first_step_without_flattened_rows() -> None:
    """The tracker costs a Python call per operation: a model whose layers all take the batch's rows stops it."""
    model = models.llama().double().train()
    step = clipped_step(ClippingEngine(model), model, Backend())
    checkpointed_steps(model, models.token_batch(), 1.0, strategy=step, steps=1)
    assert step.engine.row_tracking.on is False


class _TimeMajor(nn.Module):
    """A block that flattens its tokens time-major ((T, B) order) before a linear layer: the tracker follows the
    transpose (a time-major (T, B, d) tensor) but not a reshape that merges T and B, so the linear layer's rows have
    no known example."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(models.VOCAB, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, models.VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids)
        rows = self.proj(h.transpose(0, 1).reshape(-1, h.shape[-1]))
        h = rows.reshape(h.shape[1], h.shape[0], -1).transpose(0, 1)
        return transformers.modeling_outputs.CausalLMOutput(logits=self.head(h))


def _token_losses(module: nn.Module, batch: dict) -> torch.Tensor:
    logits = module(**batch).logits
    losses = nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"], reduction="none")
    return losses.mean(dim=1)


def test_rows_of_unknown_origin_are_refused_naming_the_layer() -> None:
    model = _TimeMajor().double()
    step = clipped_step(ClippingEngine(model), model, Backend())
    with pytest.raises(
        UnsupportedModuleError,
        match=r"^proj \(Linear\) has trainable parameters but its input of shape \(50, 8\)",
    ):
        checkpointed_steps(model, models.token_batch(), 1.0, strategy=step, loss_fn=_token_losses, steps=1)


def credit_rows_to_the_wrong_examples(monkeypatch) -> None:
    """Mutation: the reshape's map reversed (row r credited to example B - 1 - r // T)."""
    reshaped = rows_module.RowTracker._reshaped

    def reversed_map(self, source, out):
        found = reshaped(self, source, out)
        if found is None or found.per_example is None:
            return found
        return rows_module.ExampleRows(self.rows - 1 - found.example, self.rows, None)

    monkeypatch.setattr(rows_module.RowTracker, "_reshaped", reversed_map)


def test_rows_credited_to_the_wrong_example_are_caught_by_the_first_step(monkeypatch) -> None:
    """Mutation: the reshape's map reversed. The unclipped sum is the same (a plain sum cannot tell), the weighted
    check of the first step refuses."""
    credit_rows_to_the_wrong_examples(monkeypatch)
    model = opt().double().train()
    step = clipped_step(ClippingEngine(model), model, Backend())
    with pytest.raises(UnsupportedModuleError, match="credits rows to the wrong examples"):
        checkpointed_steps(model, models.token_batch(), 1.0, strategy=step, steps=1)
    # with checkpointing the norms come from the taps; no example clipped (every c_i = 1), the check weighted by
    # the clip factors alone would pass, the one weighted by fixed unequal weights does not
    # through DeepSpeed ZeRO-2 (every process holds every parameter whole) the same checks run with autograd.grad
    step = clipped_step(ClippingEngine(model), model, Backend(world_size=2, zero_stage=2))
    with pytest.raises(UnsupportedModuleError, match="credits rows to the wrong examples"):
        checkpointed_steps(model, models.token_batch(), 1.0, strategy=step, steps=1)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    for backend in (ONE_PROCESS, ZERO2):
        step = clipped_step(ClippingEngine(model), model, backend)
        with pytest.raises(UnsupportedModuleError, match="credited to the wrong examples"):
            checkpointed_steps(model, models.token_batch(), 1e9, strategy=step, steps=1)


def test_time_major_rows_credited_to_the_wrong_examples_are_caught_by_the_first_step(monkeypatch) -> None:
    """Mutation: a time-major input's examples reversed when laid out for the rule (Longformer's self-attention):
    the weighted check of the first step refuses."""
    laid_out = rows_module.ExampleRows.as_examples

    def reversed_examples(self, *tensors):
        found = laid_out(self, *tensors)
        return [t.flip(0) for t in found] if self.time_major else found

    monkeypatch.setattr(rows_module.ExampleRows, "as_examples", reversed_examples)
    model = longformer().double().train()
    step = clipped_step(ClippingEngine(model), model, Backend())
    with pytest.raises(UnsupportedModuleError, match="credits rows to the wrong examples"):
        checkpointed_steps(model, models.classification_batch(3, pad=1), 1.0, strategy=step, steps=1)


def test_a_shared_input_in_a_reentrant_checkpoint_is_refused_in_one_line() -> None:
    """A reentrant checkpoint runs its first forward without a graph, so the shared bias cannot be followed to the
    batch: refused, naming the non-reentrant alternative."""
    model = models.t5(freeze_relative_bias=False).double().train()
    model.gradient_checkpointing_enable({"use_reentrant": True})
    step = clipped_step(ClippingEngine(model), model, ONE_PROCESS)
    with pytest.raises(
        UnsupportedModuleError, match=r"relative_attention_bias .* reentrant checkpoint.*use_reentrant"
    ):
        checkpointed_steps(model, models.seq2seq_batch(), 1.0, strategy=step, steps=1)


@pytest.mark.parametrize("backend", ["one process", "zero2"])
def test_deberta_checkpointed_equals_brute_force(backend: str) -> None:
    """DeBERTa's relative embeddings' weight read outside its module (followed as a shared output; the parameter
    requires grad in the recomputation as its alias does in the forward), its positions repeated per example
    (``repeat(B, 1, 1)``) and projected by layers on a shared input, under non-reentrant checkpointing."""
    torch.manual_seed(0)
    model = models.deberta_classifier().double().train()
    batch = models.classification_batch(3)
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, ONE_PROCESS if backend == "one process" else ZERO2)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=3):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)


@pytest.mark.parametrize("backend", ["one process", "zero2"])
def test_deberta_normalised_relative_embeddings_under_checkpointing_equal_brute_force(backend, monkeypatch) -> None:
    """DeBERTa-v3's settings normalise the relative embeddings' weight with a LayerNorm outside the layers, a use no
    layer call marks: the checked first step finds neither a tail to skip nor a layer-by-layer pass, and every step
    back-propagates the whole model, equal to brute force (every example clipped, three steps)."""
    from tests.test_families import deberta_v3

    torch.manual_seed(0)
    model = deberta_v3()
    float64_throughout(model, monkeypatch)
    model = model.double().train()
    batch = models.classification_batch(3)
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, ONE_PROCESS if backend == "one process" else ZERO2)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=3):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    assert not step.calibration.skips_tail and not step.calibration.layerwise


class _LooseLater(nn.Module):
    """A block whose forward reads its projection's weight outside the projection's forward when ``loose`` is set
    (``F.linear`` on ``self.proj.weight``, or ``h @ self.proj.weight.T`` with ``through="transpose"``): a read the
    tracker follows as a shared output, but which a later step may make where the first did not."""

    def __init__(self, loose: bool, through: str = "linear") -> None:
        super().__init__()
        self.loose, self.through = loose, through
        self.embed = nn.Embedding(models.VOCAB, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, models.VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.proj(self.embed(input_ids))
        if self.loose:
            read = (
                nn.functional.linear(h, self.proj.weight)
                if self.through == "linear"
                else h @ self.proj.weight.T
            )
            h = h + 0.5 * torch.tanh(read)
        return transformers.modeling_outputs.CausalLMOutput(logits=self.head(h))


@pytest.mark.parametrize("through", ["linear", "transpose"])
@pytest.mark.parametrize("backend", ["book-keeping", "checkpointed"])
def test_a_loose_read_from_the_first_step_on_equals_brute_force(backend: str, through: str) -> None:
    """The read is followed on every step (the tracker stays on): each step equals brute force."""
    torch.manual_seed(0)
    model = _LooseLater(loose=True, through=through).double().train()
    batch = models.token_batch()
    loss_fn = _token_losses
    _, norms = oracle.per_example(model, batch, max_norm=1e9, loss_fn=loss_fn)
    max_norm = 0.5 * norms.min().item()
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm, loss_fn=loss_fn)
    step = clipped_step(ClippingEngine(model), model, Backend(checkpointing=backend == "checkpointed"))
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, loss_fn=loss_fn, steps=2):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    assert step.engine.row_tracking.on


class _LooseEinsum(_LooseLater):
    """The read as ``einsum("btd,ed->bte", h, W)``, which takes no weight broadcast to the batch."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.proj(self.embed(input_ids))
        h = h + 0.5 * torch.tanh(torch.einsum("btd,ed->bte", h, self.proj.weight))
        return transformers.modeling_outputs.CausalLMOutput(logits=self.head(h))


def test_a_loose_read_an_operation_cannot_take_broadcast_is_refused_in_one_line() -> None:
    model = _LooseEinsum(loose=True).double().train()
    step = clipped_step(ClippingEngine(model), model, Backend())
    with pytest.raises(
        UnsupportedModuleError, match=r"^einsum meets the batch with a tensor made from a parameter"
    ):
        checkpointed_steps(model, models.token_batch(), 1.0, strategy=step, loss_fn=_token_losses, steps=1)


def _loose_later_step(through: str, backend: Backend):
    """A step of ``_LooseLater`` whose first step read nothing loosely (the tracker stopped), then set to."""
    torch.manual_seed(0)
    model = _LooseLater(loose=False, through=through).double().train()
    batch = models.token_batch()
    step = clipped_step(ClippingEngine(model), model, backend)

    def losses_of(module: nn.Module) -> torch.Tensor:
        return _token_losses(module, batch)

    step_sums(step, model, losses_of, torch.ones(batch["input_ids"].shape[0]), StepPlan(1.0))
    assert step.engine.row_tracking.on is False
    model.loose = True
    return model, step, losses_of, batch["input_ids"].shape[0]


@pytest.mark.parametrize("through", ["linear", "transpose"])
@pytest.mark.parametrize("backend", ["checkpointed", "zero3"])
def test_a_loose_read_first_made_after_the_first_step_is_refused_before_any_release(
    backend: str, through: str
) -> None:
    """A weighted pass that back-propagates the model (with checkpointing; ZeRO-3) would carry the read's gradient,
    which the norms never counted. The watch that stays on refuses it in one line, in the norm pass's forward,
    before any gradient is written."""
    setup = ONE_PROCESS if backend == "checkpointed" else Backend(world_size=2, zero_stage=3)
    model, step, losses_of, rows = _loose_later_step(through, setup)
    with pytest.raises(
        UnsupportedModuleError,
        match=r"^proj\.weight was read outside the forward of its module in a later step.*read it through its "
        r"module, or freeze it$",
    ):
        step_sums(step, model, losses_of, torch.ones(rows), StepPlan(1.0))
    assert all(p.grad is None for p in model.parameters())


def test_a_loose_read_first_made_after_the_first_step_leaves_book_keeping_within_its_clip_norm() -> None:
    """Book-keeping forms the sum from the taps' factors, which do not see the read: its gradient is left out, and
    each example's share of the released sum stays within C (one example unmasked at a time), so no watch runs."""
    model, step, losses_of, rows = _loose_later_step("linear", Backend())
    max_norm = 0.01  # far below every example's norm: each is clipped to exactly C
    for example in range(rows):
        mask = torch.zeros(rows)
        mask[example] = 1.0
        sums = step_sums(step, model, losses_of, mask, StepPlan(max_norm))
        norm = torch.sqrt(sum((g**2).sum() for g in sums.values()))
        assert norm <= max_norm * (1 + 1e-9)
        assert norm >= max_norm * (1 - 1e-5)  # clipped: C / (‖G_i‖ + ε)
