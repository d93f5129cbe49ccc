"""Statistical and structural tests of the DP batch samplers in ``hf_dp.sampling``."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from scipy import stats

from hf_dp.sampling import PoissonBatchSampler, SamplerConfig, ShuffledBatchSampler


def logical_batches(sampler) -> list[list[list[int]]]:
    """Group one epoch of yields into steps: ``result[step][micro]`` is a list of indices."""
    yields = list(sampler)
    assert len(yields) == len(sampler)
    m = sampler.num_micro_batches
    return [yields[i : i + m] for i in range(0, len(yields), m)]


def flat(micro_batches: list[list[int]]) -> list[int]:
    return [i for mb in micro_batches for i in mb]


def inclusion_matrix(sampler) -> np.ndarray:
    """Boolean (steps, N) matrix: example j is in logical batch t."""
    x = np.zeros((sampler.steps_per_epoch, sampler.num_samples), dtype=bool)
    for t, step in enumerate(logical_batches(sampler)):
        x[t, flat(step)] = True
    return x


# ---------------------------------------------------------------- Poisson statistics


def test_poisson_batch_sizes_are_binomial():
    n, q, steps = 1000, 0.05, 2000
    sizes = np.array(
        [len(flat(s)) for s in logical_batches(PoissonBatchSampler(n, q, SamplerConfig(steps, seed=1)))]
    )
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 5 * np.sqrt(var / steps)
    # SD of the sample variance is ~ var * sqrt(2 / (steps - 1)) for a near-normal distribution.
    assert abs(sizes.var(ddof=1) - var) < 6 * var * np.sqrt(2 / (steps - 1))

    # Chi-square goodness of fit against Binomial(n, q), tails pooled so every expected count >= 5.
    common = np.flatnonzero(stats.binom.pmf(np.arange(n + 1), n, q) * steps >= 10)
    lo, hi = common.min(), common.max()
    observed = [np.sum(sizes < lo)] + [np.sum(sizes == k) for k in range(lo, hi + 1)] + [np.sum(sizes > hi)]
    probs = np.concatenate(
        [
            [stats.binom.cdf(lo - 1, n, q)],
            stats.binom.pmf(np.arange(lo, hi + 1), n, q),
            [stats.binom.sf(hi, n, q)],
        ]
    )
    expected = probs / probs.sum() * steps
    assert expected.min() >= 5
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_poisson_inclusion_rates_and_independence():
    n, q, steps = 200, 0.1, 5000
    x = inclusion_matrix(PoissonBatchSampler(n, q, SamplerConfig(steps, seed=2)))
    counts = x.sum(axis=0)
    mean, var = steps * q, steps * q * (1 - q)
    # No index systematically excluded or favoured: each count ~ Binomial(steps, q).
    assert counts.min() > 0
    assert np.all(np.abs(counts - mean) < 5.5 * np.sqrt(var))
    # Dispersion test: sum (c - mean)^2 / var ~ chi2(n) if the counts are independent binomials.
    dispersion = np.sum((counts - mean) ** 2) / var
    assert 1e-3 < stats.chi2.sf(dispersion, n) < 1 - 1e-3

    # Independent inclusions: Var(|B|) = N q (1 - q) (fixed-size batches give 0, negative correlation).
    sizes = x.sum(axis=1)
    assert abs(sizes.var(ddof=1) - n * q * (1 - q)) < 6 * n * q * (1 - q) * np.sqrt(2 / (steps - 1))
    # ... and no pair of examples is noticeably correlated (each corr has SD ~ 1 / sqrt(steps)).
    corr = np.corrcoef(x, rowvar=False)
    off_diagonal = corr[~np.eye(n, dtype=bool)]
    assert np.abs(off_diagonal).max() < 6 / np.sqrt(steps)


def test_fixed_size_batches_fail_the_independence_check():
    """The Var(|B|) check above is what distinguishes Poisson from fixed-size batches."""
    x = inclusion_matrix(ShuffledBatchSampler(200, 20, SamplerConfig(500, seed=0)))
    assert x.sum(axis=1).var() == 0


def test_sample_rate_one_takes_everything():
    for step in logical_batches(PoissonBatchSampler(17, 1.0, SamplerConfig(3, num_micro_batches=2))):
        assert flat(step) == list(range(17))


# ---------------------------------------------------------------- micro-batches and replicas


def test_micro_batches_concatenate_to_the_logical_batch():
    n, q, steps = 1000, 0.05, 50
    whole = logical_batches(PoissonBatchSampler(n, q, SamplerConfig(steps, seed=3)))
    split = logical_batches(PoissonBatchSampler(n, q, SamplerConfig(steps, num_micro_batches=3, seed=3)))
    assert len(split) == steps
    for (logical,), micro in zip(whole, split, strict=True):
        assert len(micro) == 3
        assert flat(micro) == logical
        sizes = [len(mb) for mb in micro]
        assert max(sizes) - min(sizes) <= 1


def test_empty_micro_batches_are_yielded():
    sampler = PoissonBatchSampler(100, 0.01, SamplerConfig(200, num_micro_batches=4, seed=4))
    yields = list(sampler)
    assert len(yields) == len(sampler) == 800
    assert all(isinstance(mb, list) for mb in yields)
    assert any(len(mb) == 0 for mb in yields)
    steps = logical_batches(sampler)
    assert any(all(len(mb) == 0 for mb in step) for step in steps)  # an empty logical batch
    for step in steps:
        sizes = [len(mb) for mb in step]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("num_replicas,num_micro_batches", [(2, 1), (2, 3), (3, 2)])
def test_replicas_partition_the_global_batch(num_replicas, num_micro_batches):
    n, q, steps = 500, 0.03, 100
    single = logical_batches(PoissonBatchSampler(n, q, SamplerConfig(steps, seed=5)))
    ranks = [
        PoissonBatchSampler(
            n,
            q,
            SamplerConfig(
                steps, num_micro_batches=num_micro_batches, seed=5, num_replicas=num_replicas, rank=r
            ),
        )
        for r in range(num_replicas)
    ]
    assert len({len(s) for s in ranks}) == 1
    per_rank = [logical_batches(s) for s in ranks]
    for t, (logical,) in enumerate(single):
        shares = [flat(steps_r[t]) for steps_r in per_rank]
        assert all(len(steps_r[t]) == num_micro_batches for steps_r in per_rank)
        assert sum(shares, []) == logical  # contiguous, disjoint, complete, in rank order
        assert all(not set(a) & set(b) for a, b in itertools.combinations(shares, 2))
        share_sizes = [len(s) for s in shares]
        assert max(share_sizes) - min(share_sizes) <= 1


def test_shuffled_replicas_partition_the_global_batch():
    single = logical_batches(ShuffledBatchSampler(100, 10, SamplerConfig(30, seed=6)))
    ranks = [
        logical_batches(
            ShuffledBatchSampler(
                100, 10, SamplerConfig(30, num_micro_batches=2, seed=6, num_replicas=2, rank=r)
            )
        )
        for r in range(2)
    ]
    for t, (logical,) in enumerate(single):
        a, b = flat(ranks[0][t]), flat(ranks[1][t])
        assert not set(a) & set(b)
        assert a + b == logical


# ---------------------------------------------------------------- determinism and resumption


def make(kind: str, **kwargs):
    if kind == "poisson":
        return PoissonBatchSampler(300, 0.05, SamplerConfig(40, num_micro_batches=2, **kwargs))
    return ShuffledBatchSampler(300, 16, SamplerConfig(40, num_micro_batches=2, **kwargs))


@pytest.mark.parametrize("kind", ["poisson", "shuffled"])
def test_same_seed_and_epoch_are_reproducible(kind):
    a, b = make(kind, seed=7), make(kind, seed=7)
    assert list(a) == list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(make(kind, seed=8)) != list(make(kind, seed=7))


@pytest.mark.parametrize("kind", ["poisson", "shuffled"])
def test_state_dict_round_trip(kind):
    original = make(kind, seed=11)
    original.set_epoch(3)
    state = original.state_dict()
    assert state == {"seed": 11, "epoch": 3}
    restored = make(kind, seed=0)
    restored.load_state_dict(state)
    assert list(restored) == list(original)


@pytest.mark.parametrize("kind", ["poisson", "shuffled"])
def test_skipping_first_batches_replays_the_tail(kind):
    sampler = make(kind, seed=12)
    sampler.set_epoch(2)
    full = list(sampler)
    for k in (0, 1, 5, 37, len(full)):
        assert list(itertools.islice(iter(sampler), k, None)) == full[k:]


def test_accelerate_skip_first_batches_replays_the_tail():
    torch_data = pytest.importorskip("torch.utils.data")
    accelerate = pytest.importorskip("accelerate")
    sampler = make("poisson", seed=13)

    def loader():
        return torch_data.DataLoader(list(range(300)), batch_sampler=sampler, collate_fn=list)

    full = list(loader())
    assert len(full) == len(sampler)
    assert list(accelerate.skip_first_batches(loader(), 9)) == full[9:]


@pytest.mark.parametrize("kind", ["poisson", "shuffled"])
def test_secure_mode_is_not_reproducible(kind):
    sampler = make(kind, seed=0, secure_mode=True)
    first, second = list(sampler), list(sampler)
    assert len(first) == len(second) == len(sampler)
    assert first != second


def test_secure_mode_poisson_rate():
    n, q, steps = 1000, 0.05, 400
    sizes = [len(b) for b in PoissonBatchSampler(n, q, SamplerConfig(steps, secure_mode=True))]
    assert abs(np.mean(sizes) - n * q) < 6 * np.sqrt(n * q * (1 - q) / steps)
    assert np.var(sizes, ddof=1) > 0.5 * n * q * (1 - q)


def test_secure_mode_shuffled_batches_are_distinct():
    for batch in ShuffledBatchSampler(50, 10, SamplerConfig(20, secure_mode=True)):
        assert len(batch) == len(set(batch)) == 10 and all(0 <= i < 50 for i in batch)


# ---------------------------------------------------------------- fixed-size shuffled batches


def test_shuffled_batches_have_exact_size_and_cover_the_epoch():
    n, b = 120, 8
    sampler = ShuffledBatchSampler(n, b, SamplerConfig(n // b, seed=9))
    batches = [flat(s) for s in logical_batches(sampler)]
    assert all(len(batch) == len(set(batch)) == b for batch in batches)
    assert sorted(flat(batches)) == list(range(n))


def test_shuffled_batches_continue_with_a_fresh_permutation():
    n, b, steps = 50, 7, 40  # 7 batches per permutation, 1 index left over each time
    batches = [flat(s) for s in logical_batches(ShuffledBatchSampler(n, b, SamplerConfig(steps, seed=10)))]
    assert len(batches) == steps
    assert all(len(batch) == len(set(batch)) == b and all(0 <= i < n for i in batch) for batch in batches)
    for start in range(0, steps - 6, 7):  # each pass through a permutation has no repeated index
        assert len(set(flat(batches[start : start + 7]))) == 49
    assert batches[:7] != batches[7:14]


# ---------------------------------------------------------------- validation


def build(sampler: type, args: dict):
    """``sampler`` from one dict of its own arguments and the ``SamplerConfig`` fields."""
    shared = {f.name for f in dataclasses.fields(SamplerConfig)}
    config = SamplerConfig(**{k: v for k, v in args.items() if k in shared})
    return sampler(**{k: v for k, v in args.items() if k not in shared}, config=config)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_samples=0), "num_samples must be >= 1"),
        (dict(sample_rate=0.0), r"sample_rate must be in \(0, 1\]"),
        (dict(sample_rate=1.5), r"sample_rate must be in \(0, 1\]"),
        (dict(sample_rate=float("nan")), r"sample_rate must be in \(0, 1\]"),
        (dict(steps_per_epoch=0), "steps_per_epoch must be >= 1"),
        (dict(num_micro_batches=0), "num_micro_batches must be >= 1"),
        (dict(rank=2, num_replicas=2), "need 0 <= rank < num_replicas"),
        (dict(rank=-1), "need 0 <= rank < num_replicas"),
        (dict(num_replicas=0), "need 0 <= rank < num_replicas"),
        (dict(secure_mode=True, num_replicas=2), "secure_mode .* use num_replicas=1"),
    ],
)
def test_poisson_validation(kwargs, match):
    args = dict(num_samples=10, sample_rate=0.1, steps_per_epoch=5) | kwargs
    with pytest.raises(ValueError, match=match):
        build(PoissonBatchSampler, args)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch_size=0), r"batch_size must be in \[1, num_samples=10\]"),
        (dict(batch_size=11), r"batch_size must be in \[1, num_samples=10\]"),
        (dict(num_samples=0), "num_samples must be >= 1"),
        (dict(steps_per_epoch=0), "steps_per_epoch must be >= 1"),
        (dict(num_micro_batches=0), "num_micro_batches must be >= 1"),
        (dict(rank=1), "need 0 <= rank < num_replicas"),
    ],
)
def test_shuffled_validation(kwargs, match):
    args = dict(num_samples=10, batch_size=4, steps_per_epoch=5) | kwargs
    with pytest.raises(ValueError, match=match):
        build(ShuffledBatchSampler, args)
