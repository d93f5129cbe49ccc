"""Tests for hf_dp.accounting, checked against Google's independent ``dp_accounting`` library."""

import functools
import json
import math
import time

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

from hf_dp.accounting import (
    PrivacyAccountant,
    _epsilon,
    _smallest_sigma,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from hf_dp.prv_accountant import BoundedPRVAccountant, _fft_length, _safe_domain
from hf_dp.rdp import RDP_ORDERS

ACCOUNTANTS = ["rdp", "prv"]

# (noise_multiplier, sample_rate, steps, delta) spanning typical DP fine-tuning.
SETTINGS = [
    (0.7, 0.005, 1000, 1e-5),
    (0.8, 0.004, 2000, 1e-5),
    (1.0, 0.001, 3000, 1e-6),  # small epsilon (~0.3 with PRV): where a fixed 0.01 eps_error would be 3% off
    (1.0, 0.1, 100, 1e-5),
    (2.0, 0.05, 500, 1e-7),
    (5.0, 0.1, 10, 1e-5),
]


def _event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, gaussian), steps
    )


def reference_epsilon(accountant: str, phases: list[tuple[float, float, int]], delta: float) -> float:
    """dp_accounting's epsilon: RdpAccountant for "rdp", PLDAccountant (Poisson-subsampled Gaussian PLD) for "prv"."""
    rdp = RdpAccountant()
    for noise_multiplier, sample_rate, steps in phases:
        rdp.compose(_event(noise_multiplier, sample_rate, steps))
    if accountant == "rdp":
        return rdp.get_epsilon(delta)
    # A 1e-3 value grid is within 0.1% for eps >= 1 but 4% off at eps ~0.3, where 1e-4 (3-10x slower) is needed.
    pld = PLDAccountant(value_discretization_interval=1e-3 if rdp.get_epsilon(delta) > 2 else 1e-4)
    for noise_multiplier, sample_rate, steps in phases:
        pld.compose(_event(noise_multiplier, sample_rate, steps))
    return pld.get_epsilon(delta)


def rel_diff(value: float, reference: float) -> float:
    return abs(value / reference - 1)


# ---------------------------------------------------------------- compute_epsilon vs dp_accounting


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), SETTINGS)
def test_compute_epsilon_matches_dp_accounting(accountant, sigma, q, steps, delta):
    eps = compute_epsilon(sigma, q, steps, delta, accountant)
    reference = reference_epsilon(accountant, [(sigma, q, steps)], delta)
    assert rel_diff(eps, reference) < 0.01, (eps, reference)


def test_prv_grid_changes_do_not_change_opacus_answer():
    # hf_dp's PRV accountant pads Opacus' grid to an FFT-friendly length; at a fixed eps_error the answer
    # must be Opacus' own (heterogeneous phases, even and odd step counts).
    history = [(1.0, 0.01, 300), (0.8, 0.02, 201)]
    stock, ours = PRVAccountant(), BoundedPRVAccountant()
    stock.history, ours.history = list(history), list(history)
    expected = stock.get_epsilon(1e-5, eps_error=0.01)
    assert ours.get_epsilon(1e-5, eps_error=0.01) == pytest.approx(expected, rel=1e-7)


@pytest.mark.parametrize(
    "history",
    [[(1.0, 0.01, 300)], [(1.0, 0.01, 300), (0.8, 0.02, 201)], [(0.5, 1.0, 3)], [(3.0, 1e-4, 10_000)]],
)
def test_the_memoised_rdp_and_safe_domain_are_opacus_own(history):
    # The RDP vector of one step is memoised and scaled by the step count: ε must be exactly what Opacus'
    # RDPAccountant computes, and the PRV safe domain exactly the one Opacus' PRVAccountant builds.
    stock = RDPAccountant()
    stock.history = list(history)
    for delta in (1e-5, 1e-3):
        expected = stock.get_epsilon(delta, alphas=list(RDP_ORDERS))
        assert _epsilon("rdp", history, delta) == expected
        assert _epsilon("rdp", history, delta) == expected  # again, from the memo
    prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
    steps = [k for _, _, k in history]
    for eps_error, delta_error in ((0.01, 1e-8), (0.5, 1e-9)):
        ours = _safe_domain(prvs, steps, eps_error, delta_error)
        opacus = PRVAccountant()._get_domain(prvs, steps, eps_error, delta_error)
        assert (ours.t_min, ours.t_max, ours.size) == (opacus.t_min, opacus.t_max, opacus.size)


def test_prv_is_tighter_than_rdp():
    sigma, q, steps, delta = SETTINGS[0]
    assert compute_epsilon(sigma, q, steps, delta, "prv") < compute_epsilon(sigma, q, steps, delta, "rdp")


def test_epsilon_is_monotone():
    base = compute_epsilon(1.0, 0.01, 500, 1e-5, "rdp")
    assert compute_epsilon(1.0, 0.01, 1000, 1e-5, "rdp") > base  # more steps
    assert compute_epsilon(1.5, 0.01, 500, 1e-5, "rdp") < base  # more noise
    assert compute_epsilon(1.0, 0.02, 500, 1e-5, "rdp") > base  # larger sample rate
    assert compute_epsilon(1.0, 0.01, 500, 1e-7, "rdp") > base  # smaller delta


@pytest.mark.parametrize(
    ("sigma", "q", "steps"),
    [(0.3, 1e-4, 10_000), (20.0, 0.5, 100), (1.0, 1.0, 10)],
)
@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")
def test_prv_handles_the_typical_range_quickly(sigma, q, steps):
    start = time.perf_counter()
    eps = compute_epsilon(sigma, q, steps, 1e-5, "prv")
    elapsed = time.perf_counter() - start
    assert 0 <= eps < compute_epsilon(sigma, q, steps, 1e-5, "rdp")
    assert elapsed < 5.0  # ~0.1-0.9 s measured; a generous bound that still catches pathological grids


# ---------------------------------------------------------------- calibrate_noise_multiplier


@functools.cache
def calibrated(target: float, delta: float, q: float, steps: int, accountant: str) -> float:
    return calibrate_noise_multiplier(target, delta, q, steps, accountant)


@pytest.mark.parametrize(
    ("accountant", "target", "delta", "q", "steps"),
    [
        ("rdp", 1.0, 1e-5, 0.01, 1000),
        ("rdp", 3.0, 1e-6, 0.1, 100),
        ("prv", 1.0, 1e-5, 0.01, 1000),  # a PRV calibration takes 4-6 PRV evaluations (1.5-4 s)
    ],
)
def test_calibration_is_valid_and_tight(accountant, target, delta, q, steps):
    sigma = calibrated(target, delta, q, steps, accountant)
    # Our own accountant certifies the budget exactly, and a 2% smaller sigma would overspend.
    assert compute_epsilon(sigma, q, steps, delta, accountant) <= target
    assert compute_epsilon(0.98 * sigma, q, steps, delta, accountant) > target
    # The independent library agrees that the budget is met, and not with a wildly conservative sigma.
    reference = reference_epsilon(accountant, [(sigma, q, steps)], delta)
    assert 0.97 * target <= reference <= 1.01 * target, (sigma, reference)


@pytest.mark.parametrize(
    "epsilon_of",
    [
        lambda sigma: 2.0 / sigma**2,
        lambda sigma: math.inf if 2.0 / sigma**2 > 50 else 2.0 / sigma**2,  # PRV's grid cannot hold ε > 50
        lambda sigma: 0.05 * math.sqrt(1000) / sigma + 1 / sigma**2,  # ε(σ) of composition, roughly
        lambda sigma: 200 * math.exp(-4 * sigma),
    ],
)
def test_the_sigma_search_meets_the_budget_tightly_in_few_evaluations(epsilon_of):
    """Opacus' bisection takes ~16 ε evaluations (0.2–0.4 s each with PRV); the search must stay within the
    budget, within the tolerance of it, and well under that count."""
    calls = []

    def counted(sigma: float) -> float:
        calls.append(sigma)
        return epsilon_of(sigma)

    target, tolerance = 3.0, 0.005
    sigma = _smallest_sigma(counted, target, tolerance)
    assert target - tolerance <= epsilon_of(sigma) <= target
    assert len(calls) <= 10, calls


def test_the_sigma_search_says_when_no_sigma_meets_the_budget():
    assert _smallest_sigma(lambda sigma: 5.0, 3.0, 0.005) is None


def test_the_sigma_search_stops_where_every_sigma_spends_nothing():
    """δ ≥ q: ε is 0 for every σ, so halving never brackets the target; it stops below 1e-4, within budget."""
    sigma = _smallest_sigma(lambda sigma: 0.0, 3.0, 0.005)
    assert 0 < sigma < 1e-4


def test_prv_calibration_needs_less_noise_than_rdp():
    args = (1.0, 1e-5, 0.01, 1000)
    assert calibrated(*args, "prv") < calibrated(*args, "rdp")


def test_default_accountant_is_prv():
    assert compute_epsilon(1.0, 0.01, 100, 1e-5) == compute_epsilon(1.0, 0.01, 100, 1e-5, "prv")


# ---------------------------------------------------------------- PrivacyAccountant


def test_step_records_history_and_merges_equal_phases():
    accountant = PrivacyAccountant("rdp", 1e-5)
    assert accountant.steps == 0
    assert accountant.history == []
    for _ in range(3):
        accountant.step(1.0, 0.01)
    accountant.step(1.0, 0.01, num_steps=7)
    accountant.step(2.0, 0.02, num_steps=5)
    accountant.step(1.0, 0.01)
    assert accountant.history == [(1.0, 0.01, 10), (2.0, 0.02, 5), (1.0, 0.01, 1)]
    assert accountant.steps == 16


@pytest.mark.parametrize("accountant_name", ACCOUNTANTS)
def test_get_epsilon_equals_compute_epsilon(accountant_name):
    accountant = PrivacyAccountant(accountant_name, 1e-5)
    assert accountant.get_epsilon() == 0.0
    for _ in range(20):
        accountant.step(0.9, 0.01)
    accountant.step(0.9, 0.01, num_steps=480)
    assert accountant.steps == 500
    assert accountant.get_epsilon() == compute_epsilon(0.9, 0.01, 500, 1e-5, accountant_name)


@pytest.mark.parametrize("accountant_name", ACCOUNTANTS)
def test_epsilon_after_does_not_mutate(accountant_name):
    accountant = PrivacyAccountant(accountant_name, 1e-5)
    accountant.step(1.0, 0.01, num_steps=300)
    before = accountant.get_epsilon()
    after = accountant.epsilon_after(1.0, 0.01, extra_steps=200)
    assert accountant.history == [(1.0, 0.01, 300)]
    assert accountant.steps == 300
    assert accountant.get_epsilon() == before
    assert after == compute_epsilon(1.0, 0.01, 500, 1e-5, accountant_name)
    assert after > before
    assert accountant.epsilon_after(1.0, 0.01, extra_steps=0) == before


@pytest.mark.parametrize("accountant_name", ACCOUNTANTS)
def test_state_dict_round_trip(accountant_name):
    accountant = PrivacyAccountant(accountant_name, 1e-6)
    accountant.step(1.0, 0.01, num_steps=200)
    accountant.step(1.5, 0.02, num_steps=100)
    text = json.dumps(accountant.state_dict())

    restored = PrivacyAccountant(accountant_name, 1e-5)
    restored.load_state_dict(json.loads(text))
    assert restored.delta == 1e-6
    assert restored.history == accountant.history
    assert restored.steps == 300
    assert restored.get_epsilon() == accountant.get_epsilon()
    restored.step(1.5, 0.02)  # resuming keeps merging into the last phase
    assert restored.history[-1] == (1.5, 0.02, 101)


@pytest.mark.parametrize("accountant_name", ACCOUNTANTS)
def test_phases_compose(accountant_name):
    phases = [(1.0, 0.01, 300), (0.8, 0.02, 200)]
    accountant = PrivacyAccountant(accountant_name, 1e-5)
    accountant.step(*phases[0][:2], num_steps=phases[0][2])
    first_only = accountant.get_epsilon()
    accountant.step(*phases[1][:2], num_steps=phases[1][2])
    both = accountant.get_epsilon()
    assert both > first_only
    assert both > compute_epsilon(*phases[1], 1e-5, accountant_name)
    assert rel_diff(both, reference_epsilon(accountant_name, phases, 1e-5)) < 0.01


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("accountant_name", ACCOUNTANTS)
def test_zero_noise_is_infinite_and_zero_steps_is_free(accountant_name):
    assert compute_epsilon(0.0, 0.01, 10, 1e-5, accountant_name) == math.inf
    assert compute_epsilon(1.0, 0.01, 0, 1e-5, accountant_name) == 0.0
    assert compute_epsilon(0.0, 0.01, 0, 1e-5, accountant_name) == 0.0
    accountant = PrivacyAccountant(accountant_name, 1e-5)
    accountant.step(1.0, 0.01, num_steps=10)
    assert math.isfinite(accountant.get_epsilon())
    assert accountant.epsilon_after(0.0, 0.01) == math.inf
    accountant.step(0.0, 0.01)
    assert accountant.get_epsilon() == math.inf


# ---------------------------------------------------------------- validation errors

INVALID_CALLS = [
    (lambda: compute_epsilon(1.0, 0.0, 10, 1e-5), r"sample_rate must be in \(0, 1\]"),
    (lambda: compute_epsilon(1.0, 1.5, 10, 1e-5), r"sample_rate must be in \(0, 1\]"),
    (lambda: compute_epsilon(1.0, 0.01, -1, 1e-5), r"steps must be an integer >= 0"),
    (lambda: compute_epsilon(1.0, 0.01, 2.5, 1e-5), r"steps must be an integer >= 0"),
    (lambda: compute_epsilon(1.0, 0.01, 10, 0.0), r"delta must be in \(0, 1\)"),
    (lambda: compute_epsilon(1.0, 0.01, 10, 1.0), r"delta must be in \(0, 1\)"),
    (lambda: compute_epsilon(-0.5, 0.01, 10, 1e-5), r"noise_multiplier must be a finite number >= 0"),
    (lambda: compute_epsilon(math.nan, 0.01, 10, 1e-5), r"noise_multiplier must be a finite number >= 0"),
    (lambda: compute_epsilon(1.0, 0.01, 10, 1e-5, "gdp"), r"accountant must be 'prv' or 'rdp'"),
    (lambda: calibrate_noise_multiplier(0.0, 1e-5, 0.01, 100), r"target_epsilon must be a finite number > 0"),
    (
        lambda: calibrate_noise_multiplier(-1.0, 1e-5, 0.01, 100),
        r"target_epsilon must be a finite number > 0",
    ),
    (lambda: calibrate_noise_multiplier(math.inf, 1e-5, 0.01, 100), r"target_epsilon must be"),
    (lambda: calibrate_noise_multiplier(1.0, 1e-5, 0.01, 0), r"steps must be an integer >= 1"),
    (lambda: calibrate_noise_multiplier(1.0, 1e-5, 0.0, 100), r"sample_rate must be in \(0, 1\]"),
    (lambda: calibrate_noise_multiplier(1.0, 2.0, 0.01, 100), r"delta must be in \(0, 1\)"),
    (lambda: calibrate_noise_multiplier(1.0, 1e-5, 0.01, 100, "gdp"), r"accountant must be 'prv' or 'rdp'"),
    (
        lambda: calibrate_noise_multiplier(1e-4, 1e-5, 0.01, 1000, "rdp"),
        r"budget .* cannot be met .*fewer steps, a smaller sample rate, or a larger target_epsilon",
    ),
    (
        lambda: compute_epsilon(0.3, 0.5, 10_000, 1e-5, "prv"),
        r"PRV accountant cannot handle .*use accountant='rdp'",
    ),
    (lambda: compute_epsilon(1.0, 0.01, 100, 1e-15, "prv"), r"PRV accountant cannot handle .*larger delta"),
    (lambda: PrivacyAccountant("gdp", 1e-5), r"accountant must be 'prv' or 'rdp'"),
    (lambda: PrivacyAccountant("rdp", 0.0), r"delta must be in \(0, 1\)"),
    (
        lambda: PrivacyAccountant("rdp", 1e-5).step(1.0, 0.01, num_steps=0),
        r"num_steps must be an integer >= 1",
    ),
    (lambda: PrivacyAccountant("rdp", 1e-5).step(1.0, 0.0), r"sample_rate must be in \(0, 1\]"),
    (
        lambda: PrivacyAccountant("rdp", 1e-5).step(-1.0, 0.01),
        r"noise_multiplier must be a finite number >= 0",
    ),
    (
        lambda: PrivacyAccountant("rdp", 1e-5).epsilon_after(1.0, 0.01, -1),
        r"extra_steps must be an integer >= 0",
    ),
    (lambda: PrivacyAccountant("rdp", 1e-5).epsilon_after(1.0, 2.0), r"sample_rate must be in \(0, 1\]"),
    (
        lambda: PrivacyAccountant("rdp", 1e-5).load_state_dict(PrivacyAccountant("prv", 1e-5).state_dict()),
        r"state was saved by a 'prv' accountant",
    ),
    (
        lambda: PrivacyAccountant("rdp", 1e-5).load_state_dict({"history": []}),
        r"state must be a dict .* keys",
    ),
    (
        lambda: PrivacyAccountant("rdp", 1e-5).load_state_dict(
            {"accountant": "rdp", "delta": 1e-5, "history": [[1.0, 0.01]]}
        ),
        r"history entries must be \[noise_multiplier, sample_rate, steps\]",
    ),
    (
        lambda: PrivacyAccountant("rdp", 1e-5).load_state_dict(
            {"accountant": "rdp", "delta": 1e-5, "history": [[1.0, 0.01, 0]]}
        ),
        r"history steps must be an integer >= 1",
    ),
]


@pytest.mark.parametrize(("call", "match"), INVALID_CALLS)
def test_invalid_input_raises_one_line_value_error(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_prv_grid_lengths_come_from_a_short_ladder():
    # Each log line asks ε on a grid of a new size; scipy caches the FFT plans of 16 lengths, so a run's grids must
    # share lengths (a new length per call grew the RSS of benchmarks/long_run.py by 192 MB instead of 67).
    sizes = range(2**17, 2**20 + 1, 2**6)  # three octaves: a long run's grids span about one
    assert len({_fft_length(n) for n in sizes}) <= 16
    for n in [16, 18, 30, 34, 1000, 145800, 972000, 2**20]:
        length = _fft_length(n)
        odd_part = length // (length & -length)
        assert n <= length <= 1.25 * n and length % 2 == 0, (n, length)
        assert all(p in (3, 5) for p in _prime_factors(odd_part)), (n, length)  # 5-smooth: a fast FFT


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors
