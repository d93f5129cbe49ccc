"""DOPPLER's low-pass filters as pure math (Zhang, Bu, Hong, Razaviyayn 2024, §3–5, App. A.2 and C).

A filter (b, a) maps the privatised gradients g to m_t = −Σ_{τ=1..n_a} a_τ m_{t−τ} + Σ_{τ=0..n_b} b_τ g_{t−τ}.
Note the minus sign on a: momentum is b = (0.1,), a = (−0.9,). The impulse response κ gives
m_t = Σ_τ κ_τ g_{t−τ}; under white noise of variance s² in g the output has variance s²·Σκ², the
"var" column of the paper's tables. The poles are the roots of z^{n_a} + a_1 z^{n_a−1} + … + a_{n_a};
the filter is stable iff all lie strictly inside the unit circle (App. A.2 states the condition for the
reversed polynomial, so it reads inverted). DOPPLER needs unit DC gain H(1) = Σb/(1 + Σa) = 1, i.e.
Σb − Σa = 1, and divides m_t by the step response c_{a,t} = Σ_{τ≤t} κ_τ, so that a constant input
passes unchanged from the first step on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Filter = tuple[tuple[float, ...], tuple[float, ...]]
"""(b, a): b_0..b_{n_b} on the inputs, a_1..a_{n_a} on the past outputs."""

FILTERS: dict[str, Filter] = {
    # DOPPLER Table 2
    "sgd": ((1.0,), ()),
    "momentum": ((0.1,), (-0.9,)),
    "first_order_v1": ((1 / 11, 1 / 11), (-9 / 11,)),
    "first_order_v2": ((3 / 11, -1 / 11), (-9 / 11,)),
    "second_order": ((1 / 58, 2 / 58, 1 / 58), (-92 / 58, 38 / 58)),
    # DOPPLER Table 4 (ablation): f1, f2 vary b; f3, f4 vary a; f5, f6 vary the order
    "f1": ((0.075, 0.025), (-0.9,)),
    "f2": ((0.025, 0.075), (-0.9,)),
    "f3": ((0.1, 0.1), (-0.8,)),
    "f4": ((0.2, 0.2), (-0.6,)),
    "f5": ((0.025, 0.05, 0.025), (-0.9,)),
    "f6": ((0.025, 0.025), (-1.8, 0.85)),
}

GAIN_TOLERANCE = 1e-6


def resolve_filter(
    name: str | None, b: Sequence[float] | None = None, a: Sequence[float] | None = None
) -> Filter:
    """The (b, a) of a table filter ``name``, or the user's own ``b`` (and ``a``, empty for an FIR filter)."""
    if name is not None:
        if b is not None or a is not None:
            raise ValueError("doppler takes either filter=<name> or custom b=[...], a=[...], not both")
        if name not in FILTERS:
            raise ValueError(f"unknown DOPPLER filter {name!r}; use one of {sorted(FILTERS)} or custom b, a")
        return FILTERS[name]
    if b is None:
        raise ValueError(f"doppler needs filter=<name> (one of {sorted(FILTERS)}) or custom b=[...], a=[...]")
    return tuple(float(x) for x in b), tuple(float(x) for x in (a or ()))


def poles(a: Sequence[float]) -> np.ndarray:
    """Roots of z^{n_a} + a_1 z^{n_a−1} + … + a_{n_a} (empty for an FIR filter)."""
    return np.roots([1.0, *a]) if len(a) else np.zeros(0, dtype=complex)


def pole_radius(a: Sequence[float]) -> float:
    """Largest pole magnitude; < 1 means stable."""
    return float(np.abs(poles(a)).max(initial=0.0))


def impulse_response(b: Sequence[float], a: Sequence[float], steps: int) -> np.ndarray:
    """κ_0..κ_{steps−1}: the output for the input 1, 0, 0, … (float64)."""
    kappa = np.zeros(steps)
    for t in range(steps):
        kappa[t] = (b[t] if t < len(b) else 0.0) - sum(a[i] * kappa[t - 1 - i] for i in range(min(len(a), t)))
    return kappa


def bias_tracker(b: Sequence[float], a: Sequence[float], steps: int) -> np.ndarray:
    """c_{a,0}..c_{a,steps−1} = the step response Σ_{τ≤t} κ_τ (DOPPLER Alg. 2 line 3)."""
    return np.cumsum(impulse_response(b, a, steps))


def frequency_response(b: Sequence[float], a: Sequence[float], omega: float | np.ndarray) -> np.ndarray:
    """H(e^{jω}) = Σ_k b_k e^{−jωk} / (1 + Σ_k a_k e^{−jωk})."""
    omega = np.asarray(omega, dtype=float)
    numerator = sum(coef * np.exp(-1j * omega * k) for k, coef in enumerate(b))
    denominator = 1 + sum(coef * np.exp(-1j * omega * k) for k, coef in enumerate(a, start=1))
    return numerator / denominator


def variance_factor(b: Sequence[float], a: Sequence[float]) -> float:
    """Σ_{τ≥0} κ_τ², exactly: the head κ_0..κ_{n_b−1} summed, the tail by a discrete Lyapunov equation.

    From t = n_b on, x_t = (κ_t, …, κ_{t−n_a+1}) obeys x_{t+1} = A x_t (A the companion matrix of a),
    so Σ_{t≥n_b} κ_t² = x_{n_b}ᵀ P x_{n_b} with P = Aᵀ P A + e_1 e_1ᵀ.
    """
    n_a, n_b = len(a), len(b) - 1
    if n_a == 0:
        return float(np.sum(np.square(b)))
    if pole_radius(a) >= 1:
        raise ValueError(f"the filter is unstable (largest pole |z| = {pole_radius(a):.4f}): Σκ² diverges")
    kappa = impulse_response(b, a, n_b + 1)
    x = np.array([kappa[n_b - i] if n_b - i >= 0 else 0.0 for i in range(n_a)])
    companion = np.zeros((n_a, n_a))
    companion[0] = -np.asarray(a)
    companion[1:, :-1] = np.eye(n_a - 1)
    e1 = np.zeros((n_a, n_a))
    e1[0, 0] = 1.0
    vec_p = np.linalg.solve(np.eye(n_a * n_a) - np.kron(companion.T, companion.T), e1.ravel())
    return float(np.sum(kappa[:n_b] ** 2) + x @ vec_p.reshape(n_a, n_a) @ x)


def snr(b: Sequence[float], a: Sequence[float], c: Sequence[float], steps: int) -> float:
    """DOPPLER §5's normalised SNR Σ_t Σ_{τ≤t} c_τ κ_τ / Σ_t Σ_{τ≤t} κ_τ² over t < steps.

    c_τ are the gradient auto-correlation coefficients of Assumption A4 (c_0 = ½).
    """
    kappa = impulse_response(b, a, steps)
    weight = steps - np.arange(steps)  # how many t ≥ τ there are
    return float(np.sum(weight * np.asarray(c[:steps]) * kappa) / np.sum(weight * kappa**2))


def validate_filter(b: Sequence[float], a: Sequence[float]) -> None:
    """A one-line ValueError for a filter DOPPLER cannot run: b_0 = 0, unstable, not unit gain, c_a,t ≈ 0."""
    if not b or not all(math.isfinite(x) for x in (*b, *a)):
        raise ValueError(
            f"DOPPLER filter needs a non-empty b and finite coefficients, got b={list(b)}, a={list(a)}"
        )
    if b[0] == 0:
        raise ValueError(
            f"DOPPLER filter needs b_0 ≠ 0 (the bias tracker starts at c_a,0 = b_0), got b={list(b)}"
        )
    radius = pole_radius(a)
    if radius >= 1:
        raise ValueError(
            f"DOPPLER filter is unstable: its largest pole has |z| = {radius:.6g}, not strictly inside the "
            f"unit circle (poles = roots of z^n_a + a_1 z^(n_a-1) + ...; a enters with a minus sign, "
            f"momentum is a=[-0.9])"
        )
    gain = sum(b) - sum(a)
    if abs(gain - 1) > GAIN_TOLERANCE:
        raise ValueError(
            f"DOPPLER filter must have unit DC gain Σb − Σa = 1, got {gain:.6g}; "
            f"normalise it: scale b so that Σb = 1 + Σa"
        )
    settle = math.ceil(math.log(1e-6) / math.log(radius)) if radius > 0 else 0
    tracker = bias_tracker(b, a, min(len(b) + settle, 100_000))
    t = int(np.argmin(np.abs(tracker)))
    if abs(tracker[t]) < 1e-6:
        raise ValueError(
            f"DOPPLER filter's bias tracker c_a,{t} = {tracker[t]:.3g} ≈ 0: m_t / c_a,t would blow up"
        )
