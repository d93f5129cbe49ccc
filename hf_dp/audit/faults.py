"""The DP bugs the audit must catch, injectable one at a time: its tests and its results table use them.

Each is a single wrong line of the kind DP libraries have shipped: the noise dropped or halved, clipping
skipped, a sampler that draws one row in every batch while the accountant is told q < 1, or a correlated-noise
strategy whose columns were not normalised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_dp.clipping.sums import SumWriter
from hf_dp.mechanism import BandMFMechanism
from hf_dp.noise import GaussianNoise
from hf_dp.sampling import PoissonBatchSampler


def _no_noise() -> Callable:
    return lambda self, shape, std, device, dtype: torch.zeros(shape, dtype=dtype)


def _half_noise() -> Callable:
    draw = GaussianNoise.sample
    return lambda self, shape, std, device, dtype: draw(self, shape, std / 2, device, dtype)


def _no_clipping() -> Callable:
    """Every clip factor 1 (``SumWriter._factors``, where every pass's c_i is formed)."""
    return lambda self, norms, finite, clip_norm: torch.ones_like(norms)


def _last_row_always_sampled() -> Callable:
    """The last row (where the audit puts its canary) joins every logical batch."""
    batches = PoissonBatchSampler._logical_batches

    def always(self, generator):
        for batch in batches(self, generator):
            yield sorted(set(batch) | {self.num_samples - 1})

    return always


def _unnormalised_columns() -> Callable:
    """BandMF's strategy with columns of norm 10 instead of 1 (its sensitivity): the noise C⁻¹z is 10× too small
    for the σ the accountant is told."""
    build = BandMFMechanism.__init__

    def unnormalised(self, **kwargs):
        build(self, **kwargs)
        self.coefs = tuple(10 * c for c in self.coefs)

    return unnormalised


FAULTS: dict[str, tuple[type, str, Callable[[], Callable]]] = {
    "no_noise": (GaussianNoise, "sample", _no_noise),
    "half_noise": (GaussianNoise, "sample", _half_noise),
    "no_clipping": (SumWriter, "_factors", _no_clipping),
    "always_sampled": (PoissonBatchSampler, "_logical_batches", _last_row_always_sampled),
    "bandmf_unnormalised": (BandMFMechanism, "__init__", _unnormalised_columns),
}


def fault(name: str) -> tuple[type, str, Any]:
    """``(owner, attribute, broken replacement)`` for ``setattr`` or pytest's ``monkeypatch.setattr``."""
    if name not in FAULTS:
        raise ValueError(f"hf_dp.audit: unknown fault {name!r}; known: {', '.join(FAULTS)}")
    owner, attribute, make = FAULTS[name]
    return owner, attribute, make()
