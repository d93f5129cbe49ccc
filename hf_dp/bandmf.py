"""The BandMF strategy: a banded lower-triangular Toeplitz matrix C for correlated noise (pure math, float64).

C is n×n with C[t, t−j] = c_j for 0 ≤ j < b and zero elsewhere (Choquette-Choo et al. 2023, "Amplified matrix
factorization", arXiv 2306.08153). The noise added at step t is x = C⁻¹z; the workload A is prefix sums (the
n×n lower-triangular ones), so the error of prefix sum t is ‖row t of A C⁻¹‖² times the sensitivity², the largest
column norm of C, which is ‖c‖ (column 0 holds every coefficient). C⁻¹ and A C⁻¹ are lower-triangular Toeplitz:
C⁻¹ has coefficients d (the impulse response of the recursion c * d = δ), A C⁻¹ has e_k = Σ_{i≤k} d_i, the
solution of C e = 1. Both are O(n·b) recursions (scipy's lfilter), never an n×n inverse. The coefficients are
chosen to minimise the mean prefix-sum error by L-BFGS on b − 1 free coefficients (c_0 fixed, then scaled to
‖c‖ = 1), as in McKenna 2024, "Scaling up the banded matrix factorization mechanism", arXiv 2405.15913.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

_CACHE_VERSION = 1
_MAX_AUTO_BANDS = 64


def _check_coefs(coefs: np.ndarray, n: int) -> np.ndarray:
    c = np.asarray(coefs, dtype=np.float64).reshape(-1)
    if n < 1:
        raise ValueError(f"n={n}: the number of steps must be at least 1")
    if c.size == 0 or not np.all(np.isfinite(c)) or c[0] == 0.0:
        raise ValueError(f"coefs={c.tolist()}: need finite Toeplitz coefficients with c_0 ≠ 0")
    return c[:n]  # C is n×n: coefficients past the n-th fall outside the matrix


def closed_form_coefs(bands: int) -> np.ndarray:
    """c_j = Π_{k=1..j} (2k−1)/(2k) for j < b, scaled to Σc² = 1: the max-error optimum for prefix sums (C² = A,
    Fichtenberger et al. 2023; Dvijotham et al. 2024), truncated to b bands."""
    if bands < 1:
        raise ValueError(f"bands={bands}: use at least 1 band")
    k = np.arange(1, bands, dtype=np.float64)
    c = np.concatenate([[1.0], np.cumprod((2.0 * k - 1.0) / (2.0 * k))])
    return c / np.linalg.norm(c)


def inverse_coefs(coefs: np.ndarray, n: int) -> np.ndarray:
    """d_0..d_{n−1}, the Toeplitz coefficients of C⁻¹: d_0 = 1/c_0, d_k = −(Σ_{j=1..min(k,b−1)} c_j d_{k−j})/c_0."""
    c = _check_coefs(coefs, n)
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return lfilter([1.0], c, impulse)


def _prefix_noise_coefs(c: np.ndarray, n: int) -> np.ndarray:
    """e_k = Σ_{i≤k} d_i, the Toeplitz coefficients of A C⁻¹ (the solution of C e = 1)."""
    return lfilter([1.0], c, np.ones(n))


def column_norms(coefs: np.ndarray, n: int) -> np.ndarray:
    """The n column norms of the n×n C: column s holds c_0..c_{min(b, n−s)−1}, so its norm² is a prefix sum of c²."""
    c = _check_coefs(coefs, n)
    prefix = np.cumsum(c**2)  # prefix[m − 1] = Σ_{j<m} c_j²
    rows_in_column = np.minimum(c.size, n - np.arange(n))
    return np.sqrt(prefix[rows_in_column - 1])


def per_step_error(coefs: np.ndarray, n: int) -> np.ndarray:
    """Variance of prefix sum t's noise, ‖c‖²·Σ_{k≤t} e_k²: unit-variance z scaled by the sensitivity ‖c‖ (the
    largest column norm), so the error does not depend on the scale of coefs."""
    c = _check_coefs(coefs, n)
    e = _prefix_noise_coefs(c, n)
    return float(c @ c) * np.cumsum(e**2)


def mean_error(coefs: np.ndarray, n: int) -> float:
    """Mean over t of per_step_error: ‖c‖²·Σ_k (n−k) e_k² / n."""
    return float(np.mean(per_step_error(coefs, n)))


def _log_loss_and_grad(theta: np.ndarray, n: int, weights: np.ndarray) -> tuple[float, np.ndarray]:
    """log(mean_error) of c = (1, θ) and its gradient in θ.

    With F = Σ_k w_k e_k² (w_k = (n−k)/n) and C e = 1: ∂e/∂c_j = −C⁻¹ S_j e (S_j shifts down by j), so
    ∂F/∂c_j = −2 Σ_{k≥j} g_k e_{k−j} with g = C⁻ᵀ(w∘e), an upper-triangular solve done as a reversed lower one."""
    c = np.concatenate([[1.0], theta])
    with np.errstate(over="ignore", invalid="ignore"):
        e = _prefix_noise_coefs(c, n)
        f = float(weights @ e**2)
        s = float(c @ c)
        if not (math.isfinite(f) and f > 0.0):
            return math.inf, np.zeros_like(theta)
        g = lfilter([1.0], c, (weights * e)[::-1])[::-1]
        df = np.array([-2.0 * (g[j:] @ e[: n - j]) for j in range(1, c.size)])
    grad = 2.0 * theta / s + df / f  # ∇ log(s·F) = ∇s/s + ∇F/F
    if not np.all(np.isfinite(grad)):
        return math.inf, np.zeros_like(theta)
    return math.log(s) + math.log(f), grad


def _run_optimizer(n: int, bands: int, start: np.ndarray) -> np.ndarray:
    """L-BFGS on c_1..c_{b−1} with c_0 = 1 (the error is scale-free); returns the optimum scaled to ‖c‖ = 1."""
    weights = (n - np.arange(n, dtype=np.float64)) / n
    theta0 = start[1:] / start[0]
    result = minimize(
        _log_loss_and_grad,
        theta0,
        args=(n, weights),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 2000, "maxcor": 20, "ftol": 1e-15, "gtol": 1e-10},
    )
    c = np.concatenate([[1.0], np.asarray(result.x, dtype=np.float64)])
    if not (np.all(np.isfinite(c)) and math.isfinite(float(result.fun))):
        raise RuntimeError(f"BandMF: the optimiser diverged for n={n}, bands={bands} ({result.message})")
    return c / np.linalg.norm(c)


def _cache_file(n: int, bands: int) -> Path:
    root = os.environ.get("HF_DP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_dp")
    return Path(root) / "bandmf" / f"n{n}_b{bands}.json"


def _read_cache(path: Path, n: int, bands: int) -> np.ndarray | None:
    """The cached coefficients, or None if the file is missing, corrupt or for another n, b or cache version."""
    try:
        record = json.loads(path.read_text())
        if record["version"] != _CACHE_VERSION or record["n"] != n or record["bands"] != bands:
            return None
        c = np.asarray(record["coefs"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if c.shape != (bands,) or not np.all(np.isfinite(c)) or c[0] <= 0.0 or abs(c @ c - 1.0) > 1e-9:
        return None
    return c


def _write_cache(path: Path, n: int, bands: int, c: np.ndarray) -> None:
    """Writes atomically (temp file + os.replace); an unwritable cache is skipped, not an error."""
    record = {
        "version": _CACHE_VERSION,
        "n": n,
        "bands": bands,
        "coefs": c.tolist(),
        "mean_error": mean_error(c, n),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


@functools.cache
def _optimize_coefs_cached(n: int, bands: int) -> tuple[float, ...]:
    path = _cache_file(n, bands)
    c = _read_cache(path, n, bands)
    if c is None:
        c = _run_optimizer(n, bands, closed_form_coefs(bands))
        _write_cache(path, n, bands, c)
    return tuple(float(x) for x in c)


def optimize_coefs(n: int, bands: int) -> np.ndarray:
    """Coefficients minimising the mean prefix-sum error over n steps subject to max column norm ‖c‖ = 1 (L-BFGS
    from the closed form, float64; McKenna 2024). Cached in process and on disk under
    $HF_DP_CACHE (default ~/.cache/hf_dp)/bandmf/n{n}_b{bands}.json."""
    if not 1 <= bands <= n:
        raise ValueError(f"bands={bands}, n={n}: use 1 ≤ bands ≤ the number of steps")
    if bands == 1:
        return np.ones(1)
    return np.array(_optimize_coefs_cached(int(n), int(bands)))


@dataclass(frozen=True)
class BandedToeplitz:
    """A BandMF strategy: normalised coefficients c_0..c_{b−1} (‖c‖ = 1, c_0 > 0) for num_steps steps."""

    coefs: tuple[float, ...]
    num_steps: int
    source: str  # "optimized" or "closed_form"

    def __post_init__(self) -> None:
        c = np.asarray(self.coefs, dtype=np.float64)
        if not 1 <= c.size <= self.num_steps:
            raise ValueError(f"{c.size} bands for {self.num_steps} steps: use 1 ≤ bands ≤ num_steps")
        if not np.all(np.isfinite(c)) or c[0] <= 0.0 or abs(c @ c - 1.0) > 1e-9:
            raise ValueError(f"coefs={self.coefs}: need finite coefficients with c_0 > 0 and Σc² = 1")
        if self.source not in ("optimized", "closed_form"):
            raise ValueError(f"source={self.source!r}: use 'optimized' or 'closed_form'")

    @property
    def bands(self) -> int:
        return len(self.coefs)

    def column_norms(self) -> np.ndarray:
        return column_norms(np.asarray(self.coefs), self.num_steps)

    def per_step_error(self) -> np.ndarray:
        return per_step_error(np.asarray(self.coefs), self.num_steps)

    def mean_error(self) -> float:
        return mean_error(np.asarray(self.coefs), self.num_steps)

    @property
    def marginal_std(self) -> float:
        """The std of one step's noise x_t in units of σC, as a root mean square over the steps:
        sqrt(mean_t Σ_{k≤t} d_k²) with d the coefficients of C⁻¹ (1 for b = 1)."""
        d = inverse_coefs(np.asarray(self.coefs), self.num_steps)
        return float(np.sqrt(np.mean(np.cumsum(d**2))))


INDEPENDENT = BandedToeplitz((1.0,), 1, "closed_form")  # b = 1: DP-SGD's independent noise


def banded_strategy(num_steps: int, bands: int) -> BandedToeplitz:
    """The optimised strategy, or the closed form (source="closed_form") if the optimiser fails or does worse;
    bands = 1 is DP-SGD, c = (1.0,)."""
    if bands < 1 or bands > num_steps:
        raise ValueError(f"bands={bands}, num_steps={num_steps}: use 1 ≤ num_bands ≤ the number of steps")
    closed = closed_form_coefs(bands)
    if bands == 1:
        return BandedToeplitz((1.0,), num_steps, "closed_form")
    try:
        c = optimize_coefs(num_steps, bands)
        if mean_error(c, num_steps) <= mean_error(closed, num_steps):
            return BandedToeplitz(tuple(float(x) for x in c), num_steps, "optimized")
    except (RuntimeError, ValueError, FloatingPointError, np.linalg.LinAlgError):
        pass
    return BandedToeplitz(tuple(float(x) for x in closed), num_steps, "closed_form")


def choose_bands(
    num_steps: int,
    max_bands: int,
    noise_multiplier_for: Callable[[int], float],
    candidates: Sequence[int] | None = None,
) -> int:
    """num_bands="auto": the candidate b ≤ min(max_bands, num_steps) with the least σ_b²·mean_error(b), where
    σ_b = noise_multiplier_for(b) is calibrated for ⌈n/b⌉ steps at rate b·q (Choquette-Choo et al. 2023, Thm 4);
    ties go to the smaller b. Default candidates: the powers of two up to 64."""
    limit = min(max_bands, num_steps)
    if limit < 1:
        raise ValueError(f"max_bands={max_bands}, num_steps={num_steps}: both must be at least 1")
    if candidates is None:
        candidates = [
            1 << i for i in range(_MAX_AUTO_BANDS.bit_length()) if 1 << i <= min(limit, _MAX_AUTO_BANDS)
        ]
    usable = sorted({int(b) for b in candidates if 1 <= b <= limit})
    if not usable:
        raise ValueError(
            f"candidates={list(candidates)}: none is within 1..{limit} (min of max_bands, num_steps)"
        )
    best, best_error = None, math.inf
    for b in usable:
        sigma = float(noise_multiplier_for(b))
        expected = sigma**2 * banded_strategy(num_steps, b).mean_error()
        if expected < best_error:
            best, best_error = b, expected
    if best is None:
        raise ValueError(f"no finite noise multiplier for any of bands={usable}")
    return best
