"""hf_dp.trl: private SFT and DPO through TRL's own trainers.

- The configs keep every TRL default (field by field against SFTConfig / DPOConfig) but ``DP_OVERRIDES``, and
  refuse in one line what would break DP.
- Exactness: float64, σ = 0, every unit clipped (C far below each unit's gradient norm). The clipped sum the
  trainer forms for its first logical batch (read from ``.grad`` just before the optimizer step) equals
  Σ_u clip(∇L_u) with one autograd backward PER UNIT, each unit run on its own: per example (assistant-only,
  completion-only), per RECORD (padding-free packed micro-batches), per PAIR (DPO, against the frozen
  reference). The reference losses are written out here from the logits, independently of hf_dp.trl.
- End to end: the same runs go on for a second step; loss finite and ε in the logs; LoRA via ``peft_config``,
  TRL's default activation checkpointing, a separate reference model, precomputed reference log-probs.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import random

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import DPOConfig, DPOTrainer, SFTConfig

from hf_dp import DPTrainingArguments
from hf_dp.dpo_losses import BATCH_LOSS_TYPES, PER_PAIR_LOSS_TYPES
from hf_dp.trl import DP_OVERRIDES, DPDPOConfig, DPDPOTrainer, DPSFTConfig, DPSFTTrainer
from tests import oracle
from tests.test_checkpointing import float64_rms_norm  # noqa: F401 (an autouse fixture: float64 Llama)
from tests.test_engine import assert_close
from tests.trainer_utils import sampled_logical_batches, snapshot

# ---- a tiny word-level tokenizer with a chat template, E2E-like sentences, a tiny Llama ----------------

# fmt: off
WORDS = [
    "the", "a", "pub", "restaurant", "coffee", "shop", "near", "river", "city", "centre", "cheap",
    "moderate", "high", "low", "price", "range", "rating", "customer", "family", "friendly", "not", "is",
    "in", "by", "with", "serves", "food", "Italian", "French", "Chinese", "English", "Indian", "fast",
    "Aromi", "Eagle", "Vaults", "Wrestlers", "Mill", "Punter", "Cricketers", "Fitzbillies", "name",
    "area", "eatType", "and", "it", "has", "yes", "no",
]
# fmt: on
SPECIAL = ["<pad>", "<unk>", "<|end|>", "<|user|>", "<|assistant|>", "->", "."]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] }}<|end|>"
    "{% endgeneration %}{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sentences(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(meaning representation, text) pairs of 3-7 and 3-9 words."""
    rng = random.Random(seed)
    return [
        (" ".join(rng.choices(WORDS, k=rng.randint(3, 7))), " ".join(rng.choices(WORDS, k=rng.randint(3, 9))))
        for _ in range(n)
    ]


def chat_dataset(n: int = 24) -> Dataset:
    return Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": mr}, {"role": "assistant", "content": text}]}
            for mr, text in sentences(n)
        ]
    )


def completion_dataset(n: int = 24) -> Dataset:
    return Dataset.from_list([{"prompt": f"{mr} ->", "completion": f" {text}"} for mr, text in sentences(n)])


def preference_dataset(n: int = 24) -> Dataset:
    rows = sentences(n)
    return Dataset.from_list(
        [
            {"prompt": f"{mr} ->", "chosen": f" {text}", "rejected": f" {rows[(i + 5) % n][1]}"}
            for i, (mr, text) in enumerate(rows)
        ]
    )


def tiny_llama(tokenizer, seed: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


COMMON = dict(
    use_cpu=True,
    report_to="none",
    disable_tqdm=True,
    save_strategy="no",
    logging_steps=1,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=2,
    max_length=64,
    seed=7,
    insecure_dp_seed=5,  # the drawn batches are fixed (a fresh secret could draw fewer than 3 examples)
)
EXACT = dict(
    noise_multiplier=0.0, per_sample_max_grad_norm=1e-4, bf16=False, dp_optimizer="sgd", learning_rate=1.0
)


class ClippedSums(TrainerCallback):
    """Each logical batch's clipped sum: every trainable ``.grad`` just before the optimizer step (the release)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.sums = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.sums.append(
            {n: p.grad.detach().double().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        )


def token_mean_loss(
    model: torch.nn.Module, ids: list[int], labels: list[int], dft: bool = False
) -> torch.Tensor:
    """L = the mean of -log p over the labelled tokens of ONE sequence run alone (position t predicts t + 1);
    DFT: each token's -log p times its detached probability p."""
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    nll = F.cross_entropy(logits[:-1], torch.tensor(labels[1:]), ignore_index=-100, reduction="none")
    if dft:
        nll = nll * torch.exp(-nll).detach()
    return nll.sum() / sum(label != -100 for label in labels[1:])


def check_run(trainer, steps: int = 2, first_losses: torch.Tensor | None = None) -> None:
    """Loss finite and ε in every training log, the last ε the trainer's; the first step's logged loss is the mean
    of its units' losses (clipping hides a loss's scale, so this checks the values: token means, reference)."""
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == steps
    if first_losses is not None:
        assert logs[0]["loss"] == pytest.approx(first_losses.mean().item(), rel=1e-6)
    assert all(math.isfinite(log["loss"]) and log["epsilon"] > 0 for log in logs)
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(trainer.get_epsilon())


# ---- the configs --------------------------------------------------------------------------------------


def field_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@pytest.mark.parametrize(("ours", "theirs"), [(DPSFTConfig, SFTConfig), (DPDPOConfig, DPOConfig)])
def test_configs_keep_every_trl_default(ours, theirs, tmp_path) -> None:
    """Every field of TRL's config has TRL's default (declared and after __post_init__), except the DP overrides;
    the DP fields and their checks are there too."""
    assert set(DP_OVERRIDES) == {"max_grad_norm"}
    declared = {f.name: f for f in dataclasses.fields(ours)}
    for f in dataclasses.fields(theirs):
        if f.name not in DP_OVERRIDES:
            assert field_default(declared[f.name]) == field_default(f), f.name
    mine, trl = ours(output_dir=str(tmp_path), use_cpu=True), theirs(output_dir=str(tmp_path), use_cpu=True)
    differ = {f.name for f in dataclasses.fields(theirs) if getattr(mine, f.name) != getattr(trl, f.name)}
    assert differ == set(DP_OVERRIDES)
    assert mine.max_grad_norm == 0.0 and trl.max_grad_norm == 1.0
    # the defaults TRL changes from TrainingArguments (reverted by a plain dataclass merge)
    assert mine.learning_rate == (2e-5 if theirs is SFTConfig else 1e-6)
    assert mine.logging_steps == 10 and mine.bf16 is True
    assert mine.activation_checkpointing is True and mine.gradient_checkpointing is True
    assert {f.name for f in dataclasses.fields(DPTrainingArguments)} <= set(declared)
    with pytest.raises(ValueError, match="target_epsilon must be > 0"):
        ours(output_dir=str(tmp_path), use_cpu=True, target_epsilon=-1.0)


REFUSED = [
    (
        DPSFTConfig,
        {"packing": True, "packing_strategy": "wrapped"},
        "packing_strategy='wrapped' cuts records",
    ),
    (DPSFTConfig, {"packing": True, "packing_strategy": "bfd_split"}, "packing_strategy='bfd_split' cuts"),
    (DPSFTConfig, {"packing": True, "pad_to_multiple_of": 8}, "pad_to_multiple_of=8 pads the packed row"),
    (DPSFTConfig, {"padding_free": True, "pad_to_multiple_of": 8}, "extra records"),
    (DPSFTConfig, {"router_aux_loss_coef": 0.01}, "router_aux_loss_coef=0.01 adds the MoE"),
    (DPSFTConfig, {"max_grad_norm": 1.0}, "max_grad_norm=1.0 would clip the noisy aggregate"),
    (DPSFTConfig, {"use_liger_kernel": True}, "use_liger_kernel=True fuses"),
    (DPDPOConfig, {"loss_type": "aot"}, "loss_type 'aot' sorts the log-ratios of the whole batch"),
    (DPDPOConfig, {"loss_type": "aot_unpaired"}, "'aot_unpaired' sorts"),
    (DPDPOConfig, {"loss_type": ["sigmoid", "sft"]}, "'sft' averages the chosen tokens of the whole batch"),
    (DPDPOConfig, {"loss_type": "rainbow"}, "'rainbow' has no per-pair version"),
    (DPDPOConfig, {"router_aux_loss_coef": 0.5}, "router_aux_loss_coef=0.5"),
    (DPDPOConfig, {"max_grad_norm": 0.5}, "max_grad_norm=0.5"),
]


@pytest.mark.parametrize(("config", "kwargs", "message"), REFUSED)
def test_configs_refuse_what_breaks_dp_in_one_line(config, kwargs, message, tmp_path) -> None:
    with pytest.raises(ValueError, match=message) as error:
        config(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert "\n" not in str(error.value)


def test_packing_bfd_padding_free_and_the_per_pair_losses_are_accepted(tmp_path) -> None:
    DPSFTConfig(output_dir=str(tmp_path), use_cpu=True, packing=True)
    DPSFTConfig(output_dir=str(tmp_path), use_cpu=True, padding_free=True, max_length=None)
    assert set(BATCH_LOSS_TYPES).isdisjoint(PER_PAIR_LOSS_TYPES)
    loss_types = [t for t in PER_PAIR_LOSS_TYPES if t != "exo_pair"]
    config = DPDPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type=loss_types)
    assert config.loss_type == loss_types


def test_trainers_need_their_config_and_refuse_moe_aux_loss(tmp_path) -> None:
    tokenizer = word_tokenizer()
    plain = DPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, noise_multiplier=1.0)
    with pytest.raises(TypeError, match="DPSFTTrainer needs a DPSFTConfig"):
        DPSFTTrainer(model=tiny_llama(tokenizer), args=plain, train_dataset=chat_dataset(4))
    with pytest.raises(TypeError, match="DPDPOTrainer needs a DPDPOConfig"):
        DPDPOTrainer(model=tiny_llama(tokenizer), args=plain, train_dataset=preference_dataset(4))
    from transformers import MixtralConfig, MixtralForCausalLM

    moe = MixtralForCausalLM(
        MixtralConfig(
            num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=32, num_local_experts=2, num_experts_per_tok=1, vocab_size=len(tokenizer),
            router_aux_loss_coef=0.02,
        )
    )  # fmt: skip
    args = DPSFTConfig(output_dir=str(tmp_path), noise_multiplier=1.0, **COMMON)
    with pytest.raises(ValueError, match="MoE load-balancing loss .*router_aux_loss_coef=0.0"):
        DPSFTTrainer(model=moe, args=args, train_dataset=chat_dataset(4), processing_class=tokenizer)


# ---- SFT: exact per-example / per-record clipping through DPSFTTrainer.train() ------------------------


def sft_labels(tokenizer, row: dict, mode: str, trainer) -> tuple[list[int], list[int]]:
    """The example's tokens and its trained labels, built here from the raw row (not from TRL's labels)."""
    if mode == "assistant_only":
        out = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = list(out["input_ids"])
        return ids, [t if m else -100 for t, m in zip(ids, out["assistant_masks"], strict=True)]
    if mode in ("completion_only", "dft"):
        prompt = tokenizer(row["prompt"])["input_ids"]
        ids = tokenizer(row["prompt"] + row["completion"] + tokenizer.eos_token)["input_ids"]
        assert ids[: len(prompt)] == prompt
        return ids, [-100] * len(prompt) + ids[len(prompt) :]
    ids = tokenizer(row["text"] + tokenizer.eos_token)["input_ids"]  # packed: language modeling, all tokens
    return ids, list(ids)


@pytest.mark.parametrize("mode", ["assistant_only", "completion_only", "packed", "dft"])
def test_sft_clips_each_example_or_record_exactly(mode: str, tmp_path, caplog) -> None:
    """The first logical batch's clipped sum = Σ_i clip(∇L_i), one backward per example (per packed record) run
    alone, L_i the mean over its trained tokens; then a second step; loss and ε in the logs. Assistant-only runs
    with TRL's default activation checkpointing, completion-only without, packed with it; ``dft`` is TRL's DFT
    loss on the completion-only data."""
    tokenizer = word_tokenizer()
    model = tiny_llama(tokenizer).double()
    if mode == "assistant_only":
        raw, extra = chat_dataset(), {"assistant_only_loss": True}
    elif mode == "completion_only":
        raw, extra = completion_dataset(), {"gradient_checkpointing": False}
    elif mode == "dft":
        raw, extra = completion_dataset(), {"loss_type": "dft"}
    else:
        raw = Dataset.from_list([{"text": f"{mr} -> {text}"} for mr, text in sentences(24)])
        extra = {"packing": True}
    args = DPSFTConfig(output_dir=str(tmp_path), **{**COMMON, **EXACT, **extra})
    assert args.activation_checkpointing is (mode != "completion_only")
    with caplog.at_level(logging.WARNING, logger="hf_dp.trl"):
        trainer = DPSFTTrainer(model=model, args=args, train_dataset=raw, processing_class=tokenizer)
    sums = ClippedSums(model)
    trainer.add_callback(sums)
    assert len(trainer.train_dataset) == len(raw)  # never pre-packed, no example dropped
    assert trainer.data_collator.padding_free is (mode == "packed")
    assert ("packs the Poisson-sampled records" in caplog.text) is (mode == "packed")

    drawn = sampled_logical_batches(trainer, 1)[0]
    assert len(drawn) >= 3
    units = []
    for i in drawn:
        ids, labels = sft_labels(tokenizer, raw[i], mode, trainer)
        assert ids == trainer.train_dataset[i]["input_ids"]  # TRL tokenised the same sequence ...
        if mode != "packed":
            assert labels == trainer.train_dataset[i]["labels"]  # ... and masked the same tokens
            assert 0 < sum(label != -100 for label in labels) < len(labels)
        units.append(lambda ids=ids, labels=labels: token_mean_loss(model, ids, labels, dft=mode == "dft"))
    reference, norms, losses = oracle.clipped_sum(model, units, args.per_sample_max_grad_norm)
    assert (norms > 100 * args.per_sample_max_grad_norm).all()  # every unit is clipped

    trainer.train()
    assert_close(sums.sums[0], reference, rtol=1e-8, floor=1e-6)
    check_run(trainer, first_losses=losses)
    assert trainer.privacy_report()["unit"] == "example"


def test_sft_packed_micro_batch_is_one_padding_free_row_of_records(tmp_path) -> None:
    """What the DP loader hands the model under packing=True: the sampled records in one row, position ids
    restarting at each record, no attention mask; one privacy unit per record."""
    tokenizer = word_tokenizer()
    raw = Dataset.from_list([{"text": f"{mr} -> {text}"} for mr, text in sentences(24)])
    args = DPSFTConfig(output_dir=str(tmp_path), packing=True, noise_multiplier=1.0, **COMMON)
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer), args=args, train_dataset=raw, processing_class=tokenizer
    )
    loader = trainer.get_train_dataloader()
    batch = next(b for b in loader if b["hf_dp_example_mask"].sum() >= 2)
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    records = int((batch["position_ids"][0] == 0).sum())
    assert records == batch["hf_dp_example_mask"].shape[0]
    units = trainer.privacy_units(batch, None)
    assert units.count == records and not units.per_row


@pytest.mark.parametrize(
    "noise", [{}, {"noise_mechanism": "bandmf", "num_bands": "2"}], ids=["independent", "bandmf"]
)
def test_sft_lora_with_checkpointing_and_bf16_trains_only_adapters(tmp_path, noise) -> None:
    """TRL's defaults (bf16, activation checkpointing), LoRA via peft_config, ε budget: only the adapters move; with
    correlated noise the buffers hold b − 1 float32 copies of the adapters only."""
    tokenizer = word_tokenizer()
    model = tiny_llama(tokenizer)
    args = DPSFTConfig(
        output_dir=str(tmp_path),
        assistant_only_loss=True,
        target_epsilon=8.0,
        learning_rate=1e-2,
        **noise,
        **COMMON,
    )
    assert args.bf16 and args.activation_checkpointing
    trainer = DPSFTTrainer(
        model=model,
        args=args,
        train_dataset=chat_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
    )
    before = snapshot(trainer.model)
    trainer.train()
    check_run(trainer)
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert moved and all("lora_" in n for n in moved)
    assert trainer.get_epsilon() <= 8.0
    if noise:
        adapters = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        assert trainer.dp.mechanism.buffer_bytes() == adapters * 4
        assert trainer.privacy_report()["num_bands"] == 2 and trainer.accountant.steps == 1


# ---- DPO: exact per-pair clipping through DPDPOTrainer.train() ---------------------------------------


def completion_log_probs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Σ over each row's completion tokens of log p, from the plain logits (rows run together: one pair)."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits[:, :-1]
    targets = batch["input_ids"][:, 1:]
    logps = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    return (logps * batch["completion_mask"][:, 1:]).sum(dim=1)


@pytest.mark.parametrize("setup", ["lora", "ref_model", "precomputed"])
def test_dpo_clips_each_pair_exactly(setup: str, tmp_path) -> None:
    """The first logical batch's clipped sum = Σ_pairs clip(∇L_pair), L_pair = -log σ(β((c - c_ref) - (r - r_ref)))
    of the pair's two rows run alone, one backward per pair; the reference is frozen: no gradient, unchanged.
    Then a second step; ε in the logs; the guarantee is per pair."""
    tokenizer = word_tokenizer()
    model = tiny_llama(tokenizer).double()
    ref_model, peft_config, extra = None, None, {}
    if setup == "lora":
        peft_config = lora_config()
    elif setup == "ref_model":
        ref_model = copy.deepcopy(model)
        with torch.no_grad():  # a reference that differs from the policy
            for p in ref_model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    else:
        extra = {"precompute_ref_log_probs": True}
    args = DPDPOConfig(output_dir=str(tmp_path), **{**COMMON, **EXACT, **extra})
    trainer = DPDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=preference_dataset(),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    policy = trainer.model
    sums = ClippedSums(policy)
    trainer.add_callback(sums)
    frozen = snapshot(ref_model if ref_model is not None else policy)

    drawn = sampled_logical_batches(trainer, 1)[0]
    assert len(drawn) >= 3
    beta, units = trainer.args.beta, []
    for i in drawn:
        pair = trainer.data_collator([trainer.train_dataset[i]])
        assert pair["input_ids"].shape[0] == 2  # chosen and rejected rows
        if setup == "precomputed":
            row = trainer.train_dataset[i]
            ref = torch.tensor([row["ref_chosen_logps"], row["ref_rejected_logps"]], dtype=torch.float64)
        else:  # TRL's own reference log-probs, the constants of the loss
            ref = torch.cat(trainer.compute_ref_log_probs(ref_model or policy, pair)).double()
        with torch.no_grad():
            if setup == "lora":
                with policy.disable_adapter():
                    independent = completion_log_probs(policy, pair)
            else:
                independent = completion_log_probs(ref_model if ref_model is not None else policy, pair)
        torch.testing.assert_close(ref, independent, rtol=1e-5, atol=1e-5)

        def loss_of(pair=pair, ref=ref):
            chosen, rejected = completion_log_probs(policy, pair)
            return -F.logsigmoid(beta * ((chosen - ref[0]) - (rejected - ref[1])))

        units.append(loss_of)
    reference, norms, losses = oracle.clipped_sum(policy, units, args.per_sample_max_grad_norm)
    assert (norms > 100 * args.per_sample_max_grad_norm).all()

    trainer.train()
    assert_close(sums.sums[0], reference, rtol=1e-8, floor=1e-6)
    check_run(trainer, first_losses=losses)
    assert trainer.privacy_report()["unit"] == "pair" and trainer.privacy_metrics()["privacy_unit"] == "pair"
    clipped = {id(p) for p in trainer.dp.engine.parameters} if trainer.dp.engine else set()
    if ref_model is not None:
        assert all(torch.equal(frozen[n], p) and p.grad is None for n, p in ref_model.named_parameters())
        assert not clipped & {id(p) for p in ref_model.parameters()}
    elif setup == "lora":
        assert all(torch.equal(frozen[n], p) for n, p in policy.named_parameters() if "lora_" not in n)


# ---- DPO: the per-pair losses are TRL's --------------------------------------------------------------

LOSS_CASES = [
    *[{"loss_type": [t]} for t in PER_PAIR_LOSS_TYPES if t not in ("exo_pair", "robust")],
    {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
    {"loss_type": ["robust"], "label_smoothing": 0.1},
    {"loss_type": ["sigmoid", "bco_pair", "ipo"], "loss_weights": [0.8, 0.2, 1.0]},
    {"loss_type": ["sigmoid"], "f_divergence_type": "js_divergence"},
    {"loss_type": ["hinge"], "f_divergence_type": "forward_kl"},
    {"loss_type": ["sigmoid"], "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
    {"loss_type": ["sigmoid"], "ld_alpha": 0.5},
]


@pytest.fixture(scope="module")
def dpo_trainers(tmp_path_factory):
    """Two DPDPOTrainers (one with WPO weighting, which changes TRL's fused head) and a batch of 4 pairs
    whose policy differs from the reference."""
    tokenizer = word_tokenizer()
    out = str(tmp_path_factory.mktemp("dpo"))
    trainers = {}
    for weighting in (False, True):
        model = tiny_llama(tokenizer)
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.1 * torch.randn_like(p))
        args = DPDPOConfig(
            output_dir=out,
            noise_multiplier=1.0,
            beta=0.5,
            use_weighting=weighting,
            **{**COMMON, "bf16": False},
        )
        trainers[weighting] = DPDPOTrainer(
            model=model,
            ref_model=ref,
            args=args,
            train_dataset=preference_dataset(8),
            processing_class=tokenizer,
        )
    batch = trainers[False].data_collator([trainers[False].train_dataset[i] for i in range(4)])
    return trainers, batch


@pytest.mark.parametrize("case", [*LOSS_CASES, {"loss_type": ["sigmoid"], "use_weighting": True}], ids=str)
def test_dpo_pair_losses_average_to_trls_loss(case: dict, dpo_trainers) -> None:
    """For every per-pair loss type (and loss weights, f-divergences, LD-DPO, WPO weighting) the mean of
    DPDPOTrainer's per-pair losses is DPOTrainer._compute_loss on the same batch (TRL's fused LM head: float32)."""
    trainers, batch = dpo_trainers
    trainer = trainers[case.get("use_weighting", False)]
    trainer.loss_types = case["loss_type"]
    trainer.loss_weights = case.get("loss_weights", [1.0] * len(case["loss_type"]))
    trainer.label_smoothing = case.get("label_smoothing", 0.0)
    trainer.f_divergence_type = case.get("f_divergence_type", "reverse_kl")
    trainer.f_alpha_divergence_coef = case.get("f_alpha_divergence_coef", 0.5)
    trainer.ld_alpha = case.get("ld_alpha")
    trainer.model.train()
    with torch.no_grad():
        theirs = DPOTrainer._compute_loss(trainer, trainer.model, dict(batch), return_outputs=False)
        ours = trainer.compute_per_example_loss(trainer.model, trainer._with_reference_log_probs(dict(batch)))
    assert ours.shape == (4,)
    torch.testing.assert_close(ours.mean(), theirs, rtol=2e-5, atol=2e-6)
    assert ours.std() > 1e-4  # the pairs' losses differ: a real per-pair vector, not the mean repeated


def test_preference_pairs_without_signal_are_named_not_blamed_on_a_module(tmp_path) -> None:
    # every pair's chosen equal to its rejected: the gradient is 0 up to rounding, and the first step's sum check
    # compared rounding with rounding, refusing embed_tokens's "rule"
    tokenizer = word_tokenizer()
    model = tiny_llama(tokenizer)
    pairs = Dataset.from_list([{**r, "rejected": r["chosen"]} for r in preference_dataset(32)])
    args = DPDPOConfig(
        output_dir=str(tmp_path),
        noise_multiplier=1.0,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,
    )
    trainer = DPDPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=pairs,
        processing_class=tokenizer,
    )
    with pytest.raises(
        ValueError, match=r"gradient is zero up to rounding .* chosen and rejected are the same"
    ):
        trainer.train()


def test_datasets_and_references_trl_would_fail_on_deep_inside_are_named(tmp_path) -> None:
    tokenizer = word_tokenizer()
    common = dict(output_dir=str(tmp_path), noise_multiplier=1.0, use_cpu=True, report_to="none", bf16=False)
    texts = Dataset.from_dict({"body": [f"{mr} {text}" for mr, text in sentences(8)]})
    with pytest.raises(
        ValueError, match=r"train_dataset has no column dataset_text_field='text' \(it has \['body'\]\)"
    ):
        DPSFTTrainer(
            tiny_llama(tokenizer), DPSFTConfig(**common), train_dataset=texts, processing_class=tokenizer
        )
    unpaired = preference_dataset(8).remove_columns(["rejected"])
    model = tiny_llama(tokenizer)
    with pytest.raises(ValueError, match=r"train_dataset has no 'rejected' column"):
        DPDPOTrainer(
            model,
            copy.deepcopy(model),
            DPDPOConfig(**common),
            train_dataset=unpaired,
            processing_class=tokenizer,
        )
    with pytest.raises(
        ValueError, match=r"ref_model=None: .* pass ref_model=copy.deepcopy\(model\)"
    ):  # was OSError
        DPDPOTrainer(
            model,
            None,
            DPDPOConfig(**common),
            train_dataset=preference_dataset(8),
            processing_class=tokenizer,
        )
