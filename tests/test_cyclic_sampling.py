"""Cyclic Poisson sampling (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 4): ``CyclicPartition`` and the
``cycle=`` argument of ``PoissonBatchSampler`` and ``UnitPoissonBatchSampler``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hf_dp.sampling import CyclicPartition, PoissonBatchSampler, SamplerConfig, UnitPoissonBatchSampler

KEY = 0x1234_5678_9ABC_DEF0_0FED_CBA9_8765_4321  # a 128-bit key, as the trainer derives from the run's secret


def steps_of(sampler) -> list[list[list[int]]]:
    """One epoch of yields grouped into steps: ``result[step][micro]`` is a list of row indices."""
    yields = list(sampler)
    assert len(yields) == len(sampler)
    m = sampler.num_micro_batches
    return [yields[i : i + m] for i in range(0, len(yields), m)]


def logical(sampler, epoch: int) -> list[list[int]]:
    """The logical batches (micro-batches joined) of ``epoch``."""
    sampler.set_epoch(epoch)
    return [[i for mb in step for i in mb] for step in steps_of(sampler)]


def reference_poisson(n: int, q: float, seed: int, epoch: int, steps: int) -> list[list[int]]:
    """The pre-cycle ``PoissonBatchSampler`` written out with numpy: one fresh stream per epoch."""
    generator = np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(seed, spawn_key=(epoch,))))
    return [np.flatnonzero(generator.random(n) < q).tolist() for _ in range(steps)]


def reference_units(
    unit_of_row: list[int], q: float, k: int, seed: int, epoch: int, steps: int
) -> list[list[int]]:
    """The pre-cycle ``UnitPoissonBatchSampler`` written out: units ``U_u < q``, then one key per row of the
    sampled units (units in increasing order, rows in increasing order), keep each unit's ``k`` smallest."""
    generator = np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(seed, spawn_key=(epoch,))))
    rows_of = [[r for r, u in enumerate(unit_of_row) if u == unit] for unit in range(max(unit_of_row) + 1)]
    batches = []
    for _ in range(steps):
        units = np.flatnonzero(generator.random(len(rows_of)) < q)
        keys = (
            iter(generator.random(sum(len(rows_of[u]) for u in units)).tolist()) if units.size else iter(())
        )
        batch = []
        for u in units:
            keyed = [(next(keys), r) for r in rows_of[u]]
            batch += sorted(r for _, r in sorted(keyed)[:k])
        batches.append(batch)
    return batches


def mixed_units(num_units: int, seed: int = 0) -> list[int]:
    """unit_of_row with units of 1..4 rows, rows of different units shuffled together."""
    units = [u for u in range(num_units) for _ in range(1 + u % 4)]
    return np.random.default_rng(seed).permutation(units).tolist()


# ---------------------------------------------------------------- the partition


@pytest.mark.parametrize(("n", "b"), [(10, 3), (12, 4), (7, 7), (5, 1), (1000, 6)])
def test_partition_sizes_disjoint_cover(n, b):
    part = CyclicPartition(n, b, KEY)
    groups = part.group_of
    assert groups.shape == (n,) and groups.min() == 0 and groups.max() == b - 1
    sizes = np.bincount(groups, minlength=b)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == n
    masks = np.array([part.in_group(g) for g in range(b)])
    assert np.array_equal(masks.sum(axis=0), np.ones(n))  # disjoint and covering
    for step in (0, 1, b, 5 * b + 2, 10**6 + 3):
        assert np.array_equal(part.in_group(step), groups == step % b)


def test_partition_is_a_function_of_the_key():
    a = CyclicPartition(100, 4, KEY)
    assert np.array_equal(a.group_of, CyclicPartition(100, 4, KEY).group_of)
    assert not np.array_equal(a.group_of, CyclicPartition(100, 4, KEY + 1).group_of)
    assert not np.array_equal(a.group_of, CyclicPartition(100, 4, 2**127 + KEY % 7).group_of)
    # Computed once, read-only, and the dataclass stays frozen and hashable.
    assert a.group_of is a.group_of
    with pytest.raises(ValueError):
        a.group_of[0] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_groups = 2
    assert a == CyclicPartition(100, 4, KEY) and hash(a) == hash(CyclicPartition(100, 4, KEY))


@pytest.mark.parametrize(("n", "b"), [(12, 3), (10, 4)])
def test_partition_is_uniform_over_keys(n, b):
    """Over many keys, item i is in group g with prob. size_g / n (1 / b when b divides n), and two items
    share a group with prob. sum_g size_g (size_g - 1) / (n (n - 1)) (a uniform partition, not e.g. i mod b
    with shuffled labels)."""
    keys = 4000
    groups = np.array([CyclicPartition(n, b, k).group_of for k in range(keys)])  # (keys, n)
    sizes = np.bincount(CyclicPartition(n, b, 0).group_of, minlength=b)
    for g in range(b):
        freq = (groups == g).sum(axis=0)  # per item
        prob = sizes[g] / n
        assert np.all(np.abs(freq - keys * prob) < 5 * np.sqrt(keys * prob * (1 - prob))), (g, freq)
    same = (groups[:, :, None] == groups[:, None, :]).sum(axis=0)[np.triu_indices(n, 1)]  # per pair
    prob = np.sum(sizes * (sizes - 1)) / (n * (n - 1))
    assert np.all(np.abs(same - keys * prob) < 5 * np.sqrt(keys * prob * (1 - prob))), same


def test_partition_errors():
    with pytest.raises(ValueError, match="num_groups"):
        CyclicPartition(5, 6, KEY)
    with pytest.raises(ValueError, match="num_groups"):
        CyclicPartition(5, 0, KEY)
    with pytest.raises(ValueError, match="num_items=9"):
        PoissonBatchSampler(10, 0.1, SamplerConfig(3), cycle=CyclicPartition(9, 2, KEY))
    unit_of_row = mixed_units(8)
    with pytest.raises(ValueError, match="num_items=8"):  # units, not rows
        UnitPoissonBatchSampler(
            unit_of_row, 0.1, 2, SamplerConfig(3), cycle=CyclicPartition(len(unit_of_row), 2, KEY)
        )
    UnitPoissonBatchSampler(unit_of_row, 0.1, 2, SamplerConfig(3), cycle=CyclicPartition(8, 2, KEY))


# ---------------------------------------------------------------- the samplers


def test_items_only_in_their_residue_with_rate_p():
    """7 steps per epoch, b = 4: residues are of the GLOBAL step epoch * 7 + i, not of i."""
    n, b, p, spe, epochs = 40, 4, 0.3, 7, 80
    cycle = CyclicPartition(n, b, KEY)
    sampler = PoissonBatchSampler(n, p, SamplerConfig(spe, seed=3), cycle=cycle)
    counts = np.zeros(n, dtype=int)
    own_steps = np.zeros(n, dtype=int)
    for epoch in range(epochs):
        for i, batch in enumerate(logical(sampler, epoch)):
            t = epoch * spe + i
            assert np.all(cycle.group_of[batch] == t % b), (t, batch)
            counts[batch] += 1
            own_steps += cycle.in_group(t)
    assert np.all(own_steps == epochs * spe // b)  # 560 steps, 140 per residue
    mean, sd = own_steps * p, np.sqrt(own_steps * p * (1 - p))
    assert np.all(np.abs(counts - mean) < 5 * sd), counts
    assert abs(counts.sum() - mean.sum()) < 5 * np.sqrt(np.sum(sd**2))


def test_cycle_masks_the_same_draws():
    """With a cycle the stream is unchanged: step t is the non-cyclic step t intersected with group t mod b."""
    n, q, spe = 50, 0.4, 7
    cycle = CyclicPartition(n, 3, KEY)
    plain = PoissonBatchSampler(n, q, SamplerConfig(spe, seed=11))
    cyclic = PoissonBatchSampler(n, q, SamplerConfig(spe, seed=11), cycle=cycle)
    for epoch in (0, 2, 5):
        for i, (a, c) in enumerate(zip(logical(plain, epoch), logical(cyclic, epoch), strict=True)):
            assert c == [j for j in a if cycle.group_of[j] == (epoch * spe + i) % 3]


def test_replicas_and_micro_batches_union_is_the_logical_batch():
    n, p, spe, b = 60, 0.5, 7, 4
    cycle = CyclicPartition(n, b, KEY)
    single = PoissonBatchSampler(n, p, SamplerConfig(spe, seed=5), cycle=cycle)
    ranks = [
        PoissonBatchSampler(
            n, p, SamplerConfig(spe, num_micro_batches=2, seed=5, num_replicas=2, rank=r), cycle=cycle
        )
        for r in range(2)
    ]
    for epoch in (0, 1, 3):
        expected = logical(single, epoch)
        per_rank = []
        for s in ranks:
            s.set_epoch(epoch)
            per_rank.append(steps_of(s))
        assert all(len(step) == 2 for r in per_rank for step in r)  # two micro-batches per step
        for t, batch in enumerate(expected):
            union = sorted(i for r in per_rank for mb in r[t] for i in mb)
            assert union == batch and len(union) == len(set(union))
        assert any(expected)


def test_unit_sampler_units_only_in_their_residue():
    unit_of_row = mixed_units(30, seed=1)
    b, spe = 4, 7
    cycle = CyclicPartition(30, b, KEY)
    sampler = UnitPoissonBatchSampler(unit_of_row, 0.5, 2, SamplerConfig(spe, seed=7), cycle=cycle)
    seen = set()
    for epoch in range(6):
        for i, rows in enumerate(logical(sampler, epoch)):
            units = {unit_of_row[r] for r in rows}
            assert all(cycle.group_of[u] == (epoch * spe + i) % b for u in units), (epoch, i, units)
            seen |= units
    assert len(seen) == 30


def test_without_cycle_batches_are_unchanged():
    n, q, spe, seed = 37, 0.2, 5, 2**100 + 17
    sampler = PoissonBatchSampler(n, q, SamplerConfig(spe, seed=seed))
    for epoch in (0, 3):
        assert logical(sampler, epoch) == reference_poisson(n, q, seed, epoch, spe)
    unit_of_row = mixed_units(20, seed=2)
    units = UnitPoissonBatchSampler(unit_of_row, 0.4, 2, SamplerConfig(spe, seed=seed))
    for epoch in (0, 4):
        assert logical(units, epoch) == reference_units(unit_of_row, 0.4, 2, seed, epoch, spe)


def test_cycle_of_one_group_is_plain_poisson():
    n, q, spe = 37, 0.2, 5
    plain = PoissonBatchSampler(n, q, SamplerConfig(spe, seed=9))
    one = PoissonBatchSampler(n, q, SamplerConfig(spe, seed=9), cycle=CyclicPartition(n, 1, KEY))
    unit_of_row = mixed_units(20, seed=3)
    plain_units = UnitPoissonBatchSampler(unit_of_row, 0.4, 2, SamplerConfig(spe, seed=9))
    one_units = UnitPoissonBatchSampler(
        unit_of_row, 0.4, 2, SamplerConfig(spe, seed=9), cycle=CyclicPartition(20, 1, KEY)
    )
    for epoch in (0, 2):
        assert logical(one, epoch) == logical(plain, epoch)
        assert logical(one_units, epoch) == logical(plain_units, epoch)


def test_secure_mode_with_cycle():
    n, b, spe = 40, 4, 7
    cycle = CyclicPartition(n, b, KEY)
    sampler = PoissonBatchSampler(n, 0.5, SamplerConfig(spe, secure_mode=True), cycle=cycle)
    unit_of_row = mixed_units(n, seed=4)
    units = UnitPoissonBatchSampler(unit_of_row, 0.5, 2, SamplerConfig(spe, secure_mode=True), cycle=cycle)
    seen, seen_units = set(), set()
    for epoch in range(20):  # 140 steps, 35 per residue: an item is never drawn with prob. 2**-35
        for i, batch in enumerate(logical(sampler, epoch)):
            assert np.all(cycle.group_of[batch] == (epoch * spe + i) % b)
            seen |= set(batch)
        for i, rows in enumerate(logical(units, epoch)):
            assert all(cycle.group_of[unit_of_row[r]] == (epoch * spe + i) % b for r in rows)
            seen_units |= {unit_of_row[r] for r in rows}
    assert len(seen) == n and len(seen_units) == n
