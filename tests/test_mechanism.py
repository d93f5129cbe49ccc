"""The release (noise once, one accounted step per logical batch), the step planner, and the run's secret."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_dp.accounting import PrivacyAccountant
from hf_dp.clipping.checks import GradientWrittenOutsideClipping
from hf_dp.clipping.plan import StepPlan
from hf_dp.clipping.sums import ClippedSums
from hf_dp.mechanism import GaussianMechanism
from hf_dp.noise import GaussianNoise
from hf_dp.randomness import RunSecret
from tests.trainer_utils import make_trainer


def _mechanism(sigma: float = 2.0, private: bool = True) -> GaussianMechanism:
    return GaussianMechanism(
        noise_multiplier=sigma,
        expected_batch_size=8,
        sample_rate=0.25,
        noise=GaussianNoise(1) if private else None,
        accountant=PrivacyAccountant("rdp", 1e-5) if private else None,
    )


def test_release_adds_sum_space_noise_and_divides_by_the_expected_batch_accounting_apart():
    mechanism, plan = _mechanism(), StepPlan(clip_norm=0.5)
    param = nn.Parameter(torch.zeros(200_000))
    param.grad = torch.full_like(param, 4.0)  # a clipped sum
    mechanism.release([param], plan, ClippedSums())
    assert mechanism.sum_noise_std(plan) == 2.0 * 0.5 and mechanism.mean_noise_std(plan) == 2.0 * 0.5 / 8
    assert param.grad.mean().item() == pytest.approx(0.5, abs=4 * 0.125 / math.sqrt(200_000))
    assert param.grad.std().item() == pytest.approx(0.125, rel=0.01)
    assert mechanism.accountant.steps == 0
    mechanism.account()
    assert mechanism.accountant.history == [(2.0, 0.25, 1)]


def test_a_low_precision_parameter_is_noised_in_float32_from_its_explicit_sum():
    mechanism, plan = _mechanism(), StepPlan(clip_norm=0.5)
    param = nn.Parameter(torch.zeros(100_000, dtype=torch.bfloat16))
    sums = ClippedSums({param: torch.full((100_000,), 4.0)})
    mechanism.release([param], plan, sums)
    assert sums.wide == {} and param.grad.dtype == torch.bfloat16  # taken once; only ĝ is cast
    assert param.grad.float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert param.grad.float().std().item() == pytest.approx(0.125, rel=0.02)


def test_an_empty_batch_still_gets_noise():
    mechanism, param = _mechanism(), nn.Parameter(torch.zeros(1000))
    mechanism.release([param], StepPlan(clip_norm=1.0), ClippedSums())
    assert param.grad is not None and param.grad.std().item() > 0.1


def test_a_scaled_geometry_gets_noise_isotropic_in_the_scaled_space():
    mechanism, param = _mechanism(), nn.Parameter(torch.zeros(2, 100_000))
    scale = torch.tensor([[1.0], [4.0]]).expand(2, 100_000)
    param.grad = torch.zeros_like(param)
    mechanism.release([param], StepPlan(clip_norm=1.0, clip_scale={param: scale}), ClippedSums())
    stds = param.grad.std(dim=1)
    assert stds[0].item() == pytest.approx(2.0 / 8, rel=0.02) and stds[1].item() == pytest.approx(
        2.0 / 32, rel=0.02
    )


def test_without_dp_nothing_is_noised_or_accounted():
    mechanism, param = _mechanism(private=False), nn.Parameter(torch.zeros(10))
    param.grad = torch.full_like(param, 8.0)
    mechanism.release([param], StepPlan(clip_norm=1.0), ClippedSums())
    mechanism.account()
    assert torch.equal(param.grad, torch.ones(10)) and not mechanism.private
    with pytest.raises(ValueError, match="both a noise source and an accountant"):
        GaussianMechanism(
            noise_multiplier=1.0,
            expected_batch_size=1,
            sample_rate=1.0,
            noise=GaussianNoise(0),
            accountant=None,
        )


def test_one_pre_hook_releases_the_planners_plan_and_accounts_each_logical_batch_once(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0)
    run = trainer.dp
    optimizer = trainer.create_optimizer()
    trainer.create_optimizer()  # binding again adds no second release
    assert len(optimizer._optimizer_step_pre_hooks) == 1 and run.optimizer is optimizer
    first = run.planner.current
    assert run.planner.current is first and first == StepPlan(clip_norm=trainer.args.per_sample_max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    run.release(optimizer)  # a second release of the same logical batch (ZeRO-3 steps once per sub-group)
    assert run.accountant.steps == 1
    run.end_step()
    assert run.planner.current is not first
    optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    assert run.accountant.history == [(1.0, trainer.sample_rate, 2)]


def test_the_release_refuses_a_gradient_written_outside_clipping(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0)
    optimizer = trainer.create_optimizer()
    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    param.grad = torch.ones_like(param)
    with pytest.raises(GradientWrittenOutsideClipping, match="outside per-example clipping"):
        optimizer.step()
    assert trainer.dp.accountant.steps == 0  # nothing noised, nothing spent


def test_secrets_are_fresh_derived_keys_differ_and_round_trip():
    a, b = RunSecret.draw(), RunSecret.draw()
    assert a.key != b.key and a.source == "os_entropy"
    assert len({a.sampling_key, a.noise_key(None), a.noise_key(0), a.noise_key(1)}) == 4
    assert RunSecret.from_dict(a.to_dict()) == a
    assert RunSecret.draw(5) == RunSecret.draw(5) and RunSecret.draw(5).source == "insecure_dp_seed"
    assert RunSecret.draw(5).key != 5  # the seed is hashed, not used as the key


def _release_one_at_a_time(mechanism: GaussianMechanism, params: list, plan: StepPlan) -> None:
    """The release as it was written before the noise was added in buckets: draw, add, divide, one by one."""
    std = mechanism.sum_noise_std(plan)
    for p in params:
        total = p.grad.double() if p.dtype == torch.float64 else p.grad.float()
        total.add_(mechanism.noise_for(total, std))
        total.div_(mechanism.expected_batch_size)
        p.grad = total.to(p.dtype)


@pytest.mark.parametrize("bucket", [1, 1000, 64 * 1024 * 1024])
def test_the_bucketed_release_equals_the_one_at_a_time_release_bit_for_bit(monkeypatch, bucket):
    """Noise drawn in the parameters' order from the same stream, added by ``_foreach_add_`` a bucket at a time and
    divided by ``_foreach_div_``: the same ĝ to the last bit, whatever the bucket size, float32 and float64."""
    import hf_dp.mechanism

    monkeypatch.setattr(hf_dp.mechanism, "_NOISE_BUCKET_FLOATS", bucket)
    shapes = [(3, 5), (70_000,), (1,), (200, 300), (7,)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float32, torch.float64]
    grads = [
        torch.randn(s, generator=torch.Generator().manual_seed(k)).to(d)
        for k, (s, d) in enumerate(zip(shapes, dtypes, strict=True))
    ]
    ours, theirs = (
        [nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes, strict=True)] for _ in range(2)
    )
    for p, q, g in zip(ours, theirs, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    plan = StepPlan(clip_norm=0.7)
    _mechanism().release(ours, plan, ClippedSums())
    _release_one_at_a_time(_mechanism(), theirs, plan)
    for p, q in zip(ours, theirs, strict=True):
        assert p.grad.dtype == q.grad.dtype and torch.equal(p.grad, q.grad)
