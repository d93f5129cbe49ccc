"""User-level Poisson sampling (ULS, Charles et al. 2024): ``UnitPoissonBatchSampler`` and the unit-aware data
loader pieces of ``hf_dp.data`` (``UnitDataset``, ``MaskingCollator``, ``split_dp_keys``, ``units_of_column``)."""

from __future__ import annotations

import itertools
import math
import pickle
import types
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import default_data_collator

from hf_dp.data import (
    ALONE_KEY,
    EXAMPLE_MASK_KEY,
    UNIT_KEY,
    MaskingCollator,
    UnitDataset,
    dp_dataloader,
    split_dp_keys,
    split_example_mask,
    units_of_column,
)
from hf_dp.sampling import SamplerConfig, UnitPoissonBatchSampler
from tests.test_sampling import build


def steps_of(sampler) -> list[list[list[int]]]:
    """One epoch grouped into steps: ``result[step][micro]`` is a list of row indices."""
    yields = list(sampler)
    assert len(yields) == len(sampler) == sampler.steps_per_epoch * sampler.num_micro_batches
    assert all(isinstance(mb, list) for mb in yields)
    m = sampler.num_micro_batches
    return [yields[i : i + m] for i in range(0, len(yields), m)]


def flat(micro_batches: list[list[int]]) -> list[int]:
    return [i for mb in micro_batches for i in mb]


def runs(rows: list[int], unit_of_row) -> list[tuple[int, list[int]]]:
    """(unit, its rows) for each maximal run of consecutive rows of one unit."""
    return [(u, list(g)) for u, g in itertools.groupby(rows, key=lambda r: unit_of_row[r])]


def units_in(rows: list[int], unit_of_row) -> list[int]:
    """The units of ``rows`` in order; asserts that each unit's rows are adjacent (one run per unit)."""
    units = [u for u, _ in runs(rows, unit_of_row)]
    assert len(units) == len(set(units)), f"a unit's rows are not adjacent: {rows}"
    return units


def mixed_sizes(num_units: int, sizes: list[int], seed: int = 0) -> list[int]:
    """unit_of_row for ``num_units`` units of cycling ``sizes``, rows of different units shuffled together."""
    units = [u for u in range(num_units) for _ in range(sizes[u % len(sizes)])]
    return np.random.default_rng(seed).permutation(units).tolist()


# ---------------------------------------------------------------- inclusion rates


def test_units_are_included_at_rate_q_whatever_their_size():
    sizes = [1, 2, 3, 5, 8, 13, 40]  # k = 3 caps most of them
    n_units, q, k, steps = 140, 0.1, 3, 3000
    unit_of_row = mixed_sizes(n_units, sizes)
    x = np.zeros((steps, n_units), dtype=bool)  # unit u in logical batch t
    for t, step in enumerate(
        steps_of(UnitPoissonBatchSampler(unit_of_row, q, k, SamplerConfig(steps, seed=1)))
    ):
        x[t, units_in(flat(step), unit_of_row)] = True

    # All units together: a binomial test that accepts q and rejects q' = 1.2 q.
    total, trials = int(x.sum()), x.size
    assert stats.binomtest(total, trials, q).pvalue > 1e-3
    assert stats.binomtest(total, trials, 1.2 * q).pvalue < 1e-6
    # Each size class separately (20 units x 3000 steps): the rate does not depend on n_u; 5 SD ~ 0.4 * 0.2 q.
    size_of = np.array([sizes[u % len(sizes)] for u in range(n_units)])
    for size in sizes:
        rate = x[:, size_of == size].mean()
        assert abs(rate - q) < 5 * math.sqrt(q * (1 - q) / (steps * np.sum(size_of == size))), size
    # No unit systematically excluded or favoured: each count ~ Binomial(steps, q).
    counts = x.sum(axis=0)
    assert np.all(np.abs(counts - steps * q) < 5.5 * math.sqrt(steps * q * (1 - q)))

    # Units per step ~ Binomial(N_u, q): mean and variance (fixed-size unit batches would have variance 0).
    per_step = x.sum(axis=1)
    mean, var = n_units * q, n_units * q * (1 - q)
    assert abs(per_step.mean() - mean) < 5 * math.sqrt(var / steps)
    assert abs(per_step.var(ddof=1) - var) < 6 * var * math.sqrt(2 / (steps - 1))


def test_each_row_is_in_a_step_with_probability_q_min_k_n_over_n():
    unit_of_row = mixed_sizes(60, [1, 2, 4, 10], seed=3)
    n_u = np.bincount(unit_of_row)
    q, k, steps = 0.3, 2, 3000
    hits = np.zeros(len(unit_of_row))
    for step in steps_of(UnitPoissonBatchSampler(unit_of_row, q, k, SamplerConfig(steps, seed=4))):
        hits[flat(step)] += 1
    p = q * np.minimum(k, n_u[unit_of_row]) / n_u[unit_of_row]
    assert np.all(np.abs(hits - steps * p) < 5.5 * np.sqrt(steps * p * (1 - p)))


# ---------------------------------------------------------------- the k cap


def test_a_unit_contributes_min_k_n_distinct_rows_of_its_own():
    unit_of_row = [0, 1, 0, 2, 0, 0, 2, 0, 0, 0, 2, 0, 3, 0, 0]  # n_u = 10, 1, 3, 1 interleaved
    rows_of = {u: [r for r, v in enumerate(unit_of_row) if v == u] for u in range(4)}
    k, steps = 3, 4000
    subsets = []
    for step in steps_of(
        UnitPoissonBatchSampler(unit_of_row, 1.0, k, SamplerConfig(steps, seed=5))
    ):  # q = 1: every unit
        assert units_in(flat(step), unit_of_row) == [0, 1, 2, 3]  # every unit, once, in increasing order
        chunks = dict(runs(flat(step), unit_of_row))
        assert len(chunks[0]) == len(set(chunks[0])) == k and set(chunks[0]) <= set(rows_of[0])
        assert chunks[0] == sorted(chunks[0])
        assert (
            chunks[1] == rows_of[1] and chunks[2] == rows_of[2] and chunks[3] == rows_of[3]
        )  # n_u <= k: all
        subsets.append(tuple(chunks[0]))

    # Each row of the big unit is picked with frequency k / n_u ...
    picked = np.array([sum(r in s for s in subsets) for r in rows_of[0]])
    p = k / len(rows_of[0])
    assert np.all(np.abs(picked - steps * p) < 5 * math.sqrt(steps * p * (1 - p)))
    # ... and the k-subset itself is uniform over all C(10, 3) = 120 of them (about 33 draws each).
    drawn = Counter(subsets)
    counts = [drawn[s] for s in itertools.combinations(rows_of[0], k)]
    assert sum(counts) == steps
    assert stats.chisquare(counts).pvalue > 1e-3


# ---------------------------------------------------------------- micro-batches and replicas


@pytest.mark.parametrize("q", [0.01, 0.08])
def test_units_are_never_split_and_ranks_partition_the_global_batch(q):
    unit_of_row = mixed_sizes(300, [1, 3, 6, 2, 9], seed=6)
    n_u = np.bincount(unit_of_row)
    k, steps, m = 4, 150, 3
    single = steps_of(UnitPoissonBatchSampler(unit_of_row, q, k, SamplerConfig(steps, seed=7)))
    ranks = [
        steps_of(
            UnitPoissonBatchSampler(
                unit_of_row, q, k, SamplerConfig(steps, m, seed=7, num_replicas=2, rank=r)
            )
        )
        for r in range(2)
    ]
    empty = 0
    for t, (logical,) in enumerate(single):
        global_units = units_in(logical, unit_of_row)
        assert global_units == sorted(global_units)
        for unit, rows in runs(logical, unit_of_row):
            assert len(rows) == len(set(rows)) == min(k, n_u[unit])
        shares = []
        for steps_r in ranks:
            micro = steps_r[t]
            assert len(micro) == m  # empty micro-batches included
            empty += sum(not mb for mb in micro)
            micro_units = [units_in(mb, unit_of_row) for mb in micro]
            assert max(map(len, micro_units)) - min(map(len, micro_units)) <= 1  # split by unit counts
            assert len(set(flat(micro_units))) == len(flat(micro_units))  # no unit in two micro-batches
            shares.append(flat(micro))
        assert shares[0] + shares[1] == logical  # the union over ranks is the logical batch, in order
        share_units = [units_in(s, unit_of_row) for s in shares]
        assert not set(share_units[0]) & set(share_units[1])
        assert abs(len(share_units[0]) - len(share_units[1])) <= 1
    assert (empty > 0) == (q < 0.05)  # small batches leave micro-batches empty (and they are yielded)


# ---------------------------------------------------------------- determinism and secure mode


def make(**kwargs) -> UnitPoissonBatchSampler:
    return UnitPoissonBatchSampler(
        mixed_sizes(100, [1, 5, 12]), 0.1, 3, SamplerConfig(30, num_micro_batches=2, **kwargs)
    )


def test_same_seed_and_epoch_are_reproducible():
    a, b = make(seed=7), make(seed=7)
    assert list(a) == list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(make(seed=8)) != list(make(seed=7))

    restored = make(seed=0)
    restored.load_state_dict(a.state_dict())
    assert list(restored) == list(a)
    full = list(a)
    assert list(itertools.islice(iter(a), 13, None)) == full[13:]  # resuming mid-epoch replays the tail


def test_secure_mode_is_not_reproducible_and_well_formed():
    unit_of_row = mixed_sizes(50, [2, 10], seed=8)
    n_u = np.bincount(unit_of_row)
    q, k, steps = 0.5, 3, 400
    sampler = UnitPoissonBatchSampler(
        unit_of_row, q, k, SamplerConfig(steps, num_micro_batches=2, secure_mode=True)
    )
    first, second = list(sampler), list(sampler)
    assert len(first) == len(second) == len(sampler) == 2 * steps
    assert first != second

    included, hits = 0, np.zeros(len(unit_of_row))
    for step in steps_of(sampler):
        micro_units = [units_in(mb, unit_of_row) for mb in step]
        assert not set(micro_units[0]) & set(micro_units[1])
        for unit, rows in runs(flat(step), unit_of_row):
            assert len(set(rows)) == len(rows) == min(k, n_u[unit])
        included += len(flat(micro_units))
        hits[flat(step)] += 1
    trials = steps * len(n_u)
    assert abs(included / trials - q) < 5 * math.sqrt(q * (1 - q) / trials)
    big = n_u[unit_of_row] == 10  # each row of a capped unit is in a step with probability q k / n_u
    p = q * k / 10
    assert np.all(np.abs(hits[big] - steps * p) < 5.5 * math.sqrt(steps * p * (1 - p)))


# ---------------------------------------------------------------- the collator and the loader


DATA = [{"x": i, "labels": 10 * i} for i in range(8)]
UNITS = [2, 0, 1, 2, 0, 3, 3, 1]


def test_collator_marks_each_row_with_its_local_unit():
    wrapped = UnitDataset(DATA, UNITS)
    assert len(wrapped) == 8 and wrapped[3] == (DATA[3], 2)
    collate = MaskingCollator(default_data_collator, wrapped)

    batch = collate([wrapped[i] for i in (5, 6, 0, 3, 1)])  # units 3, 3, 2, 2, 0
    assert batch["x"].tolist() == [5, 6, 0, 3, 1] and batch["labels"].tolist() == [50, 60, 0, 30, 10]
    assert batch[UNIT_KEY].dtype == torch.long and batch[UNIT_KEY].tolist() == [0, 0, 1, 1, 2]
    assert batch[EXAMPLE_MASK_KEY].shape == (3,) and batch[EXAMPLE_MASK_KEY].tolist() == [1.0, 1.0, 1.0]

    placeholder = collate([])  # an empty micro-batch: dataset[0] with mask 0
    assert placeholder["x"].tolist() == [0]
    assert placeholder[UNIT_KEY].tolist() == [0] and placeholder[EXAMPLE_MASK_KEY].tolist() == [0.0]

    inputs, mask, unit_of_row = split_dp_keys(batch)
    assert set(inputs) == {"x", "labels"} and mask.shape == (3,) and unit_of_row.tolist() == [0, 0, 1, 1, 2]
    inputs, mask = split_example_mask(batch)
    assert set(inputs) == {"x", "labels"} and mask.shape == (3,)
    inputs, mask, unit_of_row = split_dp_keys({"x": batch["x"], UNIT_KEY: batch[UNIT_KEY]})  # no mask
    assert mask.tolist() == [1.0, 1.0, 1.0]


def test_collator_without_units_is_unchanged():
    collate = MaskingCollator(default_data_collator, DATA)
    first = collate(
        [DATA[2], DATA[4]]
    )  # the first also carries two examples alone (no attention mask: collated)
    assert [(row, set(alone)) for row, alone in first[ALONE_KEY]] == [
        (0, {"x", "labels"}),
        (1, {"x", "labels"}),
    ]
    assert split_dp_keys(first)[0].keys() == {"x", "labels"}
    batch = collate([DATA[2], DATA[4]])
    assert set(batch) == {"x", "labels", EXAMPLE_MASK_KEY} and batch[EXAMPLE_MASK_KEY].tolist() == [1.0, 1.0]
    empty = collate([])
    assert set(empty) == {"x", "labels", EXAMPLE_MASK_KEY} and empty[EXAMPLE_MASK_KEY].tolist() == [0.0]
    inputs, mask, unit_of_row = split_dp_keys(batch)
    assert unit_of_row is None and mask.tolist() == [1.0, 1.0] and set(inputs) == {"x", "labels"}
    assert split_dp_keys({"x": batch["x"]})[1].tolist() == [1.0, 1.0]


def loader_args(**overrides) -> SimpleNamespace:
    args = dict(
        gradient_accumulation_steps=2,
        secure_mode=False,
        world_size=1,
        process_index=0,
        poisson_sampling=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )
    return SimpleNamespace(**(args | overrides))


PLAN = SimpleNamespace(num_examples=4, expected_batch_size=2, sample_rate=0.5, steps_per_epoch=40, bands=1)


def test_dp_dataloader_samples_units():
    loader = dp_dataloader(
        DATA,
        default_data_collator,
        plan=PLAN,
        sampling_key=3,
        args=loader_args(),
        unit_of_row=UNITS,
        max_rows_per_unit=1,
    )
    sampler = loader.batch_sampler
    assert isinstance(sampler, UnitPoissonBatchSampler) and sampler.num_samples == 4
    assert len(loader.dataset) == 8 and loader.dataset.dataset is DATA  # the wrapper
    batches = list(loader)
    assert len(batches) == len(sampler) == 80
    empty = 0
    for batch, rows in zip(batches, sampler, strict=True):
        if not rows:
            empty += 1
            assert batch["x"].tolist() == [0] and batch[EXAMPLE_MASK_KEY].tolist() == [0.0]
            assert batch[UNIT_KEY].tolist() == [0]
            continue
        units = [UNITS[i] for i in batch["x"].tolist()]
        assert batch["x"].tolist() == rows
        assert len(units) == len(set(units))  # k = 1: one row per unit
        assert batch[UNIT_KEY].tolist() == list(range(len(units)))
        assert batch[EXAMPLE_MASK_KEY].tolist() == [1.0] * len(units)
    assert 0 < empty < 80

    # Worker processes get the wrapper and the collator by pickling.
    wrapped = pickle.loads(pickle.dumps(loader.dataset))
    assert [wrapped[i] for i in range(8)] == [(DATA[i], UNITS[i]) for i in range(8)]
    collate = pickle.loads(pickle.dumps(loader.collate_fn))
    assert collate([wrapped[1], wrapped[4], wrapped[7]])[UNIT_KEY].tolist() == [0, 0, 1]


def test_dp_dataloader_without_units_is_unchanged():
    loader = dp_dataloader(DATA, default_data_collator, plan=PLAN, sampling_key=3, args=loader_args())
    assert type(loader.batch_sampler).__name__ == "PoissonBatchSampler" and loader.dataset is DATA
    assert all(UNIT_KEY not in batch for batch in loader)


def test_units_of_column():
    assert units_of_column(["bob", "alice", "bob", "carol", "alice"]) == ([0, 1, 0, 2, 1], 3)
    assert units_of_column([7, 7, 3, 9, 3]) == ([0, 0, 1, 2, 1], 3)
    assert units_of_column(torch.tensor([5, 5, 2])) == ([0, 0, 1], 2)  # by value, not tensor identity
    assert units_of_column(np.array(["a", "b", "a"])) == ([0, 1, 0], 2)
    # a torch-formatted dataset's column: one 0-d tensor per row
    assert units_of_column([torch.tensor(5), torch.tensor(5), torch.tensor(2)]) == ([0, 0, 1], 2)
    unit_of_row, n = units_of_column(["u3", "u1", "u3"])
    assert UnitPoissonBatchSampler(unit_of_row, 0.5, 1, SamplerConfig(2)).num_samples == n == 2


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_rows_per_unit=0), "max_rows_per_unit must be an integer >= 1"),
        (dict(max_rows_per_unit=1.5), "max_rows_per_unit must be an integer >= 1"),
        (dict(max_rows_per_unit=None), "max_rows_per_unit must be an integer >= 1"),
        (dict(sample_rate=0.0), r"sample_rate must be in \(0, 1\]"),
        (dict(sample_rate=1.5), r"sample_rate must be in \(0, 1\]"),
        (dict(sample_rate=float("nan")), r"sample_rate must be in \(0, 1\]"),
        (dict(unit_of_row=[]), "unit_of_row must be a non-empty 1-D sequence of integer unit ids"),
        (dict(unit_of_row=[0.0, 1.0]), "unit_of_row must be a non-empty 1-D sequence of integer unit ids"),
        (dict(unit_of_row=[[0, 1]]), "unit_of_row must be a non-empty 1-D sequence of integer unit ids"),
        (dict(unit_of_row=[0, -1, 1]), "unit_of_row has a negative unit id"),
        (dict(unit_of_row=[0, 2, 2]), "unit id 1 has no rows"),
        (dict(steps_per_epoch=0), "steps_per_epoch must be >= 1"),
        (dict(num_micro_batches=0), "num_micro_batches must be >= 1"),
        (dict(rank=2, num_replicas=2), "need 0 <= rank < num_replicas"),
        (dict(secure_mode=True, num_replicas=2), "secure_mode .* use num_replicas=1"),
    ],
)
def test_sampler_validation(kwargs, match):
    args = dict(unit_of_row=[0, 1, 1, 2], sample_rate=0.5, max_rows_per_unit=2, steps_per_epoch=5) | kwargs
    with pytest.raises(ValueError, match=match):
        build(UnitPoissonBatchSampler, args)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(unit_of_row=UNITS[:-1]), "unit_of_row has 7 entries for 8 dataset rows"),
        (dict(args=loader_args(poisson_sampling=False)), "user-level sampling .* is Poisson only"),
        (dict(max_rows_per_unit=None), "pass max_rows_per_unit"),
        (dict(unit_of_row=[u - 1 for u in UNITS]), "negative unit id"),
    ],
)
def test_dp_dataloader_validation(kwargs, match):
    options = dict(plan=PLAN, sampling_key=0, args=loader_args(), unit_of_row=UNITS, max_rows_per_unit=2)
    with pytest.raises(ValueError, match=match):
        dp_dataloader(DATA, default_data_collator, **(options | kwargs))


def test_a_torch_formatted_dataset_numbers_its_users_by_value(tmp_path):
    """``datasets``' torch format hands the id column over as 0-d tensors: 6 rows of 3 users are 3 units."""
    import datasets

    from hf_dp.privacy_units import dataset_units

    rows = datasets.Dataset.from_dict({"input_ids": [[5, 6]] * 6, "user_id": [1, 1, 2, 2, 3, 3]})
    args = types.SimpleNamespace(privacy_unit_column="user_id", rows_are_blocks=None)
    for dataset in (rows, rows.with_format("torch")):
        assert dataset_units(args, dataset, "example", "DPTrainer").count == 3
