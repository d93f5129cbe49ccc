"""The release (noise once, one accounted step per logical batch), the step planner, and the run's secret."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_dp.accounting import PrivacyAccountant
from hf_dp.mechanism import GaussianMechanism
from hf_dp.noise import GaussianNoise
from hf_dp.clipping.plan import StepPlan, StepPlanner
from hf_dp.randomness import RunSecret


def _mechanism(sigma: float = 2.0, private: bool = True) -> GaussianMechanism:
    return GaussianMechanism(
        noise_multiplier=sigma,
        expected_batch_size=8,
        sample_rate=0.25,
        noise=GaussianNoise(1) if private else None,
        accountant=PrivacyAccountant("rdp", 1e-5) if private else None,
    )


def test_release_adds_sum_space_noise_divides_by_the_expected_batch_and_accounts_once():
    mechanism, plan = _mechanism(), StepPlan(clip_norm=0.5)
    param = nn.Parameter(torch.zeros(200_000))
    param.grad = torch.full_like(param, 4.0)  # a clipped sum
    mechanism.release([param], plan)
    assert mechanism.sum_noise_std(plan) == 2.0 * 0.5 and mechanism.mean_noise_std(plan) == 2.0 * 0.5 / 8
    assert param.grad.mean().item() == pytest.approx(0.5, abs=4 * 0.125 / math.sqrt(200_000))
    assert param.grad.std().item() == pytest.approx(0.125, rel=0.01)
    mechanism.release([param], plan)  # a second shard of the same logical batch (ZeRO-3 sub-groups)
    assert mechanism.accountant.steps == 1
    mechanism.release([param], StepPlan(clip_norm=0.5))
    assert mechanism.accountant.history == [(2.0, 0.25, 2)]


def test_an_empty_batch_still_gets_noise_and_is_accounted():
    mechanism, param = _mechanism(), nn.Parameter(torch.zeros(1000))
    mechanism.release([param], StepPlan(clip_norm=1.0))
    assert param.grad is not None and param.grad.std().item() > 0.1 and mechanism.accountant.steps == 1


def test_a_scaled_geometry_gets_noise_isotropic_in_the_scaled_space():
    mechanism, param = _mechanism(), nn.Parameter(torch.zeros(2, 100_000))
    scale = torch.tensor([[1.0], [4.0]]).expand(2, 100_000)
    param.grad = torch.zeros_like(param)
    mechanism.release([param], StepPlan(clip_norm=1.0, clip_scale={param: scale}))
    stds = param.grad.std(dim=1)
    assert stds[0].item() == pytest.approx(2.0 / 8, rel=0.02) and stds[1].item() == pytest.approx(
        2.0 / 32, rel=0.02
    )


def test_without_dp_nothing_is_noised_or_accounted():
    mechanism, param = _mechanism(private=False), nn.Parameter(torch.zeros(10))
    param.grad = torch.full_like(param, 8.0)
    mechanism.release([param], StepPlan(clip_norm=1.0))
    assert torch.equal(param.grad, torch.ones(10)) and not mechanism.private
    with pytest.raises(ValueError, match="both a noise source and an accountant"):
        GaussianMechanism(
            noise_multiplier=1.0,
            expected_batch_size=1,
            sample_rate=1.0,
            noise=GaussianNoise(0),
            accountant=None,
        )


def test_the_release_runs_before_every_optimizer_step_with_the_planners_plan():
    param = nn.Parameter(torch.zeros(1000))
    optimizer = torch.optim.SGD([param], lr=1.0)
    planner, mechanism = StepPlanner(clip_norm=1.0), _mechanism()
    planner.bind(optimizer)
    mechanism.attach(optimizer, planner)
    mechanism.attach(optimizer, planner)  # attaching twice adds no second release
    first = planner.current
    assert planner.current is first and first == StepPlan(clip_norm=1.0)
    optimizer.step()
    assert mechanism.accountant.steps == 1 and param.std().item() == pytest.approx(2.0 / 8, rel=0.1)
    planner.end()
    assert planner.current is not first


def test_secrets_are_fresh_derived_keys_differ_and_round_trip():
    a, b = RunSecret.draw(), RunSecret.draw()
    assert a.key != b.key and a.source == "os_entropy"
    assert len({a.sampling_key, a.noise_key(None), a.noise_key(0), a.noise_key(1)}) == 4
    assert RunSecret.from_dict(a.to_dict()) == a
    assert RunSecret.draw(5) == RunSecret.draw(5) and RunSecret.draw(5).source == "insecure_dp_seed"
    assert RunSecret.draw(5).key != 5  # the seed is hashed, not used as the key
