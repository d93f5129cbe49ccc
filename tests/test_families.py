"""Every family in docs/clipping.md's table, as a user brings it (a tiny config, every parameter trainable, float64;
MoE in float32, whose grouped GEMM takes no float64): two book-keeping DP steps (the checked first one and a later
one) at a clip norm between the examples' norms, so that some are clipped and some are not, each equal to the
brute-force clipped sum (one backward per example, tests/oracle.py); and the path each takes (a rule per layer,
tracked rows, a shared input followed to the batch, the torch.func fallback). tests/test_model_families.py runs the
decoders with activation checkpointing, tests/test_flattened_rows.py the rows, positions and shared inputs."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.rules import call_rule_for
from tests import models, oracle
from tests.test_checkpointing import ONE_PROCESS, ZERO2, checkpointed_steps
from tests.test_engine import assert_close
from tests.test_flattened_rows import bart, mamba, mpnet, opt, qwen2_moe
from tests.test_model_families import FAMILIES as CHECKPOINTED_DECODERS
from tests.test_model_families import float64_throughout
from tests.test_routed_experts import gpt_oss

V, PAD = models.VOCAB, models.PAD
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
GPT_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _decoder(config_class: str, model_class: str, fields: dict) -> nn.Module:
    return getattr(T, model_class)(getattr(T, config_class)(**models.DECODER_SIZES, **fields))


def _classes(batch=None):
    return batch or (lambda: models.classification_batch(3))


def deberta_v3() -> nn.Module:
    """DeBERTa-v3's settings: the attention's own query and key projections applied to the relative embeddings too,
    which a LayerNorm normalises first (it reads their weight directly)."""
    relative = {"relative_attention": True, "position_buckets": 8, "max_relative_positions": 16}
    config = T.DebertaV2Config(
        **models._ENCODER,
        **relative,
        num_labels=3,
        pad_token_id=PAD,
        max_position_embeddings=32,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
    )
    return T.DebertaV2ForSequenceClassification(config)


# family: (builder, batch, dtype, path); path: "rules" (a rule for every layer), "rows" (flattened tokens tracked),
# "shared" (an input shared by all examples followed to the batch), "fallback" (torch.func for layers without a rule),
# "routed" (MoE: fused experts and routers by their call rules, experts.py and one_linear.py)
FAMILIES = {
    **{
        name: (lambda c=c, m=m, f=f: _decoder(c, m, f), models.token_batch, torch.float64, "rules")
        for name, (c, m, f, _) in CHECKPOINTED_DECODERS.items()
    },
    "gpt2": (models.gpt2, models.token_batch, torch.float64, "rules"),
    "falcon": (
        lambda: T.FalconForCausalLM(
            T.FalconConfig(
                vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, **NO_DROPOUT
            )
        ),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "bloom": (
        lambda: T.BloomForCausalLM(
            T.BloomConfig(vocab_size=V, hidden_size=16, n_layer=2, n_head=2, **NO_DROPOUT)
        ),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "gptj": (
        lambda: T.GPTJForCausalLM(
            T.GPTJConfig(
                vocab_size=V, n_embd=16, n_layer=2, n_head=2, rotary_dim=4, n_positions=32, **GPT_NO_DROPOUT
            )
        ),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "stablelm": (
        lambda: _decoder("StableLmConfig", "StableLmForCausalLM", {}),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "starcoder2": (
        lambda: _decoder("Starcoder2Config", "Starcoder2ForCausalLM", {"residual_dropout": 0.0}),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "opt": (opt, models.token_batch, torch.float64, "rows"),
    "mamba": (mamba, models.token_batch, torch.float64, "fallback"),
    "mixtral": (models.mixtral, models.token_batch, torch.float32, "routed"),
    "qwen2_moe": (qwen2_moe, models.token_batch, torch.float32, "routed"),
    "gpt_oss": (gpt_oss, models.token_batch, torch.float32, "fallback"),  # its attention sinks; MoE as "routed"
    "bert": (models.bert_classifier, _classes(), torch.float64, "rules"),
    "roberta": (
        lambda: models.roberta_classifier(3),
        _classes(lambda: models.classification_batch(3, pad=1)),
        torch.float64,
        "rules",
    ),
    "xlm_roberta": (
        lambda: T.XLMRobertaForSequenceClassification(
            T.XLMRobertaConfig(
                **models._ENCODER,
                num_labels=3,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                max_position_embeddings=40,
            )
        ),
        _classes(lambda: models.classification_batch(3, pad=1)),
        torch.float64,
        "rules",
    ),
    "electra": (
        lambda: T.ElectraForSequenceClassification(
            T.ElectraConfig(
                **models._ENCODER,
                embedding_size=16,
                num_labels=3,
                pad_token_id=PAD,
                max_position_embeddings=32,
            )
        ),
        _classes(),
        torch.float64,
        "rules",
    ),
    "distilbert": (
        lambda: T.DistilBertForSequenceClassification(
            T.DistilBertConfig(
                vocab_size=V,
                dim=16,
                n_layers=2,
                n_heads=2,
                hidden_dim=32,
                num_labels=3,
                pad_token_id=PAD,
                max_position_embeddings=32,
                dropout=0.0,
                attention_dropout=0.0,
                seq_classif_dropout=0.0,
            )
        ),
        _classes(),
        torch.float64,
        "rules",
    ),
    "modernbert": (models.modernbert_classifier, _classes(), torch.float64, "rules"),
    "deberta_v2": (models.deberta_classifier, _classes(), torch.float64, "shared"),
    "deberta_v3": (deberta_v3, _classes(), torch.float64, "shared"),
    "mpnet": (mpnet, _classes(lambda: models.classification_batch(3, pad=1)), torch.float64, "shared"),
    "t5": (lambda: models.t5(freeze_relative_bias=False), models.seq2seq_batch, torch.float64, "shared"),
    "bart": (bart, models.seq2seq_batch, torch.float64, "rules"),
    "pegasus": (
        lambda: T.PegasusForConditionalGeneration(
            T.PegasusConfig(
                vocab_size=V,
                d_model=16,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=32,
                decoder_ffn_dim=32,
                max_position_embeddings=32,
                pad_token_id=PAD,
                dropout=0.0,
                decoder_start_token_id=PAD,
            )
        ),
        models.seq2seq_batch,
        torch.float64,
        "rules",
    ),
}


def test_the_table_holds_at_least_the_issue_s_families() -> None:
    assert len(FAMILIES) >= 25


def _built(family: str, monkeypatch) -> tuple[nn.Module, dict, torch.dtype, torch.Tensor]:
    """The family's tiny model (its dtype, float64 throughout), its batch and brute force's per-example norms."""
    build, batch_of, dtype, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    float64_throughout(model, monkeypatch)
    model = model.to(dtype).train()
    batch = batch_of()
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    return model, batch, dtype, norms


@pytest.mark.parametrize("mode", ["ghost", "per_sample"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_dp_step_of_each_family_equals_brute_force(family: str, mode: str, monkeypatch) -> None:
    """Both clipping modes: norms from activations and output gradients (ghost), or from materialised per-example
    gradients (per_sample)."""
    path = FAMILIES[family][3]
    model, batch, dtype, norms = _built(family, monkeypatch)
    max_norm = norms.median().item()  # some examples clipped, some not
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    step = clipped_step(ClippingEngine(model, mode=mode), model, Backend())
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours, reference, rtol=1e-9 if dtype == torch.float64 else 1e-4, floor=1e-6)
    assert step.engine.materialise is (mode == "per_sample")
    without_rule = [module for module, rule in step.engine.layers.rules.items() if rule is None]
    fallback = any(call_rule_for(module) is None for module in without_rule)
    assert fallback is (path == "fallback"), family
    routed = any(call_rule_for(module) is not None for module in without_rule)
    assert routed is (family in ("mixtral", "qwen2_moe", "gpt_oss")), family
    assert step.engine.row_tracking.on is (path != "rules"), family


# family: peft's target modules ("all-linear": every linear layer but the head)
LORA = {
    "opt": "all-linear",
    "falcon": "all-linear",
    "t5": "all-linear",
    "bart": "all-linear",
    "mpnet": "all-linear",
    "deberta_v2": "all-linear",
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],  # LoRA on its experts and router: test_lora_parameters.py
    "mamba": ["in_proj", "x_proj"],  # peft refuses Mamba's out_proj and conv1d
}


@pytest.mark.parametrize(
    ("family", "checkpointing"),
    [(family, False) for family in LORA] + [(family, True) for family in LORA if family != "mpnet"],
)
def test_a_lora_dp_step_of_each_family_equals_brute_force(
    family: str, checkpointing: bool, monkeypatch
) -> None:
    """peft LoRA (book-keeping, and non-reentrant activation checkpointing where the family has it: not MPNet)."""
    from peft import LoraConfig, get_peft_model

    build, batch_of, dtype, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    float64_throughout(model, monkeypatch)
    model = get_peft_model(
        model, LoraConfig(r=2, lora_alpha=4, target_modules=LORA[family], lora_dropout=0.0)
    )
    for name, param in model.named_parameters():
        if "lora_" in name:
            nn.init.normal_(param, std=0.1)  # lora_B starts at 0: its per-example gradients would be trivial
    model = model.to(dtype).train()
    batch = batch_of()
    _, norms = oracle.per_example(model, batch, max_norm=1e9)
    max_norm = norms.median().item()
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    assert reference and all("lora_" in name or "classifier" in name or "score" in name for name in reference)
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, Backend(checkpointing=checkpointing))
    rtol = 1e-9 if dtype == torch.float64 else 1e-4
    if checkpointing and family == "mamba":
        rtol = 1e-6  # its mixer computes in float32 (test_flattened_rows.FAMILIES says why)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours, reference, rtol=rtol, floor=1e-6)


# the families whose checkpointed step no other file tests (test_model_families.py: the Llama-like decoders;
# test_flattened_rows.py: OPT, BART, T5, MoE, Mamba, DeBERTa); MPNet has no checkpointing
CHECKPOINTED_HERE = (
    "gpt2",
    "falcon",
    "bloom",
    "gptj",
    "stablelm",
    "starcoder2",
    "bert",
    "roberta",
    "xlm_roberta",
    "electra",
    "distilbert",
    "modernbert",
    "pegasus",
)


CHECKPOINTED_BACKENDS = {
    "one process": ONE_PROCESS,
    "zero2": ZERO2,
    "zero3": Backend(world_size=2, zero_stage=3, checkpointing=True),
    "fsdp2": Backend(world_size=2, fsdp=True, checkpointing=True),
}


@pytest.mark.parametrize("backend", list(CHECKPOINTED_BACKENDS))
@pytest.mark.parametrize("family", CHECKPOINTED_HERE)
def test_a_checkpointed_dp_step_of_each_family_equals_brute_force(
    family: str, backend: str, monkeypatch
) -> None:
    """Non-reentrant activation checkpointing, on one process and through ZeRO-2, ZeRO-3 and FSDP2 (each step as
    the framework would back-propagate it, in one process: tests/test_checkpointing.step_sums): the checked first
    step and a later one (the tail skipped, the layers replayed or run one by one where the check allowed it) each
    equal brute force. Pegasus through ZeRO-2: its layer-by-layer check runs from the decoder's layers into the
    encoder's, whose gradients have another length (no chain, not a crash)."""
    model, batch, _, norms = _built(family, monkeypatch)
    max_norm = norms.median().item()
    reference, _ = oracle.per_example(model, batch, max_norm=max_norm)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    step = clipped_step(ClippingEngine(model), model, CHECKPOINTED_BACKENDS[backend])
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    assert model.is_gradient_checkpointing and step.calibration is not None, (
        family
    )  # the checked first step ran


@pytest.mark.parametrize("family", list(FAMILIES))
def test_groupwise_clipping_of_each_family_equals_the_per_group_brute_force(family: str, monkeypatch) -> None:
    """clipping_groups="layer" (each transformer block, the embeddings, the head; groups.py): every group of every
    example clipped (C_g = C/√G, half the smallest example norm), one step checked and one later, each the
    per-group brute force."""
    from tests.test_groupwise import _reference

    model, batch, dtype, norms = _built(family, monkeypatch)
    max_norm = 0.5 * norms.min().item()
    engine = ClippingEngine(model, grouping="layer", clip_norm=max_norm)
    assert len(engine.groups.names) >= 4, family
    reference, _ = _reference(model, batch, engine, max_norm)
    step = clipped_step(engine, model, Backend())
    for ours in checkpointed_steps(model, batch, max_norm, strategy=step, steps=2):
        assert_close(ours, reference, rtol=1e-9 if dtype == torch.float64 else 1e-4, floor=1e-6)


def test_the_modules_that_take_the_fallback_are_logged_once_with_their_cost(tmp_path, caplog) -> None:
    """GPT-OSS's attention holds its sinks and has no rule: the run's log names it with its floats per example and
    says how to avoid the cost, and not its router or fused experts, which have call rules; its experts under its
    own eager forward take the fallback and are named; Mixtral and Llama, every module with a rule, log nothing."""
    import logging

    from hf_dp.backend import Backend
    from hf_dp.run import clipping_engine
    from tests.trainer_utils import make_args

    args = make_args(tmp_path, noise_multiplier=1.0)

    def report(model: nn.Module) -> str | None:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_dp.run"):
            clipping_engine(model, args, Backend()).remove_hooks()
        found = [r.getMessage() for r in caplog.records if "torch.func fallback" in r.getMessage()]
        assert len(found) <= 1 and all("\n" not in line for line in found)
        return found[0] if found else None

    found = report(gpt_oss())
    assert "2 × GptOssAttention (2 floats each, e.g. model.layers.0.self_attn)" in found and "register_rule" in found
    assert "Experts" not in found and "Router" not in found
    model = gpt_oss()
    model.config._experts_implementation = "eager"
    assert "2 × GptOssExperts" in report(model)
    assert report(models.mixtral()) is None and report(models.llama()) is None
