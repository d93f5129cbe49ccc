"""Opacus' PRV accountant (Gopi, Lee, Wutschitz 2021) with an eps_error scaled to the answer and a bounded grid,
registered in Opacus' accountant registry under ``PRV_MECHANISM_KEY``.

* eps_error defaults to ``1e-3 * eps_rdp`` (a cheap RDP estimate of the answer) instead of Opacus' fixed 0.01, so
  small budgets are not swamped by a 0.01 additive error, and is coarsened when the discretisation grid would
  exceed 2**20 points (keeps calls < ~1 s). For eps below ~0.1 the grid cap makes the PRV bound a few percent
  loose; it is still an upper bound.
* The safe domain is Opacus' own, from the memoised RDP (``hf_dp.rdp``); the grid is widened to a length from a
  short ladder of fast FFT lengths (``_fft_length``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import numpy as np
from opacus.accountants import PRVAccountant, RDPAccountant, register_accountant
from opacus.accountants.analysis.prv import Domain

from hf_dp.rdp import History, rdp_epsilon

# A short order grid for the cheap RDP estimate that sizes the PRV error (it is not reported).
_RDP_GUESS_ORDERS = (1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 128, 256)
# Opacus' own orders, with which its PRV accountant bounds the safe domain (``_safe_domain``).
_DOMAIN_ORDERS = tuple(RDPAccountant.DEFAULT_ALPHAS)

_PRV_RELATIVE_ERROR = 1e-3  # PRV eps_error as a fraction of (an RDP estimate of) the epsilon measured
_PRV_MIN_EPS_ERROR = 1e-7
_PRV_MAX_EPS_ERROR = 0.5  # Opacus' safe-domain heuristic is only validated for eps_error < 1
_PRV_MAX_GRID = 2**20  # discretisation points; cost is dominated by an FFT of this size
PRV_MECHANISM_KEY = "hf_dp.prv"  # registry key of the PRV accountant below


def _fft_length(size: int) -> int:
    """The smallest length ≥ ``size`` among 2^k·{16, 18, 20, 24, 30} (k ≥ 0): even, 5-smooth (the FFT of a length
    with a large prime factor is ~5x slower) and at most 5/4 of ``size`` (for ``size`` ≥ 16). Every log line asks
    ε on a grid of a new size; scipy keeps the FFT plans of the last 16 lengths, so padding to the nearest fast
    length (a new one almost every call) kept refilling that cache: benchmarks/long_run.py's RSS levelled off
    192 MB above its first step, after ~1400 steps (results/archive/long_run_before_fft_ladder.json). The ladder
    has 5 lengths per octave, which a run's calls share: 67 MB, level after ~1000 steps (results/long_run.json),
    for ~10% more FFT work per call."""
    power = 1
    while True:
        for factor in (16, 18, 20, 24, 30):
            if factor * power >= size:
                return factor * power
        power *= 2


class _GridTooLarge(Exception):
    """Raised before discretising when the PRV grid would exceed ``_PRV_MAX_GRID`` points."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class BoundedPRVAccountant(PRVAccountant):
    """``opacus.accountants.PRVAccountant`` with an eps_error scaled to the answer and a bounded grid."""

    def _get_domain(self, prvs, num_self_compositions, eps_error, delta_error):  # type: ignore[override]
        domain = _safe_domain(prvs, num_self_compositions, eps_error, delta_error)
        if domain.size > _PRV_MAX_GRID:
            raise _GridTooLarge(domain.size)
        # Widen the safe domain symmetrically (same mesh, a larger truncation bound, so the same
        # guarantee) to a length from a short ladder (``_fft_length``).
        size = _fft_length(domain.size)
        pad = (size - domain.size) // 2
        return Domain(t_min=domain.t_min - pad * domain.dt, t_max=domain.t_max + pad * domain.dt, size=size)

    def get_epsilon(  # type: ignore[override]
        self,
        delta: float,
        *,
        eps_error: float | None = None,
        delta_error: float | None = None,
        min_eps_error: float = 0.0,
        too_large: Literal["raise", "inf"] = "raise",
        **kwargs: Any,
    ) -> float:
        """Opacus' certified PRV upper bound on eps at ``delta``.

        ``eps_error`` defaults to ``max(1e-3 * eps_rdp, min_eps_error)`` and is raised if the grid would
        be too large; ``too_large="inf"`` returns inf instead of raising when eps is too large for the
        grid (an upper bound that is all a calibration search needs).
        """
        if not self.history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in self.history):
            return math.inf

        def unrepresentable(reason: str, exc: BaseException | None = None) -> float:
            if too_large == "inf" and exc is None:
                return math.inf
            raise ValueError(
                f"the PRV accountant cannot handle {_describe(self.history)} at delta={delta:g} ({reason}); "
                "use accountant='rdp', or a larger noise_multiplier, fewer steps or a larger delta"
            ) from exc

        if eps_error is None:
            guess = rdp_epsilon(self.history, delta, _RDP_GUESS_ORDERS)
            if not math.isfinite(guess):
                return unrepresentable("epsilon is unbounded")
            eps_error = max(_PRV_RELATIVE_ERROR * guess, min_eps_error)
        eps_error = min(max(eps_error, _PRV_MIN_EPS_ERROR), _PRV_MAX_EPS_ERROR)
        for _attempt in range(3):
            try:
                # Opacus' internal RDP bound for the grid warns about its order range: nothing to act on.
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    eps = super().get_epsilon(delta, eps_error=eps_error, delta_error=delta_error)
            except _GridTooLarge as exc:
                if eps_error >= _PRV_MAX_EPS_ERROR:
                    return unrepresentable("epsilon too large for the discretisation grid")
                eps_error = min(eps_error * exc.size / _PRV_MAX_GRID * 1.05, _PRV_MAX_EPS_ERROR)
                continue
            except (ArithmeticError, RuntimeError, ValueError, MemoryError) as exc:
                return unrepresentable(f"{type(exc).__name__}: {exc}".replace("\n", " "), exc)
            if not math.isfinite(eps):
                return unrepresentable("epsilon overflowed")
            return max(0.0, float(eps))
        return unrepresentable("epsilon too large for the discretisation grid")


register_accountant(PRV_MECHANISM_KEY, BoundedPRVAccountant, force=True)


def _describe(history: History) -> str:
    if len(history) == 1:
        sigma, q, steps = history[0]
        return f"noise_multiplier={sigma:g}, sample_rate={q:g}, steps={steps}"
    return f"a history of {len(history)} phases"


def _safe_domain(prvs, num_self_compositions: list[int], eps_error: float, delta_error: float) -> Domain:
    """The PRV discretisation of Gopi, Lee, Wutschitz 2021 (remark 5.6), with the truncation bound Opacus'
    ``PRVAccountant`` uses: L = 3 + max(eps_error, the RDP ε of the whole history at δ_err/4, of any one step at
    δ_err/(8k)), k the total step count, and mesh eps_error/√(k·log(12/δ_err)/2). Opacus computes the same two
    RDP bounds without memoising them, which made them most of each PRV evaluation."""
    total = sum(num_self_compositions)
    history = [
        (prv.noise_multiplier, prv.sample_rate, k) for prv, k in zip(prvs, num_self_compositions, strict=True)
    ]
    bound = rdp_epsilon(history, delta_error / 4, _DOMAIN_ORDERS)
    for sigma, q, _ in history:
        bound = max(bound, rdp_epsilon([(sigma, q, 1)], delta_error / (8 * total), _DOMAIN_ORDERS))
    bound = max(bound, eps_error) + 3
    mesh = eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)
    return Domain.create_aligned(-bound, bound, mesh)
