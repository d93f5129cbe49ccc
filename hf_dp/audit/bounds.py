"""From canary scores to ε lower bounds: the statistics of an audit, with no training in them.

A mechanism that is (ε, δ)-DP satisfies Pr[S | D'] ≤ e^ε Pr[S | D] + δ for every event S, in both directions
(D ↔ D'). The threshold test takes S = {score > t}: with true/false positive rates TPR and FPR,
ε ≥ log((TPR − δ)/FPR). Trials are split in two: the event (threshold, direction and δ) is chosen on one half,
and Clopper–Pearson intervals on the other half turn the counts into a bound that holds with the stated
confidence (Jagielski, Ullman, Oprea 2020; Nasr et al. 2021). The Gaussian-DP fit reads μ = Φ⁻¹(TPR) − Φ⁻¹(FPR)
off the same kind of event (Dong, Roth, Su 2022; Nasr et al. 2023). The one-run bound counts correct guesses
among m canaries, each included with probability ½ (Steinke, Nasr, Jagielski 2023, Theorem 5.2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import ndtr
from scipy.stats import beta, binom, norm

# δ at which a claim is tested: the run's own δ and larger ones, where a threshold test with a few thousand
# trials has power (the accountant claims ε(δ) for every δ, so each is a valid place to look for a violation).
AUDIT_DELTAS = (1e-5, 1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.2)
MAX_THRESHOLDS = 200


@dataclass(frozen=True)
class ThresholdEvent:
    """S = {direction · score > threshold}, read as evidence that the trial ran on ``positive_world``."""

    threshold: float
    direction: int  # +1 or −1
    positive_world: str  # "with" (the canary's world) or "without"
    delta: float


@dataclass(frozen=True)
class ThresholdBound:
    """The bound at one event, evaluated on held-out trials."""

    epsilon: float  # the lower bound: the mechanism is NOT (epsilon', delta)-DP for any epsilon' < epsilon
    delta: float
    claimed_epsilon: float  # what the accountant claims at this δ
    confidence: float
    true_positives: int
    false_positives: int
    trials_per_world: int
    event: ThresholdEvent

    @property
    def exceeds_claim(self) -> bool:
        return self.epsilon > self.claimed_epsilon

    def as_dict(self) -> dict:
        return {**asdict(self), "exceeds_claim": self.exceeds_claim}


def clopper_pearson(successes: np.ndarray | int, trials: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided (1 − alpha) Clopper–Pearson lower and upper limits of a binomial rate (each distinct count's
    beta quantiles computed once)."""
    counts = np.asarray(successes, dtype=float)
    k, inverse = np.unique(counts, return_inverse=True)
    low = np.where(k > 0, beta.ppf(alpha, np.maximum(k, 1), trials - k + 1), 0.0)
    high = np.where(k < trials, beta.ppf(1 - alpha, k + 1, np.maximum(trials - k, 1)), 1.0)
    return low[inverse].reshape(counts.shape), high[inverse].reshape(counts.shape)


def _candidate_thresholds(*scores: np.ndarray) -> np.ndarray:
    pooled = np.unique(np.concatenate(scores))
    if len(pooled) > MAX_THRESHOLDS:
        pooled = np.unique(np.quantile(pooled, np.linspace(0, 1, MAX_THRESHOLDS)))
    midpoints = (pooled[1:] + pooled[:-1]) / 2 if len(pooled) > 1 else pooled
    return np.concatenate([[pooled[0] - 1.0], midpoints])


def _event_rates(without: np.ndarray, with_canary: np.ndarray, thresholds: np.ndarray, direction: int):
    """Counts of {direction · score > direction · t} per threshold t, in each world."""
    out_hits = (direction * without[None, :] > direction * thresholds[:, None]).sum(axis=1)
    in_hits = (direction * with_canary[None, :] > direction * thresholds[:, None]).sum(axis=1)
    return out_hits, in_hits


def _limits(positive_hits, negative_hits, n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """TPR_low and FPR_high, each at one-sided level alpha/2."""
    tpr_low, _ = clopper_pearson(positive_hits, n, alpha / 2)
    _, fpr_high = clopper_pearson(negative_hits, n, alpha / 2)
    return tpr_low, fpr_high


def _bound(tpr_low: np.ndarray, fpr_high: np.ndarray, delta: float) -> np.ndarray:
    """ε ≥ log((TPR_low − δ) / FPR_high); 0 where nothing is shown."""
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.log((tpr_low - delta) / fpr_high)
    return np.where(tpr_low > delta, np.maximum(eps, 0.0), 0.0)


def _orientations(without, with_canary, thresholds):
    """(direction, positive world, positive-world hits, negative-world hits) for the four kinds of event."""
    for direction in (1, -1):
        out_hits, in_hits = _event_rates(without, with_canary, thresholds, direction)
        yield direction, "with", in_hits, out_hits
        yield direction, "without", out_hits, in_hits


def choose_event(
    without: np.ndarray,
    with_canary: np.ndarray,
    claimed: Callable[[float], float],
    deltas: Sequence[float],
    confidence: float,
) -> ThresholdEvent:
    """The event whose bound most exceeds the claim on these (selection) trials."""
    n = min(len(without), len(with_canary))
    without, with_canary = without[:n], with_canary[:n]
    thresholds = _candidate_thresholds(without, with_canary)
    claims = {delta: claimed(delta) for delta in deltas}
    best, best_margin = None, -math.inf
    for direction, positive_world, pos_hits, neg_hits in _orientations(without, with_canary, thresholds):
        tpr_low, fpr_high = _limits(pos_hits, neg_hits, n, 1 - confidence)
        for delta in deltas:
            margins = _bound(tpr_low, fpr_high, delta) - claims[delta]
            i = int(np.argmax(margins))
            if margins[i] > best_margin:
                best_margin = float(margins[i])
                best = ThresholdEvent(float(thresholds[i]), direction, positive_world, float(delta))
    return best


def evaluate_event(
    event: ThresholdEvent,
    without: np.ndarray,
    with_canary: np.ndarray,
    claimed: Callable[[float], float],
    confidence: float,
) -> ThresholdBound:
    n = min(len(without), len(with_canary))
    without, with_canary = without[:n], with_canary[:n]
    out_hits, in_hits = _event_rates(without, with_canary, np.array([event.threshold]), event.direction)
    pos, neg = (in_hits, out_hits) if event.positive_world == "with" else (out_hits, in_hits)
    epsilon = float(_bound(*_limits(pos, neg, n, 1 - confidence), event.delta)[0])
    return ThresholdBound(
        epsilon=epsilon,
        delta=event.delta,
        claimed_epsilon=float(claimed(event.delta)),
        confidence=confidence,
        true_positives=int(pos[0]),
        false_positives=int(neg[0]),
        trials_per_world=n,
        event=event,
    )


def threshold_audit(
    without: np.ndarray,
    with_canary: np.ndarray,
    claimed: Callable[[float], float],
    deltas: Sequence[float] = AUDIT_DELTAS,
    confidence: float = 0.95,
) -> ThresholdBound:
    """The threshold test: the event chosen on the first half of each world's trials, bounded on the second."""
    without, with_canary = np.asarray(without, float), np.asarray(with_canary, float)
    half_out, half_in = len(without) // 2, len(with_canary) // 2
    event = choose_event(without[:half_out], with_canary[:half_in], claimed, deltas, confidence)
    return evaluate_event(event, without[half_out:], with_canary[half_in:], claimed, confidence)


@dataclass(frozen=True)
class GaussianFit:
    """μ of the Gaussian trade-off curve G_μ through the held-out rates at the chosen threshold."""

    mu: float  # point estimate
    mu_lower: float  # at the stated confidence
    epsilon_lower: float  # ε(δ) of G_{mu_lower}: a lower bound when the step is a Gaussian mechanism (q = 1)
    delta: float


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of μ-GDP: the ε solving Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) = δ (Dong, Roth, Su 2022, Cor. 2.13)."""
    if mu <= 0:
        return 0.0

    def gap(eps: float) -> float:
        return float(ndtr(-eps / mu + mu / 2) - math.exp(eps) * ndtr(-eps / mu - mu / 2)) - delta  # Φ = ndtr

    if gap(0.0) <= 0:
        return 0.0
    high = 1.0
    while gap(high) > 0:
        high *= 2
    return float(brentq(gap, 0.0, high))


def gaussian_fit(
    without: np.ndarray, with_canary: np.ndarray, delta: float, confidence: float = 0.95
) -> GaussianFit:
    """Threshold chosen on the first halves (largest μ lower limit), μ read off the second halves."""
    without, with_canary = np.asarray(without, float), np.asarray(with_canary, float)
    alpha = 1 - confidence

    def mu_limits(out, inn, thresholds, direction, positive):
        out_hits, in_hits = _event_rates(out, inn, thresholds, direction)
        pos, neg = (in_hits, out_hits) if positive == "with" else (out_hits, in_hits)
        n = min(len(out), len(inn))
        tpr_low, _ = clopper_pearson(pos, n, alpha / 2)
        _, fpr_high = clopper_pearson(neg, n, alpha / 2)
        eps = 0.5 / n  # keeps Φ⁻¹ finite at empirical rates of 0 or 1
        point = norm.ppf(np.clip(pos / n, eps, 1 - eps)) - norm.ppf(np.clip(neg / n, eps, 1 - eps))
        return np.nan_to_num(norm.ppf(tpr_low) - norm.ppf(fpr_high), neginf=-math.inf), point

    half_out, half_in = len(without) // 2, len(with_canary) // 2
    select_out, select_in = without[:half_out], with_canary[:half_in]
    test_out, test_in = without[half_out:], with_canary[half_in:]
    thresholds = _candidate_thresholds(select_out, select_in)
    best = (-math.inf, 0.0, 1, "with")
    for direction in (1, -1):
        for positive in ("with", "without"):
            lower, _ = mu_limits(select_out, select_in, thresholds, direction, positive)
            i = int(np.argmax(lower))
            if lower[i] > best[0]:
                best = (float(lower[i]), float(thresholds[i]), direction, positive)
    _, threshold, direction, positive = best
    lower, point = mu_limits(test_out, test_in, np.array([threshold]), direction, positive)
    mu_lower = max(float(lower[0]), 0.0)
    return GaussianFit(float(point[0]), mu_lower, gaussian_epsilon(mu_lower, delta), delta)


def simulate_ideal_step(
    noise_multiplier: float,
    sample_rate: float,
    trials: int,
    claimed: Callable[[float], float],
    deltas: Sequence[float] = AUDIT_DELTAS,
    confidence: float = 0.95,
    repeats: int = 20,
    seed: int = 0,
) -> float:
    """The median bound an exact implementation gives with this many trials: scores in units of the clipped
    canary, N(0, σ²) without it and Bernoulli(q) + N(0, σ²) with it."""
    rng = np.random.default_rng(seed)
    bounds = []
    for _ in range(repeats):
        without = noise_multiplier * rng.standard_normal(trials)
        with_canary = (rng.random(trials) < sample_rate) + noise_multiplier * rng.standard_normal(trials)
        bounds.append(threshold_audit(without, with_canary, claimed, deltas, confidence).epsilon)
    return float(np.median(bounds))


# ---- one run (Steinke, Nasr, Jagielski 2023) ------------------------------------------------------------------


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Pr[≥ correct right guesses out of ``guesses``] under (ε, δ)-DP, each of ``canaries`` canaries included with
    probability ½: P[Bin(r, p) ≥ v] + 2mδ · max_i P[v − i ≤ Bin(r, p) < v] / i, p = e^ε/(1 + e^ε) (Theorem 5.2)."""
    p = 1 / (1 + math.exp(-epsilon))
    tail = binom.sf(correct - 1, guesses, p)
    if delta == 0 or correct == 0:
        return float(min(tail, 1.0))
    below = binom.pmf(np.arange(correct - 1, -1, -1), guesses, p).cumsum()  # i = 1..v: P[v − i ≤ Bin < v]
    slack = float(np.max(below / np.arange(1, correct + 1)))
    return float(min(tail + 2 * canaries * delta * slack, 1.0))


def one_run_epsilon(
    canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest ε whose p-value of ``correct`` right guesses is below 1 − confidence (0 if none)."""
    alpha = 1 - confidence
    if guesses == 0 or one_run_p_value(canaries, guesses, correct, 0.0, delta) >= alpha:
        return 0.0
    high = 1.0
    while one_run_p_value(canaries, guesses, correct, high, delta) < alpha:
        high *= 2
        if high > 1e3:
            return math.inf
    return float(
        brentq(lambda eps: one_run_p_value(canaries, guesses, correct, eps, delta) - alpha, 0.0, high)
    )


@dataclass(frozen=True)
class OneRunBound:
    epsilon: float
    delta: float
    claimed_epsilon: float
    confidence: float
    canaries: int
    guesses: int
    correct: int

    @property
    def exceeds_claim(self) -> bool:
        return self.epsilon > self.claimed_epsilon

    def as_dict(self) -> dict:
        return {**asdict(self), "exceeds_claim": self.exceeds_claim}


GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5)


def one_run_audit(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    claimed_epsilon: float,
    confidence: float = 0.95,
    guess_fractions: Sequence[float] = GUESS_FRACTIONS,
) -> OneRunBound:
    """Guess "in" for the k highest scores and "out" for the k lowest, for each k = fraction·m/2 (Bonferroni over
    the fractions), and keep the largest bound."""
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    m = len(scores)
    order = np.argsort(scores)
    level = 1 - (1 - confidence) / len(guess_fractions)
    best = OneRunBound(0.0, delta, claimed_epsilon, confidence, m, 0, 0)
    for fraction in guess_fractions:
        k = max(1, int(fraction * m / 2))
        correct = int(included[order[-k:]].sum() + (~included[order[:k]]).sum())
        epsilon = one_run_epsilon(m, 2 * k, correct, delta, level)
        if epsilon > best.epsilon:
            best = OneRunBound(epsilon, delta, claimed_epsilon, confidence, m, 2 * k, correct)
    return best


def simulate_ideal_one_run(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    canaries: int,
    delta: float,
    claimed_epsilon: float,
    confidence: float = 0.95,
    repeats: int = 20,
    seed: int = 0,
    sum_noise_std: float | None = None,
) -> float:
    """The median one-run bound of an exact DP-SGD run: a canary's score is the number of steps that drew it plus
    N(0, Tσ²) (scores in units of the clipped canary). ``steps``: the steps that may draw a canary; correlated noise
    gives its summed noise's std as ``sum_noise_std`` (σ√T for independent noise)."""
    rng = np.random.default_rng(seed)
    noise = noise_multiplier * math.sqrt(steps) if sum_noise_std is None else sum_noise_std
    bounds = []
    for _ in range(repeats):
        included = rng.random(canaries) < 0.5
        draws = rng.binomial(steps, sample_rate, canaries) * included
        scores = draws + noise * rng.standard_normal(canaries)
        bounds.append(one_run_audit(scores, included, delta, claimed_epsilon, confidence).epsilon)
    return float(np.median(bounds))
