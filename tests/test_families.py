"""Every family in docs/clipping.md's table, as a user brings it (a tiny config, every parameter trainable, float64;
MoE in float32, whose grouped GEMM takes no float64, and Mamba2 and Jamba, whose mixers compute in float32): two
book-keeping DP steps (the checked first one and a later one) at a clip norm between the examples' norms, so that
some are clipped and some are not, each equal to the brute-force clipped sum (one backward per example,
tests/oracle.py); and the path each takes (a rule per layer, tracked rows, a shared input followed to the batch, the
torch.func fallback). tests/test_model_families.py runs the decoders with activation checkpointing,
tests/test_checkpointed_families.py the families added since (GPT-Neo to Marian), tests/test_flattened_rows.py the
rows, positions and shared inputs."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine, UnsupportedModuleError
from hf_dp.clipping.fallback import ModuleCall, functorch_per_example_grads
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


def _roberta_like(config_class: type, model_class: type) -> nn.Module:
    """A RoBERTa-shaped classifier: padding id 1, positions counted past it."""
    config = config_class(
        **models._ENCODER,
        num_labels=3,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        max_position_embeddings=40,
    )
    return model_class(config)


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


SEQ2SEQ = {
    "vocab_size": V,
    "d_model": 16,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32,
    "max_position_embeddings": 32,
    "pad_token_id": PAD,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "decoder_start_token_id": PAD,
}


def mt5() -> nn.Module:
    """T5's settings, its RMSNorm named MT5LayerNorm."""
    t5 = models.t5(freeze_relative_bias=False)
    return T.MT5ForConditionalGeneration(T.MT5Config(**t5.config.to_dict()))


def mamba2() -> nn.Module:
    """use_cache left True: the mixer's call holds a live cache, which its fallback replays as absent."""
    sizes = {"hidden_size": 16, "num_hidden_layers": 2, "state_size": 4, "num_heads": 4, "head_dim": 8}
    config = T.Mamba2Config(vocab_size=V, **sizes, n_groups=1, chunk_size=4, pad_token_id=PAD)
    return T.Mamba2ForCausalLM(config)


def jamba() -> nn.Module:
    """Mamba mixers (the fallback, a live cache), attention and routed experts in one decoder."""
    config = T.JambaConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        num_experts=2,
        num_experts_per_tok=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=4,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
        pad_token_id=PAD,
        max_position_embeddings=32,
    )
    return T.JambaForCausalLM(config)


def funnel() -> nn.Module:
    """Its attention takes the masks nested in a tuple, ``attention_inputs``."""
    config = T.FunnelConfig(
        vocab_size=V,
        block_sizes=[1, 1],
        block_repeats=[1, 1],
        num_decoder_layers=1,
        d_model=16,
        n_head=2,
        d_head=8,
        d_inner=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        num_labels=3,
        pad_token_id=PAD,
    )
    return T.FunnelForSequenceClassification(config)


def deepseek_v3() -> nn.Module:
    """Its router flattens (B, T, d) to B·T tokens inside its forward and returns one row per token."""
    mla = {"kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8}
    experts = {
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
    }
    fields = {**mla, **experts, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}
    return T.DeepseekV3ForCausalLM(
        T.DeepseekV3Config(**{**models.DECODER_SIZES, **fields, "num_key_value_heads": 2})
    )


T5_SIZES = {
    "num_layers": 1,
    "num_decoder_layers": 1,
    "d_model": 16,
    "d_kv": 8,
    "num_heads": 2,
    "d_ff": 32,
    "vocab_size": V,
    "pad_token_id": PAD,
    "eos_token_id": 1,
    "decoder_start_token_id": PAD,
    "dropout_rate": 0.0,
}
ENCODER_CLASSES = {"num_labels": 3, "pad_token_id": PAD, "max_position_embeddings": 32}


def _built_from(config_class: str, model_class: str, **fields) -> nn.Module:
    return getattr(T, model_class)(getattr(T, config_class)(**fields))


def gpt_neo() -> nn.Module:
    """A global and a local (windowed) attention layer; its attention computes in float32 inside."""
    return _built_from(
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        vocab_size=V,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        intermediate_size=32,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        max_position_embeddings=32,
        embed_dropout=0.0,
        attention_dropout=0.0,
        resid_dropout=0.0,
    )


def xglm() -> nn.Module:
    """Its attention clamps the masked scores with torch.full((), finfo(dtype).min) in the default dtype, which
    overflows float32 for a float64 model: each attention call runs with float64 as the default dtype, the previous
    default restored when it returns."""
    model = _built_from(
        "XGLMConfig",
        "XGLMForCausalLM",
        vocab_size=V,
        d_model=16,
        num_layers=2,
        attention_heads=2,
        ffn_dim=32,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=PAD,
    )
    previous = []

    def enter(module: nn.Module, args) -> None:
        previous.append(torch.get_default_dtype())
        torch.set_default_dtype(torch.float64)

    def leave(module: nn.Module, args, output) -> None:
        torch.set_default_dtype(previous.pop())

    for module in model.modules():
        if type(module).__name__ == "XGLMAttention":
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave, always_call=True)
    return model


def _moe(config_class: str, model_class: str, **fields) -> nn.Module:
    return _decoder(config_class, model_class, {"num_experts_per_tok": 2, **fields})


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
    "gpt_oss": (
        gpt_oss,
        models.token_batch,
        torch.float32,
        "fallback",
    ),  # its attention sinks; MoE as "routed"
    "bert": (models.bert_classifier, _classes(), torch.float64, "rules"),
    "roberta": (
        lambda: models.roberta_classifier(3),
        _classes(lambda: models.classification_batch(3, pad=1)),
        torch.float64,
        "rules",
    ),
    "xlm_roberta": (
        lambda: _roberta_like(T.XLMRobertaConfig, T.XLMRobertaForSequenceClassification),
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
    "mt5": (mt5, models.seq2seq_batch, torch.float64, "shared"),  # MT5LayerNorm: the RMSNorm rule
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
    "blenderbot": (
        lambda: T.BlenderbotForConditionalGeneration(T.BlenderbotConfig(**SEQ2SEQ)),
        models.seq2seq_batch,
        torch.float64,
        "rows",
    ),
    "m2m100": (
        lambda: T.M2M100ForConditionalGeneration(
            T.M2M100Config(**SEQ2SEQ, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
        ),
        models.seq2seq_batch,
        torch.float64,
        "rules",
    ),
    "mamba2": (mamba2, models.token_batch, torch.float32, "fallback"),  # its mixer computes in float32 inside
    "jamba": (jamba, models.token_batch, torch.float32, "fallback"),
    # pooled to 6 tokens: no length of its (T', T) masks equals the batch's 5 (fallback.py says why)
    "funnel": (
        funnel,
        _classes(lambda: models.classification_batch(3, length=12)),
        torch.float64,
        "fallback",
    ),
    # its router reads its weight otherwise than in one linear call: the fallback, on the B·T rows it returns
    "deepseek_v3": (deepseek_v3, models.token_batch, torch.float32, "fallback"),
    "gpt_neo": (gpt_neo, models.token_batch, torch.float64, "rules"),
    "codegen": (
        lambda: _built_from(
            "CodeGenConfig",
            "CodeGenForCausalLM",
            vocab_size=V,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_inner=32,
            rotary_dim=4,
            n_positions=32,
            n_ctx=32,
            **GPT_NO_DROPOUT,
        ),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "gpt_bigcode": (
        lambda: _built_from(
            "GPTBigCodeConfig",
            "GPTBigCodeForCausalLM",
            vocab_size=V,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_inner=32,
            n_positions=32,
            multi_query=True,
            **GPT_NO_DROPOUT,
        ),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "xglm": (xglm, models.token_batch, torch.float64, "rules"),
    # CohereLayerNorm (a weight, no bias, the mean subtracted) has no rule
    "cohere": (
        lambda: _decoder("CohereConfig", "CohereForCausalLM", {}),
        models.token_batch,
        torch.float64,
        "fallback",
    ),
    "olmo": (
        lambda: _decoder("OlmoConfig", "OlmoForCausalLM", {}),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "olmoe": (
        lambda: _moe("OlmoeConfig", "OlmoeForCausalLM", num_experts=4),
        models.token_batch,
        torch.float32,
        "routed",
    ),
    "granitemoe": (
        lambda: _moe("GraniteMoeConfig", "GraniteMoeForCausalLM", num_local_experts=4),
        models.token_batch,
        torch.float32,
        "routed",
    ),
    "qwen3_moe": (
        lambda: _moe(
            "Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, moe_intermediate_size=16, head_dim=8
        ),
        models.token_batch,
        torch.float32,
        "routed",
    ),
    "falcon_mamba": (
        lambda: _built_from(
            "FalconMambaConfig",
            "FalconMambaForCausalLM",
            vocab_size=V,
            hidden_size=16,
            state_size=4,
            num_hidden_layers=2,
            pad_token_id=PAD,
        ),
        models.token_batch,
        torch.float64,
        "fallback",
    ),
    "persimmon": (
        lambda: _built_from(
            "PersimmonConfig",
            "PersimmonForCausalLM",
            vocab_size=V,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            partial_rotary_factor=0.5,
            qk_layernorm=True,
            pad_token_id=PAD,
            **NO_DROPOUT,
        ),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "nemotron": (
        lambda: _decoder("NemotronConfig", "NemotronForCausalLM", {"head_dim": 8}),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "glm": (
        lambda: _decoder("GlmConfig", "GlmForCausalLM", {"head_dim": 8}),
        models.token_batch,
        torch.float64,
        "rules",
    ),
    "albert": (
        lambda: _built_from(
            "AlbertConfig",
            "AlbertForSequenceClassification",
            **models._ENCODER,
            **ENCODER_CLASSES,
            embedding_size=8,
            classifier_dropout_prob=0.0,
        ),
        _classes(),
        torch.float64,
        "rules",
    ),
    "mobilebert": (  # NoNorm (x ⊙ w + b) has no rule
        lambda: _built_from(
            "MobileBertConfig",
            "MobileBertForSequenceClassification",
            **models._ENCODER,
            **ENCODER_CLASSES,
            embedding_size=8,
            intra_bottleneck_size=8,
            true_hidden_size=8,
            num_feedforward_networks=2,
            classifier_dropout=0.0,
        ),
        _classes(),
        torch.float64,
        "fallback",
    ),
    "convbert": (  # its span-based dynamic convolution (SeparableConv1D, Conv1d) has no rule
        lambda: _built_from(
            "ConvBertConfig",
            "ConvBertForSequenceClassification",
            **models._ENCODER,
            **ENCODER_CLASSES,
            embedding_size=16,
            conv_kernel_size=3,
        ),
        _classes(),
        torch.float64,
        "fallback",
    ),
    "roformer": (
        lambda: _built_from(
            "RoFormerConfig",
            "RoFormerForSequenceClassification",
            **models._ENCODER,
            **ENCODER_CLASSES,
            embedding_size=16,
        ),
        _classes(),
        torch.float64,
        "rules",
    ),
    "camembert": (
        lambda: _roberta_like(T.CamembertConfig, T.CamembertForSequenceClassification),
        _classes(lambda: models.classification_batch(3, pad=1)),
        torch.float64,
        "rules",
    ),
    "umt5": (
        lambda: T.UMT5ForConditionalGeneration(T.UMT5Config(**T5_SIZES)),
        models.seq2seq_batch,
        torch.float64,
        "shared",
    ),
    "longt5": (
        lambda: T.LongT5ForConditionalGeneration(
            T.LongT5Config(**T5_SIZES, encoder_attention_type="local", local_radius=2)
        ),
        models.seq2seq_batch,
        torch.float64,
        "shared",
    ),
    "mbart": (
        lambda: T.MBartForConditionalGeneration(T.MBartConfig(**SEQ2SEQ, bos_token_id=1, eos_token_id=2)),
        models.seq2seq_batch,
        torch.float64,
        "rules",
    ),
    "marian": (
        # two layers each: its embeddings tied to the head, one layer each would make 3 groups
        lambda: T.MarianMTModel(
            T.MarianConfig(
                **{**SEQ2SEQ, "encoder_layers": 2, "decoder_layers": 2}, bos_token_id=1, eos_token_id=2
            )
        ),
        models.seq2seq_batch,
        torch.float64,
        "rules",
    ),
}


# fallbacks on batch-major inputs alone: nothing to track after the first micro-batch
UNTRACKED = ("funnel", "cohere", "mobilebert", "convbert")
# the families with fused experts or routers, which their call rules take (experts.py, one_linear.py)
ROUTED = ("mixtral", "qwen2_moe", "gpt_oss", "jamba", "deepseek_v3", "olmoe", "granitemoe", "qwen3_moe")


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
    assert routed is (family in ROUTED), family
    assert step.engine.row_tracking.on is (path != "rules" and family not in UNTRACKED), family


# family: peft's target modules ("all-linear": every linear layer but the head)
LORA = {
    "opt": "all-linear",
    "falcon": "all-linear",
    "t5": "all-linear",
    "bart": "all-linear",
    "mpnet": "all-linear",
    "deberta_v2": "all-linear",
    "mixtral": [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    ],  # LoRA on its experts and router: test_lora_parameters.py
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
# test_flattened_rows.py: OPT, BART, T5, MoE, Mamba, DeBERTa; test_checkpointed_families.py: GPT-Neo to Marian);
# MPNet and ALBERT have no checkpointing
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


# Funnel's attention scores its keys in float32: its key bias, whose gradient is 0 (a softmax's shift), carries
# rounding that the first step's projection check measures against the largest gradient (checks.check_projections)
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
    assert (
        "2 × GptOssAttention (2 floats each, e.g. model.layers.0.self_attn)" in found
        and "register_rule" in found
    )
    assert "Experts" not in found and "Router" not in found
    model = gpt_oss()
    model.config._experts_implementation = "eager"
    assert "2 × GptOssExperts" in report(model)
    assert report(models.mixtral()) is None and report(models.llama()) is None


def test_a_funnel_mask_as_long_as_the_batch_is_caught_by_the_first_step(monkeypatch) -> None:
    """Funnel pools its 10 tokens to 5, the batch's size: its (5, 10) mask, shared by all examples, looks
    batch-shaped to the fallback, which splits it; the first step's check refuses that in one line."""
    torch.manual_seed(0)
    model = funnel().double().train()
    batch = models.classification_batch(3)
    step = clipped_step(ClippingEngine(model), model, Backend())
    with pytest.raises(UnsupportedModuleError, match=r"attention\.r_w_bias") as refused:
        checkpointed_steps(model, batch, 1.0, strategy=step, steps=1)
    assert "\n" not in str(refused.value)


def test_an_output_the_fallback_cannot_split_per_example_is_refused_in_one_line() -> None:
    """An output whose first dimension is no multiple of the batch: the module is named, not a vmap traceback."""

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x * self.weight, x.mean(0, keepdim=True)])

    module, x = Pooled(), torch.randn(4, 3)
    call = ModuleCall(module, (x,), {}, [torch.randn(5, 3)], batch_size=4)
    with pytest.raises(
        UnsupportedModuleError, match="Pooled .* first dimension is not a multiple of the batch"
    ):
        functorch_per_example_grads(call, ["weight"])


class _Flattens(nn.Module):
    """No rule (a scale read elementwise): (B, T, d) to B·T rows, example-major as a reshape makes them, or
    time-major (rows t·B + i), which crediting rows k·i .. k·i + k − 1 to example i would get wrong."""

    def __init__(self, time_major: bool) -> None:
        super().__init__()
        self.scale, self.time_major = nn.Parameter(torch.randn(3, dtype=torch.float64)), time_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale
        return (y.transpose(0, 1) if self.time_major else y).reshape(-1, x.shape[-1])


def test_the_fallback_credits_flattened_rows_only_where_they_are_example_major() -> None:
    """Checked in the fallback itself, once per module, so also where the first step's check does not run (FSDP2):
    example-major rows give each example's Σ_t g_t ⊙ x_t; time-major ones are refused in one line."""
    x, g = torch.randn(4, 5, 3, dtype=torch.float64), torch.randn(20, 3, dtype=torch.float64)
    module = _Flattens(time_major=False)
    found = functorch_per_example_grads(ModuleCall(module, (x,), {}, [g], batch_size=4), ["scale"])
    expected = (g.view(4, 5, 3) * x).sum(dim=1)
    torch.testing.assert_close(found["scale"].grads, expected)
    with pytest.raises(UnsupportedModuleError, match="_Flattens .* not example-major") as info:
        functorch_per_example_grads(
            ModuleCall(_Flattens(time_major=True), (x,), {}, [g], batch_size=4), ["scale"]
        )
    assert "\n" not in str(info.value)
