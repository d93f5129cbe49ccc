"""A white-box distinguishing audit of one DP step, through the trainer's own public step.

D: examples whose gradients never touch coordinate 0. D' = D + a canary whose gradient is 2000·C on
coordinate 0 alone. Each trial releases one step on D or on D' and scores the update on coordinate 0; a
threshold chosen on one half of the trials is tested on the other half, and Clopper–Pearson intervals turn
the true/false positive rates into an ε lower bound (Jagielski et al. 2020; Nasr et al. 2021). The real
step must stay below the ε it reports; with the noise removed the audit must catch it.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import beta
from torch import nn
from torch.utils.data import Dataset

from hf_dp import DPTrainer, compute_epsilon
from tests.trainer_utils import make_args

DIM, CLIP, SIGMA, TRIALS, DELTA = 4, 1.0, 3.0, 400, 1e-5


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Rows(Dataset):
    def __init__(self, canary: bool) -> None:
        g = torch.Generator().manual_seed(0)
        rows = torch.randn(7, DIM, generator=g) * 0.3
        rows[:, 0] = 0.0  # coordinate 0 belongs to the canary alone
        if canary:
            rows = torch.cat([rows, torch.tensor([[2000.0 * CLIP, 0.0, 0.0, 0.0]])])
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.rows[i]}


class LinearLossTrainer(DPTrainer):
    def compute_per_example_loss(self, model, inputs):
        """L_i = −w·x_i, so ∇L_i = −x_i whatever w is: the canary's gradient is exactly known."""
        return -model(x=inputs["x"]).squeeze(-1)


def released_scores(tmp_path, canary: bool) -> torch.Tensor:
    dataset = Rows(canary)
    trainer = LinearLossTrainer(
        model=Probe(),
        args=make_args(
            tmp_path,
            noise_multiplier=SIGMA,
            per_sample_max_grad_norm=CLIP,
            per_device_train_batch_size=len(dataset),  # q = 1: the canary is in every batch of D'
            gradient_accumulation_steps=1,
            learning_rate=1.0,
            target_delta=DELTA,
            max_steps=TRIALS,
        ),
        train_dataset=dataset,
        data_collator=lambda rows: {"x": torch.stack([r["x"] for r in rows])},
    )
    weight = trainer.model.linear.weight
    start = weight.detach().clone()
    loader = trainer.get_train_dataloader()
    scores = []
    for trial in range(TRIALS):
        loader.set_epoch(trial)
        trainer.train_one_step(list(loader))
        scores.append((weight[0, 0] - start[0, 0]).item())
        with torch.no_grad():
            weight.copy_(start)
    assert trainer.accountant.steps == TRIALS  # every release was accounted
    return torch.tensor(scores)


def epsilon_lower_bound(without: torch.Tensor, with_canary: torch.Tensor, confidence: float = 0.95) -> float:
    """Threshold from the first halves (best empirical ratio), Clopper–Pearson bound on the second halves."""
    half = len(without) // 2
    choose_out, choose_in = without[:half], with_canary[:half]
    candidates = torch.cat([choose_out, choose_in])

    def empirical(t: torch.Tensor) -> float:
        fpr = ((choose_out > t).float().mean().item() + 1 / half)
        return (choose_in > t).float().mean().item() / fpr

    threshold = max(candidates.tolist(), key=empirical)
    test_out, test_in = without[half:], with_canary[half:]
    n = len(test_out)
    false_pos, true_pos = int((test_out > threshold).sum()), int((test_in > threshold).sum())
    alpha = 1 - confidence
    fpr_high = 1.0 if false_pos == n else beta.ppf(1 - alpha / 2, false_pos + 1, n - false_pos)
    tpr_low = 0.0 if true_pos == 0 else beta.ppf(alpha / 2, true_pos, n - true_pos + 1)
    if tpr_low - DELTA <= 0:
        return 0.0
    return max(0.0, math.log((tpr_low - DELTA) / fpr_high))


def test_the_real_step_stays_below_its_reported_epsilon(tmp_path):
    reported = compute_epsilon(SIGMA, 1.0, 1, DELTA, "prv")
    bound = epsilon_lower_bound(released_scores(tmp_path, False), released_scores(tmp_path, True))
    assert bound <= reported, (bound, reported)


def test_the_audit_catches_a_step_without_noise(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "hf_dp.noise.GaussianNoise.sample", lambda self, shape, std, device, dtype: torch.zeros(shape, dtype=dtype)
    )
    reported = compute_epsilon(SIGMA, 1.0, 1, DELTA, "prv")
    bound = epsilon_lower_bound(released_scores(tmp_path, False), released_scores(tmp_path, True))
    assert reported < 2.5 < bound, (bound, reported)


def test_the_scores_carry_the_noise_the_step_reports(tmp_path):
    """Without the canary the score is pure noise of std σC/B̄ (a sanity check of the audit's input)."""
    scores = released_scores(tmp_path, False)
    assert scores.std().item() == pytest.approx(SIGMA * CLIP / len(Rows(False)), rel=0.15)
