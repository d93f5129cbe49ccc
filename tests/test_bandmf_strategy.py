"""The BandMF strategy (hf_dp.bandmf) against jax-privacy 2.0.0's toeplitz module and brute-force matrices."""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest
from jax_privacy.matrix_factorization import toeplitz
from scipy.optimize import check_grad

from hf_dp import bandmf


@pytest.fixture(autouse=True, scope="module")
def _jax_float64():
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test optimises afresh into its own on-disk cache, never ~/.cache."""
    monkeypatch.setenv("HF_DP_CACHE", str(tmp_path))
    bandmf._optimize_coefs_cached.cache_clear()
    yield
    bandmf._optimize_coefs_cached.cache_clear()


def _materialize(coefs: np.ndarray, n: int) -> np.ndarray:
    c = np.zeros((n, n))
    for t in range(n):
        for j in range(min(len(coefs), t + 1)):
            c[t, t - j] = coefs[j]
    return c


# (coefs, n): normalised, unnormalised, negative entries, as many bands as steps, more coefficients than steps;
# the n and band counts of the first three are those of the optimiser test, so jax compiles its loss once for both
CASES = [
    (bandmf.closed_form_coefs(4), 64),
    (3.7 * bandmf.closed_form_coefs(8), 256),
    (np.concatenate([[2.0, -0.5, 0.3, 0.25, -0.1], 0.02 * (-1.0) ** np.arange(11)]), 1000),
    (np.array([0.6, 0.5, 0.4, 0.3]), 4),
    (np.array([1.5, 0.7, 0.2, 0.1, 0.05, 0.01]), 4),
]


@pytest.mark.parametrize("bands", [1, 3, 64])
def test_closed_form_matches_jax_privacy(bands):
    ours = bandmf.closed_form_coefs(bands)
    theirs = np.asarray(toeplitz.optimal_max_error_strategy_coefs(bands), dtype=np.float64)
    np.testing.assert_allclose(ours, theirs / np.linalg.norm(theirs), rtol=1e-12, atol=0)
    assert ours[0] > 0 and np.isclose(ours @ ours, 1.0, rtol=1e-14)


@pytest.mark.parametrize(("coefs", "n"), CASES)
def test_inverse_and_errors_match_jax_privacy(coefs, n):
    np.testing.assert_allclose(
        bandmf.inverse_coefs(coefs, n), np.asarray(toeplitz.inverse_coef(coefs, n)), rtol=1e-10, atol=1e-13
    )
    # jax_privacy's per_query_error is for C as given (no sensitivity); its loss multiplies by ‖c[:n]‖², the
    # largest column norm², as our per_step_error does
    theirs = np.asarray(toeplitz.per_query_error(strategy_coef=coefs, n=n)) * float(
        toeplitz.sensitivity_squared(coefs, n)
    )
    np.testing.assert_allclose(bandmf.per_step_error(coefs, n), theirs, rtol=1e-10, atol=0)
    np.testing.assert_allclose(
        bandmf.mean_error(coefs, n), float(toeplitz.loss(coefs, n)), rtol=1e-10, atol=0
    )


@pytest.mark.parametrize(("coefs", "n"), CASES)
def test_column_norms(coefs, n):
    m = min(n, 300)  # brute force on a leading block: C's top-left m×m block is the m-step C
    np.testing.assert_allclose(
        bandmf.column_norms(coefs, m), np.linalg.norm(_materialize(coefs, m), axis=0), rtol=1e-13, atol=0
    )
    normalised = coefs / np.linalg.norm(coefs[:n])
    norms = bandmf.column_norms(normalised, n)
    assert norms.shape == (n,)
    assert np.all(norms <= 1 + 1e-12)
    assert norms.max() == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize(("coefs", "n"), [c for c in CASES if c[1] <= 256])
def test_per_step_error_brute_force(coefs, n):
    c = _materialize(coefs, n)
    noise_of_prefix_sums = np.tril(np.ones((n, n))) @ np.linalg.inv(c)
    sensitivity_sq = np.max(np.sum(c**2, axis=0))
    np.testing.assert_allclose(
        bandmf.per_step_error(coefs, n), sensitivity_sq * np.sum(noise_of_prefix_sums**2, axis=1), rtol=1e-10
    )
    np.testing.assert_allclose(bandmf.inverse_coefs(coefs, n), np.linalg.inv(c)[:, 0], rtol=1e-10, atol=1e-13)


def test_gradient_matches_finite_differences():
    n = 300
    weights = (n - np.arange(n)) / n
    theta = np.array([0.4, 0.3, -0.1, 0.05])
    err = check_grad(
        lambda t: bandmf._log_loss_and_grad(t, n, weights)[0],
        lambda t: bandmf._log_loss_and_grad(t, n, weights)[1],
        theta,
    )
    assert err < 1e-5


@pytest.mark.parametrize(("n", "bands"), [(64, 4), (1000, 16)])  # jax compiles for each: ~3 s a case
def test_optimize_matches_jax_privacy(n, bands):
    ours = bandmf.optimize_coefs(n, bands)
    assert ours.shape == (bands,) and ours[0] > 0
    assert ours @ ours == pytest.approx(1.0, rel=1e-12)
    ours_error = float(toeplitz.loss(ours, n))  # judged by jax_privacy's own loss
    theirs_error = float(toeplitz.loss(toeplitz.optimize_banded_toeplitz(n, bands), n))
    assert ours_error <= theirs_error * 1.005, (ours_error, theirs_error)
    assert ours_error < float(toeplitz.loss(bandmf.closed_form_coefs(bands), n))
    strategy = bandmf.banded_strategy(n, bands)
    assert strategy.source == "optimized"
    assert strategy.coefs == tuple(ours)


def test_optimize_is_fast():
    start = time.perf_counter()
    c = bandmf.optimize_coefs(5000, 64)
    assert time.perf_counter() - start < 10.0
    assert bandmf.mean_error(c, 5000) < bandmf.mean_error(bandmf.closed_form_coefs(64), 5000)


def test_one_band_is_dp_sgd():
    n = 50
    strategy = bandmf.banded_strategy(n, 1)
    assert strategy.coefs == (1.0,)
    assert strategy.bands == 1
    np.testing.assert_array_equal(strategy.per_step_error(), np.arange(1, n + 1, dtype=np.float64))
    assert strategy.mean_error() == (n + 1) / 2
    np.testing.assert_array_equal(strategy.column_norms(), np.ones(n))
    np.testing.assert_array_equal(bandmf.optimize_coefs(n, 1), [1.0])


@pytest.mark.parametrize(("num_steps", "bands"), [(10, 0), (10, 11), (1, 2)])
def test_refuses_bad_bands(num_steps, bands):
    with pytest.raises(ValueError, match="bands") as info:
        bandmf.banded_strategy(num_steps, bands)
    assert "\n" not in str(info.value)


def test_falls_back_to_closed_form(monkeypatch):
    def broken(n, bands, start):
        raise RuntimeError("diverged")

    monkeypatch.setattr(bandmf, "_run_optimizer", broken)
    strategy = bandmf.banded_strategy(100, 4)
    assert strategy.source == "closed_form"
    np.testing.assert_allclose(strategy.coefs, bandmf.closed_form_coefs(4), rtol=0, atol=0)

    bandmf._optimize_coefs_cached.cache_clear()
    monkeypatch.setattr(
        bandmf, "_run_optimizer", lambda n, bands, start: np.array([0.1, 0.0, 0.0, np.sqrt(0.99)])
    )
    assert bandmf.banded_strategy(100, 4).source == "closed_form"  # worse than the closed form


def test_disk_cache(tmp_path, monkeypatch):
    calls = []
    real = bandmf._run_optimizer

    def counting(n, bands, start):
        calls.append((n, bands))
        return real(n, bands, start)

    monkeypatch.setattr(bandmf, "_run_optimizer", counting)
    path = tmp_path / "bandmf" / "n300_b8.json"
    first = bandmf.optimize_coefs(300, 8)
    assert path.is_file() and len(calls) == 1
    assert json.loads(path.read_text())["coefs"] == first.tolist()

    bandmf._optimize_coefs_cached.cache_clear()  # a new process: reads the file
    np.testing.assert_array_equal(bandmf.optimize_coefs(300, 8), first)
    assert len(calls) == 1

    for corrupt in ["{not json", json.dumps({"version": 1, "n": 300, "bands": 8, "coefs": [1.0]})]:
        path.write_text(corrupt)
        bandmf._optimize_coefs_cached.cache_clear()
        np.testing.assert_array_equal(bandmf.optimize_coefs(300, 8), first)
        assert json.loads(path.read_text())["coefs"] == first.tolist()  # rewritten
    assert len(calls) == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["n300_b8.json"]  # no temp files left

    path.unlink()  # the in-process cache answers without the file
    np.testing.assert_array_equal(bandmf.optimize_coefs(300, 8), first)
    assert len(calls) == 3


def test_choose_bands_picks_the_argmin():
    n = 128
    errors = {b: bandmf.banded_strategy(n, b).mean_error() for b in (1, 2, 4, 8, 16, 32, 64)}
    # σ_b² · error_b is 1 at b = 4 and 2 elsewhere
    assert bandmf.choose_bands(n, 1000, lambda b: np.sqrt((1.0 if b == 4 else 2.0) / errors[b])) == 4
    # a tie (all zero) goes to the smallest b; an impossible calibration (inf) is never chosen
    assert bandmf.choose_bands(n, 1000, lambda b: 0.0) == 1
    assert bandmf.choose_bands(n, 1000, lambda b: np.inf if b < 64 else 5.0) == 64
    assert bandmf.choose_bands(n, 1000, lambda b: 1.0, candidates=[3, 5]) == 5


def test_choose_bands_respects_max_bands():
    asked = []

    def sigma(b):  # the same σ for every b: more bands always cancel more noise
        asked.append(b)
        return 1.0

    assert bandmf.choose_bands(128, 8, sigma) == 8
    assert asked == [1, 2, 4, 8]
    assert bandmf.choose_bands(128, 20, sigma) == 16
    assert bandmf.choose_bands(128, 10**6, sigma) == 64  # at most 64 by default
    assert bandmf.choose_bands(10, 10**6, sigma) == 8  # at most num_steps
    assert bandmf.choose_bands(128, 12, sigma, candidates=[3, 12, 13, 100]) == 12
    with pytest.raises(ValueError, match="max_bands"):
        bandmf.choose_bands(128, 0, sigma)
