"""The Rényi DP of the Poisson-subsampled Gaussian (Mironov 2017; Mironov, Talwar, Zhang 2019) as Opacus computes
it, memoised per (σ, q): an ε at any step count or δ, and the PRV accountant's safe domain, reuse one vector."""

from __future__ import annotations

import functools
import warnings

import numpy as np
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

# A privacy ledger: its (noise_multiplier, sample_rate, steps) phases, Opacus' format.
History = list[tuple[float, float, int]]

# Opacus' default RDP orders extended with the large orders used by Google's dp_accounting.
RDP_ORDERS: tuple[float, ...] = tuple(RDPAccountant.DEFAULT_ALPHAS) + (128, 256, 512, 1024)


@functools.lru_cache(maxsize=4096)
def rdp_of_one_step(noise_multiplier: float, sample_rate: float, orders: tuple[float, ...]) -> np.ndarray:
    """Opacus' RDP of one Poisson-subsampled Gaussian step at each order (Mironov, Talwar, Zhang 2019), memoised.

    Opacus' ``compute_rdp`` is this vector times the step count, and its fractional orders cost a Python series
    each (~0.1-0.3 s per (σ, q) over the default orders); an ε at another step count or δ, and the PRV's safe
    domain, ask for the same vector again (read-only: cached)."""
    rdp = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(orders))
    rdp.flags.writeable = False
    return rdp


def rdp_epsilon(history: History, delta: float, orders: tuple[float, ...]) -> float:
    """Opacus' RDP ε at ``delta`` of a (σ, q, steps) history: Σ_phases steps · RDP_a(q, σ), converted at the best
    order a (Balle et al. 2020; ``opacus.accountants.analysis.rdp.get_privacy_spent``), the same arithmetic as
    ``RDPAccountant.get_epsilon``."""
    rdp = sum([rdp_of_one_step(sigma, q, orders) * steps for sigma, q, steps in history])
    with warnings.catch_warnings():  # "optimal order is the largest alpha": Opacus' hint about its order grid
        warnings.simplefilter("ignore")
        epsilon, _ = get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(epsilon)
