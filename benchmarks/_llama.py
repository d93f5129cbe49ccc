"""The one Llama of the LLM benchmarks (gpu_check.py, llm_memory.py; step_counts.py and step_flops.py through
llm_memory.py): its config and seeded build (LoRA-wrapped on request), the token rows, activation checkpointing as
``Trainer.train()`` enables it, and the stock / DPTrainer / Opacus steps each variant times.

Import it after ``benchmarks._timing`` (which sets the offline environment torch and transformers read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from benchmarks._opacus import ghost_clipping, ghost_step

SEED = 0
IGNORE_INDEX = -100
DATASET_BATCHES = 100  # N = 100 x B rows: the sample rate the DPTrainer plans with is 1/100
NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
# Trainer.train() enables checkpointing through this argument; older transformers call it gradient_checkpointing.
CKPT_ARG = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


@dataclass(frozen=True)
class Shape:
    """The Llama shape (defaults: llm_memory.py's, issue 30's small Llama)."""

    layers: int = 8
    hidden: int = 512
    intermediate: int = 1408
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 32000


def llama_config(shape: Shape, seq: int) -> LlamaConfig:
    """GQA, untied head, no attention dropout, no KV cache (training)."""
    return LlamaConfig(
        num_hidden_layers=shape.layers,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False,
        attention_dropout=0.0,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def lora_config(r: int):
    from peft import LoraConfig

    return LoraConfig(
        r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )


def build_llama(
    shape: Shape, seq: int, device: str, tuning: str = "full", lora_r: int = 16, init_on_device: bool = True
) -> nn.Module:
    """The seeded random Llama with fp32 weights on ``device``, LoRA-wrapped (rank ``lora_r``) for ``lora``: the
    same seed, the same weights in every variant. ``init_on_device``: drawn on the device (fast on a GPU; CUDA's
    generator), else on the CPU and moved (the same weights on every device)."""
    torch.manual_seed(SEED)
    with torch.device(device if init_on_device else "cpu"):
        model: nn.Module = LlamaForCausalLM(llama_config(shape, seq))
    if tuning == "lora":
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(lora_r))
    return model.to(device).train()


def token_rows(n: int, seq: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """N rows of T random token ids, labels = input ids (every token a target)."""
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(SEED + 1))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def next_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) mean next-token cross-entropy over each example's labelled tokens (hf_dp's L_i), in at least fp32:
    the per-example losses fed to Opacus."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tokens = F.cross_entropy(
        logits.to(dtype).flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view(targets.shape)
    return tokens.sum(dim=1) / (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)


# ---- checkpointing and the Trainer's preparation ------------------------------------------------------------


def enable_checkpointing(model: nn.Module, kwargs: dict | None = None) -> None:
    """What ``Trainer.train()`` does for ``activation_checkpointing=True``: on the base model (under peft too),
    non-reentrant unless ``kwargs`` say otherwise (older transformers defaulted to reentrant), ``every_n_layers``
    and ``offload`` taken out of the kwargs as the Trainer does; then the embeddings' output requires grad (what
    transformers' own enable does; older versions left it to the caller, which peft's frozen embeddings need)."""
    kwargs = dict(kwargs or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    kwargs = kwargs or {"use_reentrant": False}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers, offload=offload
        )
    else:
        extra = (
            {"every_n_layers": every_n_layers, "offload": offload} if every_n_layers != 1 or offload else {}
        )
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **extra)
    hooked = getattr(base, "_require_grads_hooks", None) or getattr(base, "_require_grads_hook", None)
    if not hooked and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


def is_checkpointing(model: nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(
        getattr(base, "is_activation_checkpointing", getattr(base, "is_gradient_checkpointing", False))
    )


def prepare_like_train(trainer: Trainer) -> nn.Module:
    """Checkpointing on the model and ``accelerator.prepare_model`` (autocast), as ``Trainer.train()`` does."""
    if getattr(trainer.args, CKPT_ARG):
        enable_checkpointing(trainer.model, getattr(trainer.args, f"{CKPT_ARG}_kwargs", None))
    trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model)
    return trainer.model_wrapped


def training_args(cls: type[TrainingArguments], device: str, folder: str, **extra: Any) -> TrainingArguments:
    """The arguments every Trainer variant shares: no saving, no logging, no progress bar, the seed."""
    return cls(
        output_dir=folder,
        report_to="none",
        use_cpu=device == "cpu",
        disable_tqdm=True,
        save_strategy="no",
        logging_strategy="no",
        seed=SEED,
        **extra,
    )


def dtype_probe(model: nn.Module, info: dict[str, Any]) -> None:
    """Records in ``info`` the dtype of the first MLP down projection's output once (what autocast did)."""
    linear = next(
        (m for n, m in model.named_modules() if n.endswith(("mlp.down_proj", "mlp.down_proj.base_layer"))),
        None,
    )
    if linear is None:
        return

    def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        info["mlp_output_dtype"] = str(output.dtype).replace("torch.", "")
        handle.remove()

    handle = linear.register_forward_hook(hook)


def model_info(model: nn.Module, info: dict[str, Any]) -> None:
    """Trainable parameters, whether checkpointing is on, and the dtype probe."""
    info["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info["checkpointing_active"] = is_checkpointing(model)
    dtype_probe(model, info)


def collated(trainer: Trainer, rows: list[dict], batch: int, micro_batches: int, device: str) -> list[dict]:
    """The step's micro-batches on the device: B rows each through the trainer's collator, the same rows in
    every variant."""
    return [
        {k: v.to(device) for k, v in trainer.data_collator(rows[k * batch : (k + 1) * batch]).items()}
        for k in range(micro_batches)
    ]


# ---- the variants' steps ----------------------------------------------------------------------------------------


def stock_step(
    model: nn.Module, args: TrainingArguments, rows: list[dict], batch: int, micro_batches: int, device: str
) -> tuple[Callable[[], float], Trainer, nn.Module]:
    """The stock Trainer prepared as ``Trainer.train()`` prepares it, and its step: ``training_step`` on each
    micro-batch + ``optimizer.step()``. Returns (step, trainer, the wrapped model)."""
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.create_optimizer()
    wrapped = prepare_like_train(trainer)
    trainer.current_gradient_accumulation_steps = micro_batches  # set by Trainer.train() for each window
    batches = collated(trainer, rows, batch, micro_batches, device)

    def step() -> float:
        loss = sum(trainer.training_step(wrapped, b) for b in batches)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return step, trainer, wrapped


def dp_trainer(
    model: nn.Module, args: TrainingArguments, rows: list[dict], batch: int, micro_batches: int, device: str
) -> tuple[Any, list[dict]]:
    """A ``DPTrainer`` prepared as ``Trainer.train()`` prepares it, and its fixed micro-batches (Poisson sampling
    lives in the loader, not timed)."""
    from hf_dp import DPTrainer

    trainer = DPTrainer(model=model, args=args, train_dataset=rows)
    if trainer.expected_batch_size != batch * micro_batches:
        raise RuntimeError(
            f"DPTrainer plans a logical batch of {trainer.expected_batch_size}, not {batch * micro_batches}"
        )
    trainer.create_optimizer()
    prepare_like_train(trainer)
    return trainer, collated(trainer, rows, batch, micro_batches, device)


def opacus_step(
    model: nn.Module, rows: list[dict], batch: int, device: str, checkpointing: bool, bf16: bool
) -> tuple[Callable[[], float], list[Any]]:
    """Opacus ghost clipping over ``model`` (checkpointing enabled as the Trainer would), one collated batch
    per step, per-example next-token losses (bf16 autocast when asked). Returns (step, objects to keep)."""
    from transformers import default_data_collator

    if checkpointing:
        enable_checkpointing(model)
    engine, dp_model, dp_optimizer = ghost_clipping(model, len(rows), batch, NOISE_MULTIPLIER, MAX_GRAD_NORM)
    if dp_optimizer.expected_batch_size != batch:
        raise RuntimeError(f"Opacus expects a batch of {dp_optimizer.expected_batch_size}, not {batch}")
    inputs = {k: v.to(device) for k, v in default_data_collator(rows[:batch]).items()}

    def step() -> float:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            logits = dp_model(input_ids=inputs["input_ids"]).logits
        return ghost_step(dp_model, dp_optimizer, next_token_losses(logits, inputs["labels"]))

    return step, [engine, dp_model, dp_optimizer]
