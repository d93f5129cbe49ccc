"""Privacy accounting for DP-SGD: ε of a run's ledger, σ calibrated to a budget, the checks of their inputs.

Every privacy number comes from Opacus; this module only validates inputs, picks numerical
settings and turns numerical failures into one-line ``ValueError`` messages.

* ``"rdp"``: Renyi DP of the Poisson-subsampled Gaussian (Mironov 2017, "Renyi Differential
  Privacy"; Mironov, Talwar, Zhang 2019, "Renyi Differential Privacy of the Sampled Gaussian
  Mechanism"), converted to (eps, delta) with Balle et al. 2020: Opacus' arithmetic, memoised per (σ, q)
  (``hf_dp.rdp``).
* ``"prv"``: numerical composition of privacy loss random variables (Gopi, Lee, Wutschitz 2021,
  "Numerical Composition of Differential Privacy") via ``opacus.accountants.PRVAccountant`` with an eps_error
  scaled to the answer and a bounded grid (``hf_dp.prv_accountant``).
  The reported epsilon is Opacus' certified upper bound (estimate + ``eps_error``).

Numerical settings on top of Opacus' defaults:

* RDP uses Opacus' default orders plus 128, 256, 512 and 1024, i.e. the same grid as Google's
  ``dp_accounting`` (Opacus' grid stops at 63, so it cannot certify eps below ~0.1 at delta=1e-5).
* PRV uses ``eps_error = 1e-3 * eps_rdp`` (``2.5e-3 * target`` when calibrating) instead of Opacus' fixed 0.01.
* Calibration finds σ with ``target − tolerance ≤ ε(σ) ≤ target``, ``tolerance = min(0.005, 0.002 · target)``
  (Opacus' criterion), by regula falsi on (log σ, log ε) instead of Opacus' bisection: 4-6 ε evaluations where
  ``get_noise_multiplier`` takes ~16, which at 0.2–0.4 s per PRV evaluation is most of a run's start-up.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Literal

from opacus.accountants import create_accountant

from hf_dp.prv_accountant import PRV_MECHANISM_KEY, BoundedPRVAccountant
from hf_dp.rdp import RDP_ORDERS, History, rdp_epsilon

__all__ = [
    "AccountantName",
    "PrivacyAccountant",
    "calibrate_noise_multiplier",
    "compute_epsilon",
]

AccountantName = Literal["prv", "rdp"]

_ACCOUNTANTS = ("prv", "rdp")

_PRV_CALIBRATION_RELATIVE_ERROR = 2.5e-3  # PRV eps_error as a fraction of the target when calibrating
_CALIBRATION_TOLERANCE = 0.005  # Opacus' epsilon_tolerance (absolute), tightened for small targets
_MAX_SIGMA = 1e6  # a budget that needs more noise than this cannot be met (Opacus' limit)
_MIN_SIGMA = 1e-4  # the search stops halving here (where δ ≥ q, ε stays 0 as σ → 0)


def _epsilon(accountant: AccountantName, history: History, delta: float) -> float:
    """Epsilon of a validated (noise_multiplier, sample_rate, steps) history at ``delta``."""
    if not history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in history):
        return math.inf
    if accountant == "rdp":
        return max(0.0, rdp_epsilon(history, delta, RDP_ORDERS))
    prv = BoundedPRVAccountant()
    prv.history = list(history)
    return prv.get_epsilon(delta)


@functools.lru_cache(maxsize=256)
def _cached_epsilon(
    accountant: AccountantName, history: tuple[tuple[float, float, int], ...], delta: float
) -> float:
    """``_epsilon`` memoised for PrivacyAccountant: a trainer asking ``epsilon_after`` before and after each
    step and logging ``get_epsilon`` keeps asking about the same histories (a PRV call costs ~0.1-1 s)."""
    return _epsilon(accountant, list(history), delta)


# ---------------------------------------------------------------- validation (one-line messages)


def _check_accountant(accountant: str) -> AccountantName:
    if accountant not in _ACCOUNTANTS:
        raise ValueError(f"accountant must be 'prv' or 'rdp', got {accountant!r}")
    return accountant  # type: ignore[return-value]


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_noise_multiplier(noise_multiplier: float) -> float:
    if not _is_number(noise_multiplier) or not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    return float(noise_multiplier)


def _check_sample_rate(sample_rate: float) -> float:
    if not _is_number(sample_rate) or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1] (batch size / dataset size), got {sample_rate!r}")
    return float(sample_rate)


def _check_delta(delta: float) -> float:
    if not _is_number(delta) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), typically below 1/dataset size, got {delta!r}")
    return float(delta)


def _check_steps(steps: int, name: str, minimum: int) -> int:
    if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {steps!r}")
    return int(steps)


def _check_target_epsilon(target_epsilon: float) -> float:
    if not _is_number(target_epsilon) or not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    return float(target_epsilon)


# ---------------------------------------------------------------- public API


def _smallest_sigma(epsilon_of: Callable[[float], float], target: float, tolerance: float) -> float | None:
    """A σ with ``target − tolerance ≤ ε(σ) ≤ target`` (None if even σ = 1e6 spends more than ``target``).

    ε(σ) falls smoothly as σ grows. A bracket ε(lo) > target ≥ ε(hi) is found by doubling or halving from σ = 1,
    then narrowed by regula falsi on (log σ, log ε) with the Illinois step (Dowell & Jarratt 1971), which halves
    the kept end's value when the same end is kept twice, so that neither end stalls. ``hi`` always spends at
    most ``target``, so whatever the search returns meets the budget; the tolerance only decides how tight.
    """

    def log_ratio(epsilon: float) -> float:
        return (
            math.log(epsilon / target)
            if 0 < epsilon < math.inf
            else math.copysign(math.inf, epsilon - target)
        )

    lo = hi = 1.0
    e_lo = e_hi = epsilon_of(1.0)
    if e_hi > target:
        while e_hi > target:
            lo, e_lo, hi = hi, e_hi, hi * 2
            if hi > _MAX_SIGMA:
                return None
            e_hi = epsilon_of(hi)
    else:
        while e_lo <= target:
            if target - e_lo <= tolerance or lo < _MIN_SIGMA:
                return lo
            hi, e_hi, lo = lo, e_lo, lo / 2
            e_lo = epsilon_of(lo)
    f_lo, f_hi, kept = log_ratio(e_lo), log_ratio(e_hi), 0
    for _ in range(100):
        if target - e_hi <= tolerance:
            break
        x_lo, x_hi = math.log(lo), math.log(hi)
        x = (x_lo * f_hi - x_hi * f_lo) / (f_hi - f_lo) if math.isfinite(f_lo - f_hi) else (x_lo + x_hi) / 2
        width = x_hi - x_lo
        x = min(max(x, x_lo + 1e-3 * width), x_hi - 1e-3 * width)  # strictly inside the bracket
        sigma = math.exp(x)
        epsilon = epsilon_of(sigma)
        if epsilon > target:
            lo, f_lo = sigma, log_ratio(epsilon)
            f_hi, kept = (f_hi / 2 if kept == -1 else f_hi), -1
        else:
            hi, e_hi, f_hi = sigma, epsilon, log_ratio(epsilon)
            f_lo, kept = (f_lo / 2 if kept == 1 else f_lo), 1
    return hi


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: AccountantName = "prv",
) -> float:
    """Smallest noise multiplier sigma with eps(sigma, q, steps, delta) <= target_epsilon.

    Math: the σ of ``_smallest_sigma`` over the chosen accountant (RDP: Mironov 2017, Mironov, Talwar, Zhang
    2019; PRV: Gopi, Lee, Wutschitz 2021) with ``tolerance = min(0.005, 0.002 * target_epsilon)``, so the returned
    sigma spends between ``target_epsilon - tolerance`` and ``target_epsilon`` (PRV: minus its eps_error too).
    Takes ~4-8 epsilon evaluations: under 1 s with RDP, 1.2-1.9 s with PRV (benchmarks/results/calibration_speed.md).
    """
    accountant = _check_accountant(accountant)
    target_epsilon = _check_target_epsilon(target_epsilon)
    target_delta = _check_delta(target_delta)
    sample_rate = _check_sample_rate(sample_rate)
    steps = _check_steps(steps, "steps", 1)

    meter = create_accountant(PRV_MECHANISM_KEY)
    min_eps_error = _PRV_CALIBRATION_RELATIVE_ERROR * target_epsilon

    def epsilon_of(sigma: float) -> float:
        if accountant == "rdp":
            return rdp_epsilon([(sigma, sample_rate, steps)], target_delta, RDP_ORDERS)
        meter.history = [(sigma, sample_rate, steps)]
        return meter.get_epsilon(delta=target_delta, min_eps_error=min_eps_error, too_large="inf")

    sigma = _smallest_sigma(epsilon_of, target_epsilon, min(_CALIBRATION_TOLERANCE, 0.002 * target_epsilon))
    if sigma is None:
        raise ValueError(
            f"the privacy budget (epsilon={target_epsilon:g}, delta={target_delta:g}) cannot be met for "
            f"sample_rate={sample_rate:g} and steps={steps} with any noise_multiplier; "
            "use fewer steps, a smaller sample rate, or a larger target_epsilon"
        )
    if accountant == "prv":
        # The search used a PRV eps_error at least as coarse as compute_epsilon's, so compute_epsilon agrees;
        # guarantee it, since a run calibrated here must not report more than target_epsilon at the end.
        for _ in range(10):
            if compute_epsilon(sigma, sample_rate, steps, target_delta, "prv") <= target_epsilon:
                break
            sigma *= 1.001
        else:
            raise ValueError(
                f"PRV calibration did not converge for {target_epsilon=:g}; use accountant='rdp'"
            )
    return float(sigma)


def compute_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: AccountantName = "prv",
) -> float:
    """Epsilon after ``steps`` Poisson-subsampled Gaussian steps at ``delta``.

    Math: RDP takes min over orders a of steps * RDP_a(q, sigma) converted to (eps, delta)
    (Mironov 2017; Mironov, Talwar, Zhang 2019); PRV convolves the discretised privacy loss
    distribution ``steps`` times with an FFT (Gopi, Lee, Wutschitz 2021). Returns ``math.inf`` if
    ``noise_multiplier == 0`` and ``0.0`` if ``steps == 0``.
    """
    accountant = _check_accountant(accountant)
    noise_multiplier = _check_noise_multiplier(noise_multiplier)
    sample_rate = _check_sample_rate(sample_rate)
    steps = _check_steps(steps, "steps", 0)
    delta = _check_delta(delta)
    if steps == 0:
        return 0.0
    return _epsilon(accountant, [(noise_multiplier, sample_rate, steps)], delta)


def _append(history: History, noise_multiplier: float, sample_rate: float, num_steps: int) -> History:
    """Copy of ``history`` plus a phase, merging equal consecutive phases like Opacus' ``step``."""
    history = list(history)
    if history and history[-1][:2] == (noise_multiplier, sample_rate):
        history[-1] = (noise_multiplier, sample_rate, history[-1][2] + num_steps)
    elif num_steps:
        history.append((noise_multiplier, sample_rate, num_steps))
    return history


class PrivacyAccountant:
    """Running privacy ledger of a training run; epsilon comes from an Opacus accountant.

    Math: the recorded (noise_multiplier, sample_rate, steps) phases compose; epsilon at ``delta`` is
    computed by RDP (Mironov 2017; Mironov, Talwar, Zhang 2019) or PRV (Gopi, Lee, Wutschitz 2021).
    The history uses Opacus' format: a list of (noise_multiplier, sample_rate, num_steps) with equal
    consecutive phases merged.
    """

    def __init__(self, accountant: AccountantName, delta: float) -> None:
        self.accountant: AccountantName = _check_accountant(accountant)
        self.delta = _check_delta(delta)
        self._history: History = []

    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` releases of the Poisson-subsampled Gaussian mechanism."""
        noise_multiplier = _check_noise_multiplier(noise_multiplier)
        sample_rate = _check_sample_rate(sample_rate)
        num_steps = _check_steps(num_steps, "num_steps", 1)
        self._history = _append(self._history, noise_multiplier, sample_rate, num_steps)

    @property
    def history(self) -> History:
        """Copy of the recorded phases as (noise_multiplier, sample_rate, steps) tuples."""
        return list(self._history)

    @property
    def steps(self) -> int:
        """Total number of recorded steps."""
        return sum(n for _, _, n in self._history)

    def get_epsilon(self) -> float:
        """Epsilon spent so far at ``self.delta`` (0.0 before any step, inf if any step had sigma 0)."""
        return _cached_epsilon(self.accountant, tuple(self._history), self.delta)

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, extra_steps: int = 1) -> float:
        """Epsilon if ``extra_steps`` more steps were taken; the recorded history is left unchanged."""
        noise_multiplier = _check_noise_multiplier(noise_multiplier)
        sample_rate = _check_sample_rate(sample_rate)
        extra_steps = _check_steps(extra_steps, "extra_steps", 0)
        history = _append(self._history, noise_multiplier, sample_rate, extra_steps)
        return _cached_epsilon(self.accountant, tuple(history), self.delta)

    def steps_within(
        self, target_epsilon: float, noise_multiplier: float, sample_rate: float, limit: int
    ) -> int:
        """The most extra steps k ≤ ``limit`` with ε after k more steps ≤ ``target_epsilon`` (bisection over the
        accountant, ε being non-decreasing in k)."""
        if self.epsilon_after(noise_multiplier, sample_rate, limit) <= target_epsilon:
            return limit
        low, high = 0, limit  # invariant: low steps fit, high steps do not
        while high - low > 1:
            middle = (low + high) // 2
            fits = self.epsilon_after(noise_multiplier, sample_rate, middle) <= target_epsilon
            low, high = (middle, high) if fits else (low, middle)
        return low

    def state_dict(self) -> dict:
        """JSON-serialisable state: accountant name, delta and the list of [sigma, q, steps] phases."""
        return {
            "accountant": self.accountant,
            "delta": self.delta,
            "history": [[sigma, q, n] for sigma, q, n in self._history],
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace delta and history with those of :meth:`state_dict` (the accountant name must match)."""
        if not isinstance(state, dict) or not {"accountant", "delta", "history"} <= state.keys():
            raise ValueError(
                "state must be a dict from PrivacyAccountant.state_dict() with keys accountant, delta, history"
            )
        if state["accountant"] != self.accountant:
            raise ValueError(
                f"state was saved by a {state['accountant']!r} accountant; "
                f"load it into PrivacyAccountant({state['accountant']!r}, delta), not {self.accountant!r}"
            )
        delta = _check_delta(state["delta"])
        history: History = []
        for entry in state["history"]:
            if not isinstance(entry, list | tuple) or len(entry) != 3:
                raise ValueError(
                    f"history entries must be [noise_multiplier, sample_rate, steps], got {entry!r}"
                )
            history = _append(
                history,
                _check_noise_multiplier(entry[0]),
                _check_sample_rate(entry[1]),
                _check_steps(entry[2], "history steps", 1),
            )
        self.delta = delta
        self._history = history
