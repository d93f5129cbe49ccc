"""The DP data loader: Poisson (or shuffled fixed-size) logical batches, split into micro-batches.

Each micro-batch carries a (B,) mask of real examples under ``EXAMPLE_MASK_KEY``; an empty micro-batch
(small Poisson batches have them) becomes one placeholder example with mask 0, so every step runs the same
code path and every process runs every pass. The loader is not passed through ``accelerator.prepare``: the
sampler itself splits each global logical batch across processes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from hf_dp.sampling import PoissonBatchSampler, ShuffledBatchSampler

EXAMPLE_MASK_KEY = "hf_dp_example_mask"


class EpochDataLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches our batch sampler (the Trainer calls it each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class MaskingCollator:
    """Collates a micro-batch and adds its example mask (a placeholder example with mask 0 when empty)."""

    def __init__(self, collator, dataset) -> None:
        self.collator = collator
        self.dataset = dataset

    def __call__(self, examples: list) -> dict[str, Any]:
        real = len(examples)
        batch = dict(self.collator(examples if real else [self.dataset[0]]))
        batch[EXAMPLE_MASK_KEY] = torch.ones(real) if real else torch.zeros(1)
        return batch


def split_example_mask(inputs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """(model inputs, mask): a batch without a mask is all real examples."""
    inputs = dict(inputs)
    mask = inputs.pop(EXAMPLE_MASK_KEY, None)
    if mask is None:
        first = next(v for v in inputs.values() if isinstance(v, torch.Tensor))
        mask = torch.ones(first.shape[0], device=first.device)
    return inputs, mask


def dp_dataloader(
    dataset,
    collator,
    *,
    plan,
    sampling_key: int,
    args,
) -> EpochDataLoader:
    """The loader of ``plan``'s logical batches, drawn with ``sampling_key`` (the run's secret)."""
    common = {
        "num_samples": plan.num_examples,
        "steps_per_epoch": plan.steps_per_epoch,
        "num_micro_batches": args.gradient_accumulation_steps,
        "seed": sampling_key,
        "secure_mode": args.secure_mode,
        "num_replicas": args.world_size,
        "rank": args.process_index,
    }
    if args.poisson_sampling:
        sampler = PoissonBatchSampler(sample_rate=plan.sample_rate, **common)
    else:
        sampler = ShuffledBatchSampler(batch_size=plan.expected_batch_size, **common)
    return EpochDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=MaskingCollator(collator, dataset),
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        **_worker_options(args),
    )


def _worker_options(args) -> dict[str, Any]:
    """The Trainer's data-loader options that torch accepts only with worker processes."""
    if not args.dataloader_num_workers:
        return {}
    return {
        "persistent_workers": args.dataloader_persistent_workers,
        "prefetch_factor": args.dataloader_prefetch_factor,
        "multiprocessing_context": args.dataloader_multiprocessing_context,
        "in_order": args.dataloader_in_order,
    }
