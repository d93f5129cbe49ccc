"""The DP data loader: Poisson (or shuffled fixed-size) logical batches, split into micro-batches.

Each micro-batch carries a (B,) mask of real examples under ``EXAMPLE_MASK_KEY``; an empty micro-batch
(small Poisson batches have them) becomes one placeholder example with mask 0, so every step runs the same
code path and every process runs every pass. The loader's first micro-batch also carries ``ALONE_KEY``: a few of
its examples collated alone, for the first step's check that no example's loss depends on the rest of its batch
(``clipping.checks.check_examples_alone``). The loader is not passed through ``accelerator.prepare``: the
sampler itself splits each global logical batch across processes.

User-level sampling (``unit_of_row`` given): the sampler draws units (e.g. users), at most ``k`` rows each
(``UnitPoissonBatchSampler``), and each micro-batch also carries ``UNIT_KEY``, the (R,) local unit 0..U-1 of
each of its R rows (in order of first appearance); its mask is then (U,), one entry per unit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from hf_dp.sampling import (
    CyclicPartition,
    PoissonBatchSampler,
    SamplerConfig,
    ShuffledBatchSampler,
    UnitPoissonBatchSampler,
)

EXAMPLE_MASK_KEY = "hf_dp_example_mask"
UNIT_KEY = "hf_dp_unit"
ALONE_KEY = (
    "hf_dp_alone"  # [(row, that row's example collated alone)], in the loader's first micro-batch only
)
ALONE_SAMPLE = (
    2  # examples checked alone: the same count on every process (a sharded forward is a collective)
)


class EpochDataLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches our batch sampler (the Trainer calls it each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class UnitDataset(Dataset):
    """``dataset`` with each row's unit: item ``i`` is ``(dataset[i], unit_of_row[i])``, unpacked by
    ``MaskingCollator`` (a collator sees only the examples, and the Trainer drops unused columns such as a
    user id). Other attributes are the wrapped dataset's."""

    def __init__(self, dataset, unit_of_row: Sequence[int]) -> None:
        if len(unit_of_row) != len(dataset):
            raise ValueError(
                f"unit_of_row has {len(unit_of_row)} entries for {len(dataset)} dataset rows; "
                "give one unit per row."
            )
        self.dataset = dataset
        self.unit_of_row = np.asarray(unit_of_row)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.dataset[index], int(self.unit_of_row[index])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "unit_of_row"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


class MaskingCollator:
    """Collates a micro-batch and adds its example mask (a placeholder example with mask 0 when empty).

    Over a ``UnitDataset`` (pairs ``(example, unit)``) it also adds ``UNIT_KEY``, the (R,) local unit 0..U-1
    of each row in order of first appearance, and the mask is (U,) ones; an empty micro-batch gives the
    placeholder row with unit [0] and mask zeros(1).
    """

    def __init__(self, collator, dataset) -> None:
        self.collator = collator
        self.dataset = dataset
        self.by_unit = isinstance(dataset, UnitDataset)
        self.alone_pending = (
            not self.by_unit
        )  # users' rows form units: their check is the unit's, not a row's

    def __call__(self, examples: list) -> dict[str, Any]:
        if not self.by_unit:
            real = len(examples)
            examples = examples if real else [self.dataset[0]]
            batch = dict(self.collator(examples))
            if self.alone_pending:  # cut from the model's inputs only, before the mask joins them
                batch[ALONE_KEY] = self.alone(examples, batch)
                self.alone_pending = False
            batch[EXAMPLE_MASK_KEY] = torch.ones(real) if real else torch.zeros(1)
            return batch
        if not examples:
            batch = dict(self.collator([self.dataset[0][0]]))
            batch[UNIT_KEY] = torch.zeros(1, dtype=torch.long)
            batch[EXAMPLE_MASK_KEY] = torch.zeros(1)
            return batch
        rows, units = zip(*examples, strict=True)
        local: dict[int, int] = {}
        batch = dict(self.collator(list(rows)))
        batch[UNIT_KEY] = torch.tensor([local.setdefault(u, len(local)) for u in units], dtype=torch.long)
        batch[EXAMPLE_MASK_KEY] = torch.ones(len(local))
        return batch

    def alone(self, examples: list, batch: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
        """``ALONE_SAMPLE`` rows with the fewest real tokens, each with its example as it would be alone (repeated
        when the batch is smaller): the row cut to its attended tokens, or, without an attention mask, its
        example collated by itself (the training's random stream untouched). Only rows whose attended tokens are
        one span (padding at either end) are cut; none is checked when the batch carries a square (B, ·, T, T)
        mask, which has no row of its own to cut."""
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            if any(_square(value, mask.shape[1]) for value in batch.values()):
                return []
            kept = mask.bool()
            spans = [row for row in range(mask.shape[0]) if _one_span(kept[row])]
            if not spans:
                return []
            alone = {row: _cut_row(batch, row, kept[row]) for row in spans}
        else:
            with torch.random.fork_rng(devices=[]):
                alone = {row: dict(self.collator([example])) for row, example in enumerate(examples)}
        order = sorted(alone, key=lambda row: _length(alone[row]))
        return [(row, alone[row]) for row in (order[i % len(order)] for i in range(ALONE_SAMPLE))]


def _one_span(kept: torch.Tensor) -> bool:
    """Whether the True entries of a (T,) mask are contiguous (and there is one)."""
    where = kept.nonzero()
    return len(where) > 0 and int(where[-1]) - int(where[0]) + 1 == len(where)


def _square(value: Any, length: int) -> bool:
    return (
        isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape[-1] == value.shape[-2] == length
    )


def _cut_row(batch: dict[str, Any], row: int, kept: torch.Tensor) -> dict[str, Any]:
    """Row ``row`` of ``batch`` on its ``kept`` positions: (B, T, ...) tensors cut along T, (B, ...) ones to the row."""
    rows, length = batch["attention_mask"].shape
    cut = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (rows, length):
            cut[key] = value[row : row + 1, kept]
        elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
            cut[key] = value[row : row + 1]
        else:
            cut[key] = value
    return cut


def _length(batch: dict[str, Any]) -> int:
    """The sequence length of a collated batch: its ``input_ids``' last dimension (rows, or multiple-choice rows
    (batch, choices, length)), else its widest 2-D tensor's, 0 for none."""
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        return ids.shape[-1]
    return max(
        (v.shape[1] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), default=0
    )


def split_dp_keys(inputs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]:
    """(model inputs, mask, unit_of_row): ``unit_of_row`` is the batch's ``UNIT_KEY`` (None without one), and
    then the mask is per unit; a batch without a mask is all real (one per row, or one per unit)."""
    inputs = dict(inputs)
    inputs.pop(ALONE_KEY, None)
    mask = inputs.pop(EXAMPLE_MASK_KEY, None)
    unit_of_row = inputs.pop(UNIT_KEY, None)
    if mask is None and unit_of_row is not None:
        mask = torch.ones(int(unit_of_row.max()) + 1, device=unit_of_row.device)
    elif mask is None:
        first = next(v for v in inputs.values() if isinstance(v, torch.Tensor))
        mask = torch.ones(first.shape[0], device=first.device)
    return inputs, mask, unit_of_row


def split_example_mask(inputs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """(model inputs, mask): a batch without a mask is all real examples (``UNIT_KEY`` is dropped)."""
    inputs, mask, _ = split_dp_keys(inputs)
    return inputs, mask


def count_drawn_examples(batches: list[dict[str, Any]], device: torch.device, reduce: Callable) -> int:
    """The real examples (units) of a logical batch's micro-batches, summed over the processes by ``reduce``
    (accelerate's ``Accelerator.reduce``)."""
    drawn = sum(int(split_example_mask(b)[1].sum()) for b in batches)  # the loader's masks: on the host
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return drawn  # one process: no round trip through the device
    return int(reduce(torch.tensor(float(drawn), device=device), reduction="sum").item())


def units_of_column(values: Sequence[Hashable]) -> tuple[list[int], int]:
    """(unit_of_row, N_u): arbitrary hashable ids (e.g. a ``user_id`` column) numbered 0..N_u-1 in order of
    first appearance, so equal ids share a unit."""
    if isinstance(values, torch.Tensor | np.ndarray):  # their elements hash by identity, not value
        values = values.tolist()
    # a torch-formatted dataset's column is a list of 0-d tensors, which also hash by identity
    values = [v.item() if isinstance(v, torch.Tensor | np.ndarray) and v.ndim == 0 else v for v in values]
    ids: dict[Hashable, int] = {}
    unit_of_row = [ids.setdefault(v, len(ids)) for v in values]
    return unit_of_row, len(ids)


_BLOCK_COLUMNS = {"input_ids", "attention_mask", "labels", "token_type_ids"}


def rows_look_like_blocks(dataset, rows: int = 256) -> bool:
    """Whether the first ``rows`` rows look cut from concatenated text (transformers' run_clm ``group_texts``):
    token columns only, every row one length, labels equal to input_ids and no padding."""
    names = getattr(dataset, "column_names", None)
    if not names or not set(names) <= _BLOCK_COLUMNS or "labels" not in names or len(dataset) < 2:
        return False
    sample = dataset[: min(rows, len(dataset))]
    lengths = {len(ids) for ids in sample["input_ids"]}
    return (
        len(lengths) == 1
        and sample["labels"] == sample["input_ids"]
        and all(all(m) for m in sample.get("attention_mask", []))
    )


def dp_dataloader(
    dataset,
    collator,
    *,
    plan,
    sampling_key: int,
    args,
    partition_key: int | None = None,
    unit_of_row: Sequence[int] | None = None,
    max_rows_per_unit: int | None = None,
) -> EpochDataLoader:
    """The loader of ``plan``'s logical batches, drawn with ``sampling_key`` (the run's secret). With b > 1 bands
    the sampling is cyclic Poisson over b groups, a partition drawn with ``partition_key`` (also secret).

    With ``unit_of_row`` (each row's unit 0..N_u-1, see ``units_of_column``) it samples units with
    ``q = plan.sample_rate`` and at most ``max_rows_per_unit`` rows of each; its batches carry ``UNIT_KEY``.
    """
    config = SamplerConfig(
        steps_per_epoch=plan.steps_per_epoch,
        num_micro_batches=args.gradient_accumulation_steps,
        seed=sampling_key,
        secure_mode=args.secure_mode,
        num_replicas=args.world_size,
        rank=args.process_index,
    )
    if unit_of_row is not None:
        if not args.poisson_sampling:
            raise ValueError("user-level sampling (unit_of_row) is Poisson only: set poisson_sampling=True.")
        if max_rows_per_unit is None:
            raise ValueError(
                "pass max_rows_per_unit (k >= 1, the most rows of a unit in one step) with unit_of_row."
            )
        dataset = UnitDataset(dataset, unit_of_row)
        sampler = UnitPoissonBatchSampler(
            dataset.unit_of_row,
            plan.sample_rate,
            max_rows_per_unit,
            config,
            cycle=_cycle(plan, partition_key),
        )
    elif args.poisson_sampling:
        sampler = PoissonBatchSampler(
            plan.num_examples, plan.sample_rate, config, cycle=_cycle(plan, partition_key)
        )
    else:
        sampler = ShuffledBatchSampler(plan.num_examples, plan.expected_batch_size, config)
    return EpochDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=MaskingCollator(collator, dataset),
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        **_worker_options(args),
    )


def _cycle(plan, partition_key: int | None) -> CyclicPartition | None:
    """Cyclic Poisson sampling's groups for a plan with b > 1 bands (None: plain Poisson sampling)."""
    if plan.bands == 1:
        return None
    if partition_key is None:
        raise ValueError(f"{plan.bands} bands sample cyclically over a secret partition: pass partition_key")
    return CyclicPartition(plan.num_examples, plan.bands, partition_key)


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
