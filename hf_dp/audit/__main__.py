"""``python -m hf_dp.audit``: audit your configuration with the flags of your training script.

    python -m hf_dp.audit --model_type gpt2 --dp_optimizer adamw --noise_multiplier 0.8 \\
        --per_device_train_batch_size 16 --gradient_accumulation_steps 4 --num_examples 4096 --trials 1000

Every ``DPTrainingArguments`` flag is accepted and used as in training; launch it with ``torchrun`` or
``accelerate launch`` to audit a DDP or DeepSpeed configuration. The model is a small member of your model's
family (the step's privacy does not depend on its size; ``--full_size`` keeps the real dimensions), trained on
random token rows, and the audit needs no data of yours: the canary rides on a probe layer (docs/audit.md).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    HfArgumentParser,
)

from hf_dp.arguments import DPTrainingArguments
from hf_dp.audit.runs import audit_one_run, audit_step

SMALL = {  # config attribute → the value of a small member of the family
    "num_hidden_layers": 1,
    "n_layer": 1,
    "num_layers": 1,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "num_attention_heads": 2,
    "n_head": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "vocab_size": 512,
}


@dataclass
class AuditArguments:
    audit: str = field(default="step", metadata={"help": "step, one-run or both"})
    model_type: str | None = field(
        default=None, metadata={"help": "a transformers model type, e.g. gpt2, llama"}
    )
    model: str | None = field(
        default=None, metadata={"help": "a model name or local folder: its config's family"}
    )
    task: str = field(default="causal-lm", metadata={"help": "causal-lm or sequence-classification"})
    full_size: bool = field(default=False, metadata={"help": "keep the config's dimensions (slower)"})
    num_examples: int = field(default=256, metadata={"help": "N of your run: q = expected batch / N"})
    seq_len: int = field(default=16, metadata={"help": "tokens per synthetic row"})
    trials: int = field(default=1000, metadata={"help": "step audit: one-step trials per world"})
    canaries: int = field(
        default=1000, metadata={"help": "one-run audit: canaries, each included with prob. ½"}
    )
    confidence: float = field(default=0.95, metadata={"help": "confidence of the lower bounds"})
    audit_dir: str = field(default="audit", metadata={"help": "where audit.json and the score plot go"})


class RandomTokenRows(Dataset):
    """Rows of uniform random tokens (and a random class for classification): a stand-in for the user's data."""

    def __init__(self, n: int, seq_len: int, vocab: int, num_labels: int | None, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)
        self.labels = self.ids if num_labels is None else torch.randint(0, num_labels, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "labels": self.labels[i],
        }


def model_factory(audit: AuditArguments) -> tuple[Callable[[], nn.Module], int]:
    """A builder of the (small) model of the family, and its vocabulary size."""
    if (audit.model is None) == (audit.model_type is None):
        raise ValueError(
            "hf_dp.audit: give exactly one of --model_type (e.g. gpt2) and --model (a name or folder)"
        )
    if audit.task not in ("causal-lm", "sequence-classification"):
        raise ValueError(
            f"hf_dp.audit: --task must be causal-lm or sequence-classification, got {audit.task!r}"
        )
    config = (
        AutoConfig.from_pretrained(audit.model) if audit.model else AutoConfig.for_model(audit.model_type)
    )
    if not audit.full_size:
        for name, value in SMALL.items():
            if hasattr(config, name):
                setattr(config, name, value)
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    auto = AutoModelForCausalLM if audit.task == "causal-lm" else AutoModelForSequenceClassification

    def build() -> nn.Module:
        torch.manual_seed(0)
        return auto.from_config(config)

    return build, config.vocab_size


def plot_scores(result, path: str) -> bool:
    """Histograms of the two score distributions (step audit); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(result.scores_without, bins=60, alpha=0.6, label="D (without the canary)")
    ax.hist(result.scores_with, bins=60, alpha=0.6, label="D' (with the canary)")
    ax.axvline(result.threshold.event.threshold, color="k", lw=1, ls="--", label="threshold")
    ax.set_xlabel("probe update / learning rate")
    ax.set_title(
        f"{result.optimizer}: ε ≥ {result.threshold.epsilon:.2f} vs {result.threshold.claimed_epsilon:.2f}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    audit, args = HfArgumentParser((AuditArguments, DPTrainingArguments)).parse_args_into_dataclasses(argv)
    if audit.audit not in ("step", "one-run", "both"):
        raise ValueError(f"hf_dp.audit: --audit must be step, one-run or both, got {audit.audit!r}")
    build, vocab = model_factory(audit)
    num_labels = None if audit.task == "causal-lm" else 2
    data = RandomTokenRows(audit.num_examples, audit.seq_len, vocab, num_labels)
    results: dict = {}
    if audit.audit in ("step", "both"):
        step = audit_step(args, build, data, trials=audit.trials, confidence=audit.confidence)
        results["step"] = step
    if audit.audit in ("one-run", "both"):
        results["one_run"] = audit_one_run(
            args, build, data, canaries=audit.canaries, confidence=audit.confidence
        )
    if args.process_index == 0:
        os.makedirs(audit.audit_dir, exist_ok=True)
        for result in results.values():
            print(result)
        with open(os.path.join(audit.audit_dir, "audit.json"), "w") as f:
            json.dump({name: result.summary() for name, result in results.items()}, f, indent=2)
        scores = {}  # the raw scores, to re-plot or re-test: they come from random rows, not the user's data
        if "step" in results:
            scores.update(without=results["step"].scores_without, **{"with": results["step"].scores_with})
        if "one_run" in results:
            scores.update(
                canary_scores=results["one_run"].scores, canary_included=results["one_run"].included
            )
        np.savez(os.path.join(audit.audit_dir, "scores.npz"), **scores)
        if "step" in results and not plot_scores(
            results["step"], os.path.join(audit.audit_dir, "scores.png")
        ):
            print("hf_dp.audit: no plot (install matplotlib, or hf-dp[audit])")
    return results


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        # The report is written: leave without interpreter teardown, where the gloo threads of process groups that
        # DeepSpeed and DDP still hold can abort the process (pytorch/pytorch#179291).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
