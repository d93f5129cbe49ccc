"""Small datasets, collators and trainer builders for the DPTrainer tests."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.sampling import PoissonBatchSampler, SamplerConfig
from tests import models


class TokenRows(Dataset):
    """Random token rows of ragged lengths (3..length), like tokenised sentences."""

    def __init__(self, n: int, length: int = 10, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, length + 1, (n,), generator=g)
        self.rows = [torch.randint(3, models.VOCAB, (int(k),), generator=g).tolist() for k in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def pad_collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad; padding gets attention 0 and label -100."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), length), models.PAD)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        mask[i, : len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def left_pad_collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Left-pad with an attention mask and no position_ids (a decoder tokenizer's padding_side='left')."""
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), length), models.PAD)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, length - n :], mask[i, length - n :] = torch.tensor(e["input_ids"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_args(tmp_path, **overrides) -> DPTrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=0.5,
        lr_scheduler_type="constant",
        dp_optimizer="sgd",
        per_sample_max_grad_norm=0.5,
        max_steps=2,
        seed=7,
    )
    return DPTrainingArguments(**{**defaults, **overrides})


def make_trainer(tmp_path, dataset=None, model=None, trainer_class=DPTrainer, **overrides) -> DPTrainer:
    return trainer_class(
        model=model if model is not None else models.gpt2(),
        args=make_args(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else TokenRows(32),
        data_collator=pad_collate,
    )


def sampled_logical_batches(trainer: DPTrainer, steps: int, epoch: int = 0) -> list[list[int]]:
    """The indices of the first ``steps`` logical batches the trainer will draw, from an independent sampler."""
    sampler = PoissonBatchSampler(
        num_samples=trainer.num_train_examples,
        sample_rate=trainer.sample_rate,
        config=SamplerConfig(
            steps_per_epoch=trainer.steps_per_epoch,
            num_micro_batches=trainer.args.gradient_accumulation_steps,
            seed=trainer.dp.secret.sampling_key,
        ),
    )
    sampler.set_epoch(epoch)
    micro = list(sampler)
    gas = trainer.args.gradient_accumulation_steps
    return [sum(micro[k * gas : (k + 1) * gas], []) for k in range(steps)]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_step_clips_each_example_alone(tmp_path, collator) -> list[int]:
    """One noise-free SGD step of a float64 GPT-2 whose micro-batches ``collator`` forms: it must equal
    lr · Σ_i clip(∇L_i) / B̄ with each drawn example run alone (one backward each), every example clipped.
    Returns the drawn example indices."""
    from tests import oracle

    torch.manual_seed(0)
    model = models.gpt2().double()
    model.config.use_cache = False
    dataset = TokenRows(24)
    trainer = make_trainer(
        tmp_path,
        dataset=dataset,
        model=model,
        noise_multiplier=0.0,
        max_steps=1,
        insecure_dp_seed=11,
        per_sample_max_grad_norm=0.05,
    )
    trainer.data_collator = collator
    before = snapshot(model)
    drawn = sampled_logical_batches(trainer, 1)[0]
    alone = [[{"input_ids": torch.tensor(dataset[i]["input_ids"])[None]}] for i in drawn]
    for parts in alone:
        parts[0]["labels"] = parts[0]["input_ids"]
    reference, norms = oracle.per_unit(model, alone, 0.05)
    assert (norms > 0.05).all()
    trainer.train()
    lr, expected_batch = trainer.args.learning_rate, trainer.expected_batch_size
    for name, p in model.named_parameters():
        step = (before[name] - p.detach()).double()
        torch.testing.assert_close(step, lr * reference[name] / expected_batch, rtol=1e-8, atol=1e-12)
    return drawn
