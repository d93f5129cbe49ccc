"""Batch samplers for DP-SGD, used as a DataLoader ``batch_sampler``.

One *logical batch* (one optimizer step) is yielded as ``num_micro_batches`` micro-batches
(gradient accumulation), so an epoch has ``len(sampler) == steps_per_epoch * num_micro_batches``
yields: the micro-batches of logical batch 0, then those of logical batch 1, and so on.
Micro-batches may be EMPTY lists (small Poisson batches); they are still yielded so the Trainer
always sees exactly ``num_micro_batches`` micro-batches per step. Note that ``default_collate([])``
raises, so the DataLoader needs a ``collate_fn`` that accepts an empty list.

Distributed: every rank draws the SAME global logical batch (same seed), splits it into
``num_replicas`` contiguous nearly-equal parts, keeps part ``rank`` and splits that into the
micro-batches. The union over ranks of one step's micro-batches is the global logical batch.

Units: ``PoissonBatchSampler`` samples rows; ``UnitPoissonBatchSampler`` samples units (e.g. users, the
user-level sampling "ULS" of Charles et al. 2024) and then at most ``k`` rows of each. Its splits are over
units, so a unit's rows are adjacent and never split between processes or micro-batches.

Determinism: unless ``secure_mode``, epoch ``e`` is a pure function of ``(seed, e)`` (a fresh PCG64DXSM
stream keyed by ``seed``, which may be 128 bits, and ``e`` is made at the start of ``__iter__``), so
iterating twice, or iterating and discarding the first k batches as the Trainer does on resume, replays the
same batches. The trainer passes the run's secret as ``seed`` (docs/privacy.md): whoever knows it knows the
batches, which voids amplification by sampling.
With ``secure_mode=True`` the randomness is read from the OS CSPRNG (``secrets``) for every draw,
so batches are not reproducible and checkpoints cannot replay them.

Cyclic Poisson sampling (for DP-BandMF; Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 4): pass
``cycle=CyclicPartition(N, b, key)`` to ``PoissonBatchSampler`` or ``UnitPoissonBatchSampler``. The items
(rows or units) are split once into ``b`` groups by a secret uniform random partition, and global step
``t = epoch * steps_per_epoch + i`` Poisson-samples only group ``t mod b``, each of its items with prob.
``p = sample_rate``; so an item can appear only in steps of one residue mod ``b``. The uniforms are drawn for
all ``N`` items as without a cycle and then masked by the group, so without a cycle (or with ``b = 1``) the
batches are exactly those of before.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = [
    "CyclicPartition",
    "PoissonBatchSampler",
    "SamplerConfig",
    "ShuffledBatchSampler",
    "UnitPoissonBatchSampler",
]

_BITS = 53  # resolution of the secure-mode uniforms: u = k / 2**53 with k uniform in [0, 2**53)

T = TypeVar("T")


def _split(items: list[T], parts: int) -> list[list[T]]:
    """Split ``items`` into ``parts`` contiguous chunks; sizes differ by at most one (larger first).

    With ``n = len(items) = parts * b + r`` (``0 <= r < parts``) chunk ``i`` has ``b + (i < r)`` items.
    """
    base, extra = divmod(len(items), parts)
    bounds = [i * base + min(i, extra) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


def _os_random_int64(n: int) -> torch.Tensor:
    """``n`` independent uniform int64 values read from the OS CSPRNG (``secrets.token_bytes``)."""
    return torch.frombuffer(bytearray(secrets.token_bytes(8 * n)), dtype=torch.int64)


def _poisson_mask(n: int, q: float, generator: np.random.Generator | None) -> np.ndarray:
    """``U_i < q`` for ``n`` i.i.d. ``U_i ~ Uniform[0, 1)``; ``generator is None`` means secure mode.

    Secure mode: U_i = K_i / 2**53 with K_i from the OS CSPRNG, so U_i < q  <=>  K_i < q * 2**53.
    """
    if generator is None:
        return ((_os_random_int64(n) & (2**_BITS - 1)) < round(q * 2**_BITS)).numpy()
    return generator.random(n) < q


def _check_sample_rate(sample_rate: float) -> None:
    if not 0 < sample_rate <= 1:
        raise ValueError(
            f"sample_rate must be in (0, 1] (got {sample_rate}); use expected_batch_size / num_samples."
        )


@dataclass(frozen=True)
class CyclicPartition:
    """A secret uniform random partition of items ``0..N-1`` into ``b`` groups for cyclic Poisson sampling
    (Choquette-Choo et al. 2023, "Amplified matrix factorization", arXiv 2306.08153, Thm 4): step ``t``
    samples only group ``t mod b``, so with a ``b``-banded strategy a run of ``T`` steps is as private as DP-SGD
    with ``ceil(T / b)`` steps at the within-group rate ``p``.

    ``pi`` is a uniform permutation of ``range(N)`` drawn from ``PCG64DXSM(key)``; group ``g`` is the ``g``-th
    of ``b`` contiguous chunks of ``pi`` (sizes differ by at most one, larger first, as ``_split``). The
    partition is a pure function of ``key`` (a secret, up to 128 bits, that the caller derives from the run's
    secret), so the samplers' ``state_dict`` / ``load_state_dict`` need not store it: rebuild it from the key.
    """

    num_items: int
    num_groups: int
    key: int

    def __post_init__(self) -> None:
        if self.num_groups < 1:
            raise ValueError(f"num_groups must be >= 1 (got {self.num_groups}); use 1 for no cycling.")
        if self.num_groups > self.num_items:
            raise ValueError(
                f"num_groups={self.num_groups} exceeds num_items={self.num_items}; lower num_groups (the band b)."
            )

    @cached_property
    def group_of(self) -> np.ndarray:
        """``group_of[i]`` is item ``i``'s group in ``0..b-1`` (read-only; computed once)."""
        perm = np.random.Generator(np.random.PCG64DXSM(self.key)).permutation(self.num_items)
        groups = np.empty(self.num_items, dtype=np.int64)
        for g, chunk in enumerate(_split(perm, self.num_groups)):
            groups[chunk] = g
        groups.setflags(write=False)
        return groups

    def in_group(self, step: int) -> np.ndarray:
        """Boolean mask of the items of group ``step mod b``, the only ones step ``step`` may sample."""
        return self.group_of == step % self.num_groups


def _check_cycle(cycle: CyclicPartition | None, num_samples: int, what: str) -> None:
    if cycle is not None and cycle.num_items != num_samples:
        raise ValueError(
            f"cycle.num_items={cycle.num_items} but the sampler has {num_samples} {what}; "
            f"build the CyclicPartition with num_items={num_samples}."
        )


@dataclass(frozen=True)
class SamplerConfig:
    """What every DP batch sampler shares: ``steps_per_epoch`` logical batches per epoch, each yielded as
    ``num_micro_batches`` micro-batches on process ``rank`` of ``num_replicas``, drawn from ``seed`` (or from
    the OS CSPRNG with ``secure_mode``)."""

    steps_per_epoch: int
    num_micro_batches: int = 1
    seed: int = 0
    secure_mode: bool = False
    num_replicas: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1 (got {self.steps_per_epoch}).")
        if self.num_micro_batches < 1:
            raise ValueError(
                f"num_micro_batches must be >= 1 (got {self.num_micro_batches}); use 1 for no accumulation."
            )
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"need 0 <= rank < num_replicas (got rank={self.rank}, num_replicas={self.num_replicas})."
            )
        if self.secure_mode and self.num_replicas > 1:
            raise ValueError(
                "secure_mode draws from each rank's own OS CSPRNG, so ranks would disagree on the "
                "logical batch; use num_replicas=1 or secure_mode=False."
            )


class _DPBatchSampler(Sampler[list[int]]):
    """Shared validation, epoch/seed state, and the replica / micro-batch split."""

    def __init__(self, num_samples: int, config: SamplerConfig) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1 (got {num_samples}); pass the dataset length.")
        self.num_samples = num_samples
        self.steps_per_epoch = config.steps_per_epoch
        self.num_micro_batches = config.num_micro_batches
        self.seed = config.seed
        self.secure_mode = config.secure_mode
        self.num_replicas = config.num_replicas
        self.rank = config.rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose batches the next ``__iter__`` yields."""
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])

    def __len__(self) -> int:
        return self.steps_per_epoch * self.num_micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        generator = None
        if not self.secure_mode:
            key = np.random.SeedSequence(self.seed, spawn_key=(self.epoch,))
            generator = np.random.Generator(np.random.PCG64DXSM(key))
        for batch in self._logical_batches(generator):
            for micro in _split(_split(batch, self.num_replicas)[self.rank], self.num_micro_batches):
                yield self._rows(micro)

    def _logical_batches(self, generator: np.random.Generator | None) -> Iterator[list]:
        """Yield ``steps_per_epoch`` global logical batches, lists of the items that the replica and
        micro-batch splits keep whole (row indices here); ``generator is None`` means secure mode."""
        raise NotImplementedError

    def _rows(self, items: list) -> list[int]:
        """The row indices of a micro-batch's items."""
        return items


class PoissonBatchSampler(_DPBatchSampler):
    """Poisson subsampling (each example independently with prob. q per step), the sampling the
    subsampled-Gaussian accountants assume (Abadi et al. 2016; Mironov, Talwar, Zhang 2019).

    Logical batch ``B = {i : U_i < q}`` with ``U_i ~ Uniform[0, 1)`` i.i.d., so ``|B| ~ Binomial(N, q)``;
    indices are yielded in increasing order (not shuffled within the batch).

    With ``cycle`` (a ``CyclicPartition`` of the ``N`` rows into ``b`` groups), global step
    ``t = epoch * steps_per_epoch + i`` yields ``{i : U_i < p} & group(t mod b)``, ``p = sample_rate`` being
    the rate within the group (expected batch ``p * N / b``). The state dict is unchanged: the partition is a
    function of its key.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        config: SamplerConfig,
        *,
        cycle: CyclicPartition | None = None,
    ) -> None:
        super().__init__(num_samples, config)
        _check_sample_rate(sample_rate)
        _check_cycle(cycle, num_samples, "rows")
        self.sample_rate = sample_rate
        self.cycle = cycle

    def _logical_batches(self, generator: np.random.Generator | None) -> Iterator[list[int]]:
        for i in range(self.steps_per_epoch):
            mask = _poisson_mask(self.num_samples, self.sample_rate, generator)
            if self.cycle is not None:
                mask = mask & self.cycle.in_group(self.epoch * self.steps_per_epoch + i)
            yield np.flatnonzero(mask).tolist()


class ShuffledBatchSampler(_DPBatchSampler):
    """Fixed-size batches from a fresh permutation each epoch (sampling without replacement); NOT what
    the Poisson accountants assume — provided only on explicit request.

    Logical batch ``t`` is ``perm[t*b : (t+1)*b]`` (``b = batch_size``) of a uniform random permutation;
    when fewer than ``b`` unused indices remain, they are skipped and a fresh permutation is drawn, so
    every batch has exactly ``b`` distinct indices.
    """

    def __init__(self, num_samples: int, batch_size: int, config: SamplerConfig) -> None:
        super().__init__(num_samples, config)
        if not 1 <= batch_size <= num_samples:
            raise ValueError(
                f"batch_size must be in [1, num_samples={num_samples}] (got {batch_size}); lower batch_size."
            )
        self.batch_size = batch_size

    def _permutation(self, generator: np.random.Generator | None) -> list[int]:
        if generator is None:  # secure mode: argsort of i.i.d. CSPRNG keys (ties have prob. ~N^2 / 2^65)
            return torch.argsort(_os_random_int64(self.num_samples), stable=True).tolist()
        return generator.permutation(self.num_samples).tolist()

    def _logical_batches(self, generator: np.random.Generator | None) -> Iterator[list[int]]:
        perm, pos = self._permutation(generator), 0
        for _ in range(self.steps_per_epoch):
            if pos + self.batch_size > self.num_samples:
                perm, pos = self._permutation(generator), 0
            yield perm[pos : pos + self.batch_size]
            pos += self.batch_size


class UnitPoissonBatchSampler(_DPBatchSampler):
    """User-level Poisson sampling (ULS, Charles et al. 2024): each *unit* (e.g. a user) independently with
    prob. q per step, then at most ``k = max_rows_per_unit`` of its rows.

    Unit ``u`` owns the rows ``R_u = {i : unit_of_row[i] = u}``, ``n_u = |R_u|``, units ``0..N_u-1``.
    Logical batch: units ``S = {u : U_u < q}`` (``U_u`` as in ``PoissonBatchSampler``, so
    ``|S| ~ Binomial(N_u, q)``), and for each ``u`` in ``S`` a uniform random subset of ``min(k, n_u)`` rows
    of ``R_u``, drawn without replacement: the rows with the ``k`` smallest of i.i.d. keys (uniform floats, or
    int64 from the OS CSPRNG in secure mode), so each row of ``u`` is in with prob. ``q * min(k, n_u) / n_u``.
    Units are yielded in increasing order, each as its chosen rows in increasing order. The replica and
    micro-batch splits are by units (nearly equal unit counts), so a unit's rows stay adjacent, on one process
    and in one micro-batch. ``num_samples`` is ``N_u``.

    With ``cycle`` (a ``CyclicPartition`` of the ``N_u`` units), global step ``t = epoch * steps_per_epoch + i``
    samples units ``{u : U_u < p} & group(t mod b)`` (``p = sample_rate``, the rate within the group), so all
    of a unit's rows appear only in steps of its residue. The state dict is unchanged: the partition is a
    function of its key.
    """

    def __init__(
        self,
        unit_of_row: Sequence[int],
        sample_rate: float,
        max_rows_per_unit: int,
        config: SamplerConfig,
        *,
        cycle: CyclicPartition | None = None,
    ) -> None:
        units = np.asarray(unit_of_row)
        if units.ndim != 1 or units.size == 0 or not np.issubdtype(units.dtype, np.integer):
            raise ValueError(
                "unit_of_row must be a non-empty 1-D sequence of integer unit ids, one per dataset row; "
                "map arbitrary ids with hf_dp.data.units_of_column."
            )
        if units.min() < 0:
            raise ValueError(
                f"unit_of_row has a negative unit id ({units.min()}); ids must be 0..N_u-1 "
                "(use units_of_column)."
            )
        counts = np.bincount(units)
        if not counts.all():
            raise ValueError(
                f"unit id {np.argmin(counts)} has no rows; ids must be 0..N_u-1 with every unit present "
                "(renumber with units_of_column)."
            )
        super().__init__(len(counts), config)
        _check_sample_rate(sample_rate)
        k = max_rows_per_unit
        if not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"max_rows_per_unit must be an integer >= 1 (got {k!r}); it caps a unit's rows per step."
            )
        _check_cycle(cycle, len(counts), "units")
        self.sample_rate = sample_rate
        self.cycle = cycle
        self.max_rows_per_unit = int(max_rows_per_unit)
        self._counts = counts  # n_u
        self._starts = np.cumsum(counts) - counts  # unit u's rows are _by_unit[_starts[u] : _starts[u] + n_u]
        self._by_unit = np.argsort(units, kind="stable")  # rows grouped by unit, increasing within each

    def _keys(self, n: int, generator: np.random.Generator | None) -> np.ndarray:
        return _os_random_int64(n).numpy() if generator is None else generator.random(n)

    def _logical_batches(self, generator: np.random.Generator | None) -> Iterator[list[list[int]]]:
        for i in range(self.steps_per_epoch):
            mask = _poisson_mask(self.num_samples, self.sample_rate, generator)
            if self.cycle is not None:
                mask = mask & self.cycle.in_group(self.epoch * self.steps_per_epoch + i)
            units = np.flatnonzero(mask)
            if units.size == 0:
                yield []
                continue
            counts = self._counts[units]
            ends = np.cumsum(counts)
            # The sampled units' rows, unit after unit; ``unit[j]`` is row j's position in ``units``.
            offsets = np.arange(ends[-1]) - np.repeat(ends - counts, counts)
            rows = self._by_unit[np.repeat(self._starts[units], counts) + offsets]
            unit = np.repeat(np.arange(units.size), counts)
            # Sorting by (unit, key) keeps each unit's block where it was, so sorted position j has rank
            # offsets[j] in its unit: keep ranks < k.
            order = np.lexsort((self._keys(rows.size, generator), unit))
            kept = np.sort(order[offsets < self.max_rows_per_unit])
            sizes = np.minimum(counts, self.max_rows_per_unit)
            yield [chunk.tolist() for chunk in np.split(rows[kept], np.cumsum(sizes)[:-1])]

    def _rows(self, items: list[list[int]]) -> list[int]:
        return [row for unit in items for row in unit]
