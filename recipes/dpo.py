"""Differentially private DPO through TRL's own DPOTrainer (``hf_dp.trl.DPDPOTrainer``), on preference pairs
made offline from E2E.

    python recipes/dpo.py                          # ε = 8, SmolLM2-135M-Instruct + LoRA; the reference is the
                                                   # model with the adapters disabled
    python recipes/dpo.py --no_lora                # full fine-tuning, a frozen copy as the reference
    python recipes/dpo.py --from_scratch --no_lora --learning_rate 5e-3    # a tiny Llama from scratch
    python recipes/dpo.py --precompute_ref_log_probs    # the reference's log-probs once, before training (slow
                                                        # on CPU: TRL's chunked LM head, ≈ 3 min for 1000 pairs)
    python recipes/sft.py --save_model --output_dir out/sft && python recipes/dpo.py --model_name_or_path out/sft
    accelerate launch --config_file recipes/configs/single_process.yaml recipes/dpo.py ...

Pairs (``../shared/data/e2e``): the rows of ``trainset.csv`` grouped by meaning representation, in file order;
for each MR the user asks for a sentence about it (as in recipes/sft.py), the CHOSEN answer is its first human
reference and the REJECTED answer the first reference of the next MR (a fluent sentence about another
restaurant). One pair is one dataset row and one privacy unit: its chosen and rejected rows are clipped
together (``privacy_unit = "pair"``). The first ``--max_eval_samples`` MRs of ``devset.csv`` give the held-out
DPO loss and reward accuracy (TRL's own evaluation).

Model: as recipes/sft.py: by default SmolLM2-135M-Instruct with its chat template and LoRA adapters (r 16 on
q, k, v, o and the MLP projections), ``--no_lora`` for full fine-tuning, ``--model_name_or_path`` for any other
causal LM (e.g. the SFT recipe's saved model), ``--from_scratch`` for a tiny Llama with the GPT-2 tokenizer and
a plain chat template. With ``--no_lora`` and without ``--precompute_ref_log_probs`` the reference is a frozen
copy of the initial model. Every ``DPDPOConfig``
argument (TRL's ``DPOConfig`` and hf_dp's ``DPTrainingArguments``) is accepted; the recipe changes some
defaults (``RECIPE_DEFAULTS``, sized to finish in a few minutes on 2 CPU cores) and sets ε = 8 unless
``--target_epsilon``, ``--noise_multiplier`` or ``--disable_dp`` is given. Loss and ε are printed as training
goes; the last line reads ``E2E DPO: dev reward accuracy … (loss …) at epsilon … (delta …, N steps)``, and
``--results_json`` keeps the settings and results.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/dpo.py` from anywhere

from recipes.common import set_offline_defaults  # noqa: E402

set_offline_defaults()

from datasets import Dataset  # noqa: E402
from transformers import HfArgumentParser, set_seed  # noqa: E402

from hf_dp.trl import DPDPOConfig, DPDPOTrainer  # noqa: E402
from recipes.common import (  # noqa: E402
    COMMON_DEFAULTS,
    add_no_lora_flag,
    causal_lm_path,
    parse_recipe_args,
    privacy_record,
    report_run,
)
from recipes.sft import (  # noqa: E402
    ModelArguments,
    build_model,
    e2e_dir,
    load_chat_tokenizer,
    peft_config_of,
    read_e2e_rows,
    training_settings,
    user_turn,
)

# TRL's defaults stay, except: no bf16 autocast and no activation checkpointing on 2 CPU cores (pass --bf16 /
# --activation_checkpointing on a GPU), a learning rate for LoRA adapters under DP noise (TRL's 1e-6 suits full
# fine-tuning without noise), and TRL's own column handling. A pipeline check at reduced scale, not a tuned run.
RECIPE_DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "remove_unused_columns": True,
    "output_dir": "out/dpo",
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "per_device_eval_batch_size": 16,
    "max_steps": 6,
    "learning_rate": 1e-3,
    "lr_scheduler_type": "constant",
    "per_sample_max_grad_norm": 1.0,
    "logging_steps": 2,
    "max_length": 128,
    "bf16": False,
    "activation_checkpointing": False,
}
DEFAULT_EPSILON = 8.0


@dataclass
class DataArguments:
    data_dir: str | None = field(default=None, metadata={"help": "Default: ../shared/data/e2e."})
    max_train_samples: int | None = field(
        default=1000, metadata={"help": "Pairs from the first N MRs of trainset.csv (0: all of them)."}
    )
    max_eval_samples: int = field(default=16, metadata={"help": "Held-out pairs from the first N dev MRs."})
    results_json: str | None = field(default=None, metadata={"help": "Write settings and results here."})


def preference_pairs(rows: list[dict[str, str]], limit: int | None = None) -> list[dict[str, Any]]:
    """One conversational pair per MR (file order): chosen = its first reference, rejected = the next MR's."""
    first: dict[str, str] = {}
    for row in rows:
        first.setdefault(row["mr"], row["ref"])
    mrs = list(first)
    pairs = [
        {
            "prompt": [user_turn(mr)],
            "chosen": [{"role": "assistant", "content": first[mr]}],
            "rejected": [{"role": "assistant", "content": first[mrs[(k + 1) % len(mrs)]]}],
        }
        for k, mr in enumerate(mrs)
    ]
    return pairs[:limit] if limit else pairs


def run(argv: list[str] | None = None) -> tuple[DPDPOTrainer, dict[str, Any]]:
    """Parse ``argv`` (default: the command line), train, evaluate; return the trainer and the record."""
    parser = add_no_lora_flag(HfArgumentParser((ModelArguments, DataArguments, DPDPOConfig)))
    model_args, data_args, args = parse_recipe_args(parser, RECIPE_DEFAULTS, DEFAULT_EPSILON, argv)
    model_args.model_name_or_path = causal_lm_path(model_args)  # None: from scratch
    folder = e2e_dir(data_args)
    train_pairs = preference_pairs(read_e2e_rows(folder / "trainset.csv"), data_args.max_train_samples)
    dev_pairs = preference_pairs(read_e2e_rows(folder / "devset.csv"), data_args.max_eval_samples)
    tokenizer = load_chat_tokenizer(model_args)
    set_seed(args.seed)
    model = build_model(model_args, tokenizer, args)
    separate_reference = not model_args.use_lora and not args.precompute_ref_log_probs
    ref_model = copy.deepcopy(model).eval() if separate_reference else None
    trainer = DPDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=Dataset.from_list(train_pairs),
        processing_class=tokenizer,
        peft_config=peft_config_of(model_args),
    )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    reference = (
        "frozen copy" if separate_reference else "adapters disabled" if model_args.use_lora else "precomputed"
    )
    print(
        f"E2E DPO: N={trainer.num_train_examples} preference pairs  expected batch={trainer.expected_batch_size} pairs  "
        f"q={trainer.sample_rate:.5f}  steps={trainer.planned_steps}  sigma={trainer.noise_multiplier:.4f}  "
        f"C={args.per_sample_max_grad_norm:g}  delta={trainer.target_delta:.3g}  trainable params={trainable:,}  "
        f"reference: {reference}  model: {model_args.model_name_or_path or 'Llama from scratch'}",
        flush=True,
    )
    started = time.time()
    train_output = trainer.train()
    train_seconds = time.time() - started
    trainer.evaluate(eval_dataset=Dataset.from_list(dev_pairs))
    metrics = trainer.state.log_history[-1]  # with TRL's own evaluation metrics (rewards, margins)
    accuracy, eval_loss = metrics["eval_rewards/accuracies"], metrics["eval_loss"]
    record = {
        "task": "E2E DPO (chosen: the MR's reference, rejected: another MR's)",
        "model_name_or_path": model_args.model_name_or_path,
        "pretrained": model_args.model_name_or_path is not None,
        "eval_reward_accuracy": accuracy,
        "eval_loss": eval_loss,
        "eval_reward_margin": metrics.get("eval_rewards/margins"),
        "eval_pairs": len(dev_pairs),
        **privacy_record(trainer, train_output, train_seconds),
        "trainable_parameters": trainable,
        "reference": reference,
        "settings": {
            "model": model_args,
            "data": data_args,
            "training": training_settings(args, RECIPE_DEFAULTS),
        },
    }
    headline = f"E2E DPO: dev reward accuracy {accuracy:.4f} (loss {eval_loss:.4f})"
    report_run(trainer, record, data_args.results_json, headline)
    return trainer, record


def main() -> None:
    run()


if __name__ == "__main__":
    main()
