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
