"""hf_dp.audit: its statistics against independent references, and its teeth on the real step.

The step audit runs the trainer's own step on D and on D + one canary many times and must (a) stay below the
reported ε for every update rule, clipping mode, sampling scheme and accumulation, and (b) exceed it when a bug is
injected: noise removed, clipping skipped, noise halved, the canary always sampled while q < 1 is claimed. The
one-run audit must stay below on a real run and exceed the claim without noise. The bounds are checked against
scipy's exact binomial intervals, dp_accounting's Gaussian ε(δ), and Monte-Carlo mechanisms whose true ε is known.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import binomtest
from torch import nn
from torch.utils.data import Dataset

from hf_dp import DPTrainer
from hf_dp.accounting import compute_epsilon
from hf_dp.audit import audit_one_run, audit_step, bounds
from hf_dp.audit.faults import fault
from hf_dp.optim.registry import dp_optimizer_names
from tests.ports import free_port
from tests.trainer_utils import make_args

REPO = Path(__file__).resolve().parents[1]
SIGMA, CLIP, DELTA = 1.0, 1.0, 1e-5


# ---- the statistics -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("k,n", [(0, 50), (1, 50), (17, 50), (49, 50), (50, 50), (3, 1000), (731, 1000)])
def test_clopper_pearson_matches_scipys_exact_interval(k, n):
    """One-sided limits at level α/2 each are scipy's two-sided exact interval at level α."""
    low, high = bounds.clopper_pearson(k, n, 0.025)
    reference = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    assert float(low) == pytest.approx(reference.low, abs=1e-12)
    assert float(high) == pytest.approx(reference.high, abs=1e-12)


@pytest.mark.parametrize("mu,delta", [(0.5, 1e-5), (1.0, 1e-3), (2.0, 1e-5), (3.0, 0.1)])
def test_gaussian_dp_epsilon_matches_dp_accounting(mu, delta):
    """μ-GDP is the Gaussian mechanism with σ = 1/μ (sensitivity 1): its ε(δ) from dp_accounting's PLD."""
    from dp_accounting import GaussianDpEvent
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant(value_discretization_interval=1e-4)  # within 1e-8 of 1e-5's ε here, 10x faster
    accountant.compose(GaussianDpEvent(1 / mu))
    assert bounds.gaussian_epsilon(mu, delta) == pytest.approx(accountant.get_epsilon(delta), abs=2e-3)


def test_threshold_bound_is_valid_and_has_power_on_an_exact_gaussian_mechanism():
    """Scores N(0, 1) against N(μ, 1), claimed ε(δ) the mechanism's true one: the bound must exceed the truth
    in at most ~5% of repeated audits (95% confidence), and must exceed a claim half as large."""
    rng = np.random.default_rng(0)
    mu, trials, repeats = 2.0, 1000, 100
    true_eps = lambda delta: bounds.gaussian_epsilon(mu, delta)  # noqa: E731
    exceed, powered = 0, 0
    for _ in range(repeats):
        without, with_canary = rng.standard_normal(trials), mu + rng.standard_normal(trials)
        exceed += bounds.threshold_audit(without, with_canary, true_eps).exceeds_claim
        half = lambda delta: true_eps(delta) / 2  # noqa: E731
        powered += bounds.threshold_audit(without, with_canary, half).exceeds_claim
    assert exceed <= 10, exceed  # binomial(100, ≤ 0.05): ≤ 10 with probability > 0.99
    assert powered >= 80, powered


def test_one_run_bound_is_valid_on_randomized_response():
    """Each canary's guess is right with probability e^ε/(1 + e^ε), the worst case of ε-DP: the bound at
    δ = 0 must exceed ε in at most ~5% of repeats, and come close to it with many guesses."""
    rng = np.random.default_rng(1)
    epsilon, guesses, repeats = 1.0, 1000, 200
    found = [
        bounds.one_run_epsilon(
            guesses, guesses, int(rng.binomial(guesses, 1 / (1 + math.exp(-epsilon)))), 0.0
        )
        for _ in range(repeats)
    ]
    assert sum(f > epsilon for f in found) <= 20  # binomial(200, ≤ 0.05): ≤ 20 with probability > 0.99
    assert np.median(found) > 0.8 * epsilon


def test_one_run_p_value_with_delta_matches_a_direct_sum():
    """Theorem 5.2's δ term: 2mδ · max_i P[v − i ≤ Bin(r, p) < v] / i, against a loop over i."""
    from scipy.stats import binom

    m, r, v, eps, delta = 500, 120, 80, 0.5, 1e-4
    p = 1 / (1 + math.exp(-eps))
    slack = max(sum(binom.pmf(j, r, p) for j in range(v - i, v)) / i for i in range(1, v + 1))
    direct = binom.sf(v - 1, r, p) + 2 * m * delta * slack
    assert bounds.one_run_p_value(m, r, v, eps, delta) == pytest.approx(direct, rel=1e-9)


# ---- the step audit on a tiny model ------------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Rows(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.labels = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.labels[i]}


class CrossEntropyTrainer(DPTrainer):
    def compute_per_example_loss(self, model, inputs):
        return nn.functional.cross_entropy(model(inputs["x"]), inputs["labels"], reduction="none")


def run_step_audit(tmp_path, n: int = 16, trials: int = 1000, **overrides):
    args = make_args(
        tmp_path,
        **{
            "noise_multiplier": SIGMA,
            "per_sample_max_grad_norm": CLIP,
            "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 2,  # B̄ = 16
            "learning_rate": 0.1,
            "target_delta": DELTA,
            "insecure_dp_seed": 3,
            **overrides,
        },
    )
    return audit_step(args, Tiny, Rows(n), trials=trials, trainer_class=CrossEntropyTrainer)


def test_the_real_step_stays_below_and_its_scores_are_what_the_step_releases(tmp_path):
    result = run_step_audit(tmp_path, trials=1000)
    assert not result.flagged, str(result)
    assert result.threshold.epsilon <= result.threshold.claimed_epsilon
    assert result.world_size == 1 and result.backend == "single"
    # scores = update / lr: pure noise σC/B̄ without the canary; with it, +C/B̄ whenever it is drawn (q = 16/17)
    batch = result.expected_batch_size
    assert result.sample_rate == pytest.approx(16 / 17)
    assert result.scores_without.std() == pytest.approx(SIGMA * CLIP / batch, rel=0.1)
    stderr = SIGMA * CLIP / batch / math.sqrt(result.trials)
    assert abs(result.scores_with.mean() - result.sample_rate * CLIP / batch) < 5 * stderr
    assert abs(result.scores_without.mean()) < 5 * stderr
    assert result.ideal_epsilon <= result.threshold.claimed_epsilon
    assert result.run_epsilon > 0
    assert "note:" not in str(result)  # q ≈ 1: the audit has power, no hint
    powerless = dataclasses.replace(result, sample_rate=0.001, ideal_epsilon=0.0)
    assert f"rerun with --num_examples {batch} (q ≈ 1)" in str(powerless)
    too_few_trials = dataclasses.replace(result, ideal_epsilon=0.0)
    assert "raise --trials" in str(too_few_trials) and "--num_examples" not in str(too_few_trials)


def test_the_audit_catches_a_step_without_noise(tmp_path, monkeypatch):
    monkeypatch.setattr(*fault("no_noise"))
    result = run_step_audit(tmp_path, trials=200)
    assert result.flagged, str(result)


def test_the_audit_catches_a_step_that_skips_clipping(tmp_path, monkeypatch):
    monkeypatch.setattr(*fault("no_clipping"))
    result = run_step_audit(tmp_path, trials=200)
    assert result.flagged, str(result)


def test_the_audit_catches_halved_noise(tmp_path, monkeypatch):
    monkeypatch.setattr(*fault("half_noise"))
    result = run_step_audit(tmp_path, trials=2000)
    assert result.flagged, str(result)


def test_the_audit_catches_a_canary_sampled_every_step_while_q_below_1_is_claimed(tmp_path, monkeypatch):
    monkeypatch.setattr(*fault("always_sampled"))
    result = run_step_audit(tmp_path, n=32, trials=2000)
    assert result.sample_rate < 0.5
    assert result.flagged, str(result)


# sgd and disk (two evaluations per step) in the default run; the sweep over the other rules is a benchmark
# (pytest -m benchmark; benchmarks/audit_table.py writes the same audit for every rule)
@pytest.mark.parametrize(
    "optimizer",
    [
        name if name in ("sgd", "disk") else pytest.param(name, marks=pytest.mark.benchmark)
        for name in dp_optimizer_names()
    ],
)
def test_every_update_rule_stays_below_its_reported_epsilon(tmp_path, optimizer):
    result = run_step_audit(tmp_path, trials=1000, dp_optimizer=optimizer)
    assert result.optimizer == optimizer
    assert not result.flagged, str(result)


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param({"clipping_mode": "per_sample"}, marks=pytest.mark.benchmark),
        pytest.param({"poisson_sampling": False}, marks=pytest.mark.benchmark),
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4},
    ],
    ids=["per_sample", "fixed_batches", "accumulation_4"],
)
def test_clipping_modes_sampling_and_accumulation_stay_below_and_are_caught_without_noise(
    tmp_path, monkeypatch, setting
):
    result = run_step_audit(tmp_path, trials=600, **setting)
    assert not result.flagged, str(result)
    monkeypatch.setattr(*fault("no_noise"))
    assert run_step_audit(tmp_path, trials=200, **setting).flagged


# ---- the one-run audit ------------------------------------------------------------------------------------


def run_one_run_audit(tmp_path, **overrides):
    args = make_args(
        tmp_path,
        **overrides,
        noise_multiplier=2.0,  # the run reports ε ≈ 1.8: 300 canaries can show up to ≈ 3.4
        per_sample_max_grad_norm=CLIP,
        per_device_train_batch_size=32,
        gradient_accumulation_steps=1,
        learning_rate=0.1,
        target_delta=DELTA,
        insecure_dp_seed=5,
        max_steps=20,
    )
    return audit_one_run(args, Tiny, Rows(64), canaries=300, trainer_class=CrossEntropyTrainer, seed=0)


def test_one_run_audit_stays_below_a_real_run_and_catches_one_without_noise(tmp_path, monkeypatch):
    real = run_one_run_audit(tmp_path)
    assert real.steps == 20 and real.bound.claimed_epsilon > 0
    assert not real.flagged, str(real)
    # included canaries were drawn ~T·q times each, excluded ones never: their scores must say so on average
    assert real.scores[real.included].mean() > real.scores[~real.included].mean()
    monkeypatch.setattr(*fault("no_noise"))
    leaky = run_one_run_audit(tmp_path)
    assert leaky.flagged, str(leaky)


def test_the_one_run_audit_spans_a_bandmf_run_and_catches_unnormalised_columns(tmp_path, monkeypatch):
    """Correlated noise (2 bands, cyclic Poisson): the whole run stays below the amplified BandMF claim (⌈20/2⌉ steps
    at p = 2B̄/N); a strategy whose columns were not normalised (noise 10× too small) is flagged. The step audit
    refuses it in one line: one step is not the mechanism."""
    bandmf = {"noise_mechanism": "bandmf", "num_bands": "2"}
    real = run_one_run_audit(tmp_path, **bandmf)
    assert real.steps == 20 and real.sample_rate == pytest.approx(2 * 32 / (64 + real.included.sum()))
    assert real.bound.claimed_epsilon == pytest.approx(
        compute_epsilon(2.0, real.sample_rate, 10, DELTA, "prv")
    )
    assert not real.flagged, str(real)
    assert real.scores[real.included].mean() > real.scores[~real.included].mean()
    monkeypatch.setattr(*fault("bandmf_unnormalised"))
    broken = run_one_run_audit(tmp_path, **bandmf)
    assert broken.flagged, str(broken)
    with pytest.raises(ValueError, match="audit the whole run with audit_one_run"):
        run_step_audit(tmp_path, **bandmf)


# ---- the command line --------------------------------------------------------------------------------------


def test_the_command_line_audits_a_model_family_and_writes_the_report(tmp_path):
    from hf_dp.audit.__main__ import main

    audit_dir = tmp_path / "audit"
    main(
        [
            "--model_type", "gpt2", "--audit", "both", "--trials", "150", "--canaries", "100",
            "--num_examples", "64", "--output_dir", str(tmp_path / "out"), "--audit_dir", str(audit_dir),
            "--noise_multiplier", "1.0", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
            "--max_steps", "20", "--dp_optimizer", "adamw", "--use_cpu", "--report_to", "none",
        ]
    )  # fmt: skip
    report = json.loads((audit_dir / "audit.json").read_text())
    assert report["step"]["optimizer"] == "adamw" and report["step"]["trials_per_world"] == 150
    assert not report["step"]["flagged"] and not report["one_run"]["flagged"]
    assert report["one_run"]["canaries"] == 100 and report["one_run"]["steps"] == 20
    assert (audit_dir / "scores.png").read_bytes()[:4] == b"\x89PNG"


def test_the_command_line_refuses_an_unknown_audit_in_one_line(tmp_path):
    from hf_dp.audit.__main__ import main

    with pytest.raises(ValueError, match="--audit must be step, one-run or both"):
        main(["--model_type", "gpt2", "--audit", "three", "--output_dir", str(tmp_path)])


@pytest.mark.parametrize(
    "config,backend",
    [
        ("ddp.yaml", "ddp"),
        pytest.param("deepspeed_zero2.yaml", "deepspeed-zero2", marks=pytest.mark.benchmark),
    ],
    ids=["ddp", "zero2"],
)
def test_the_command_line_audits_two_processes(tmp_path, config, backend):
    """accelerate launch -m hf_dp.audit on 2 gloo processes. SGD's released update is ĝ: with the canary its
    mean is q·C/B̄, which also shows each trial starts from fresh weights (under ZeRO-2 its fp32 master copy too:
    a copy left stale would add the earlier trials' updates into later scores)."""
    audit_dir = tmp_path / "audit"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    port = str(free_port())
    command = [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
        str(REPO / "recipes" / "configs" / config), "--main_process_port", port, "-m", "hf_dp.audit",
        "--model_type", "gpt2", "--trials", "300", "--num_examples", "64", "--noise_multiplier", "1.0",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "10",
        "--dp_optimizer", "sgd", "--learning_rate", "0.01", "--output_dir", str(tmp_path / "out"),
        "--audit_dir", str(audit_dir), "--report_to", "none", "--use_cpu",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    step = json.loads((audit_dir / "audit.json").read_text())["step"]
    assert step["world_size"] == 2 and step["backend"] == backend, step
    assert not step["flagged"], step
    assert step["expected_batch_size"] == 16  # 2 processes × 4 × 2
    scores = np.load(audit_dir / "scores.npz")
    batch, q = step["expected_batch_size"], step["sample_rate"]
    clip = step["clip_norm"]
    stderr = step["noise_multiplier"] * clip / batch / math.sqrt(len(scores["with"]))
    assert abs(scores["with"].mean() - q * clip / batch) < 5 * stderr
    assert scores["without"].std() == pytest.approx(step["noise_multiplier"] * clip / batch, rel=0.15)
