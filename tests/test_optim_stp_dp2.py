"""Scale-then-privatize (Ganesh et al.) and DP² (Li et al. 2023, Alg. 1) through the optimizers: their properties."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hf_dp.accounting import PrivacyAccountant
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.geometry import FactoredScale
from hf_dp.clipping.plan import StepPlan, StepPlanner
from hf_dp.clipping.sums import ClippedSums
from hf_dp.losses import per_example_loss
from hf_dp.mechanism import GaussianMechanism
from hf_dp.noise import GaussianNoise
from hf_dp.optim.dp2 import DP2
from hf_dp.optim.registry import make_dp_optimizer
from hf_dp.optim.scale_then_privatize import ScaleThenPrivatize
from tests import models
from tests.engine_steps import clipped_backward


def mechanism(sigma: float, batch: float, seed: int = 0) -> GaussianMechanism:
    return GaussianMechanism(
        noise_multiplier=sigma,
        expected_batch_size=batch,
        sample_rate=0.5,
        noise=GaussianNoise(seed),
        accountant=PrivacyAccountant("rdp", 1e-5),
    )


def released_by(optimizer: torch.optim.Optimizer, sigma: float, clip: float, batch: float) -> StepPlanner:
    """Every ``optimizer.step()`` first releases the optimizer's own plan (as the trainer wires it)."""
    planner, released = StepPlanner(clip), mechanism(sigma, batch)
    planner.bind(optimizer)

    def release(opt: torch.optim.Optimizer, *_) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        released.release(params, planner.current, ClippedSums())

    optimizer.register_step_pre_hook(release)
    return planner


# ---- scale-then-privatize ------------------------------------------------------------------------------


def test_first_step_is_dp_sgd_with_clip_c_times_eps1() -> None:
    """[derived] s_1 = 1/ε1: ‖g_i/ε1‖ ≤ C is ‖g_i‖ ≤ Cε1, and the noise σC/s_1 = σCε1."""
    model = models.gpt2().double().eval()
    batch = models.token_batch()
    eps1, clip = 1e-2, 400.0
    optimizer = ScaleThenPrivatize(model.parameters(), scale_eps=eps1)
    plan = optimizer.plan_step(clip)
    assert plan.clip_norm == clip and all(torch.all(s == 1 / eps1) for s in plan.clip_scale.values())
    engine = ClippingEngine(model)
    grads = {}
    for key, released in {"stp": plan, "sgd": StepPlan(clip_norm=clip * eps1)}.items():
        model.zero_grad(set_to_none=True)
        with engine.record(5):
            losses = per_example_loss(model, batch)
        norms = clipped_backward(engine, losses, released.clip_norm, clip_scale=released.clip_scale)
        mechanism(1.3, 5.0).release(list(model.parameters()), released, ClippedSums())
        grads[key] = [p.grad.clone() for p in model.parameters()]
    assert (norms > clip * eps1).any() and (norms < clip * eps1).any(), "clipping is active for some"
    for ours, reference in zip(grads["stp"], grads["sgd"], strict=True):
        assert (ours - reference).norm() <= 1e-6 * reference.norm()  # abadi's +1e-6 differs by the scale


def test_step_is_adamw_on_the_unscaled_gradient() -> None:
    torch.manual_seed(1)
    start = torch.randn(7, 3)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    stp = ScaleThenPrivatize([ours], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    adamw = torch.optim.AdamW([theirs], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for _ in range(5):
        grad = torch.randn(7, 3)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        stp.step()
        adamw.step()
    assert torch.equal(ours, theirs)
    nu_hat = stp.state[ours]["exp_avg_sq"] / (1 - 0.9**5)
    torch.testing.assert_close(stp.plan_step(1.0).clip_scale[ours], 1 / (nu_hat.sqrt() + 1e-4))


def test_steady_state_ratio_t4() -> None:
    """T4: constant g, no clipping, ε1 → 0: E[ν̂] → g²/(1 − σ²C²/B²), 1.333 at σC/B = 0.5, for every |g|."""
    coords = 1000
    g = torch.tensor([1.0, 0.1, 0.01]).repeat_interleave(coords)
    param = torch.nn.Parameter(torch.zeros(3 * coords))
    optimizer = ScaleThenPrivatize([param], lr=0.0, betas=(0.9, 0.9), scale_eps=1e-12)
    planner = released_by(optimizer, sigma=1.0, clip=1.0, batch=2.0)
    ratios = []
    for step in range(300):
        param.grad = 2.0 * g  # the sum over B̄ = 2 unclipped examples
        optimizer.step()
        planner.end()
        if step >= 100:
            ratios.append(optimizer.state[param]["exp_avg_sq"] / (1 - 0.9 ** (step + 1)) / g**2)
    ratio = torch.stack(ratios).mean(dim=0).view(3, coords).mean(dim=1)
    torch.testing.assert_close(ratio, torch.full((3,), 4 / 3), rtol=0.02, atol=0)


def test_noise_amplification_bound_t5() -> None:
    """T5: ν̂_t ≥ ((β2 − β2^t)/(1 − β2^t))·ν̂_{t−1} for any stream, so s_{t+1}/s_t ≤ √((1 − β2^t)/(β2 − β2^t));
    a zero gradient attains it."""
    torch.manual_seed(2)
    beta2 = 0.9
    param = torch.nn.Parameter(torch.zeros(500))
    optimizer = ScaleThenPrivatize([param], lr=0.01, betas=(0.5, beta2), scale_eps=1e-30)
    scales = []
    for _ in range(1, 40):
        scales.append(optimizer.plan_step(1.0).clip_scale[param])
        heavy = torch.randn(500) * torch.exp(3 * torch.randn(500))
        param.grad = heavy * (torch.rand(500) < 0.7)  # 30% zero gradients
        optimizer.step()
    for t in range(2, len(scales)):
        bound = math.sqrt((1 - beta2**t) / (beta2 - beta2**t))
        ratio = scales[t] / scales[t - 1]  # s_{t+1}/s_t = √(ν̂_{t−1}/ν̂_t)
        assert ratio.max() <= bound * (1 + 1e-6)
        assert ratio.max() >= bound * (1 - 1e-6)


def test_factored_scale_is_rank_one_with_eps_inside() -> None:
    weight, bias = torch.nn.Parameter(torch.zeros(4, 6)), torch.nn.Parameter(torch.zeros(4))
    optimizer = ScaleThenPrivatize([weight, bias], lr=0.0, betas=(0.9, 0.99), scale_eps=1e-10, factored=True)
    first = optimizer.plan_step(1.0).clip_scale
    assert isinstance(first[weight], FactoredScale) and not isinstance(first[bias], FactoredScale)
    torch.testing.assert_close(first[weight].dense(), torch.full((4, 6), 1e10))
    rows, cols = torch.rand(4) + 0.5, torch.rand(6) + 0.5
    for _ in range(3):
        weight.grad, bias.grad = torch.outer(rows, cols), torch.ones(4)
        optimizer.step()
    scale = optimizer.plan_step(1.0).clip_scale
    # ν̂ = (r cᵀ)² is rank 1, so the factored scale is 1/√ν̂ up to √ε1 in each factor
    torch.testing.assert_close(scale[weight].dense(), 1 / torch.outer(rows, cols), rtol=1e-4, atol=0)
    torch.testing.assert_close(scale[bias], 1 / (torch.ones(4) + 1e-10))


def test_stp_state_round_trip_mid_history() -> None:
    torch.manual_seed(3)
    grads = [torch.randn(5, 4) for _ in range(6)]

    def run(split: int | None) -> tuple:
        param = torch.nn.Parameter(torch.ones(5, 4))
        optimizer = ScaleThenPrivatize([param], lr=0.1, factored=True)
        for k, grad in enumerate(grads):
            if k == split:
                saved = copy.deepcopy(optimizer.state_dict())
                optimizer = ScaleThenPrivatize([param], lr=0.1, factored=True)
                optimizer.load_state_dict(saved)
            param.grad = grad.clone()
            optimizer.step()
        return param.detach(), optimizer.plan_step(1.0).clip_scale[param].dense()

    for ours, reference in zip(run(3), run(None), strict=True):
        assert torch.equal(ours, reference)


def test_stp_refusals_and_factory() -> None:
    with pytest.raises(ValueError, match="scale_eps"):
        ScaleThenPrivatize([torch.nn.Parameter(torch.zeros(2))], scale_eps=0.0)
    built = make_dp_optimizer(
        "stp", [torch.nn.Parameter(torch.zeros(2))], mean_noise_std=0.1, lr=1e-3, factored=True
    )
    assert isinstance(built, ScaleThenPrivatize) and built.factored


# ---- DP² --------------------------------------------------------------------------------------------------


def dp2(param, **overrides) -> DP2:
    kwargs = dict(lr=0.1, lr_adaptive=0.3, sgd_steps=3, adaptive_steps=3, adaptive_clip_norm=5.0, eps=1e-3)
    return DP2([param], **{**kwargs, **overrides})


def test_schedule_t11() -> None:
    """s1 = s2 = 3: [S, S, S, A(refresh), A, A, S, S, S, A(refresh), ...]; v changes only at refreshes."""
    torch.manual_seed(4)
    param = torch.nn.Parameter(torch.zeros(8))
    optimizer = dp2(param)
    phases, changed, v = [], [], torch.zeros(8)
    for _ in range(12):
        plan = optimizer.plan_step(0.5)
        phases.append("A" if plan.clip_scale is not None else "S")
        assert plan.clip_norm == (5.0 if plan.clip_scale is not None else 0.5)
        current = optimizer.state[param]["v"].clone() if optimizer.state else torch.zeros(8)
        changed.append(not torch.equal(current, v))
        v = current
        param.grad = torch.randn(8)
        optimizer.step()
    assert "".join(phases) == "SSSAAASSSAAA"
    assert [t for t, c in enumerate(changed) if c] == [3, 9]


def test_averaging_reduces_noise_t9() -> None:
    """T9: zero gradients, Var(A/s1) = σ²C1²/(s1 b²); the first refresh gives v = (1 − β)(A/s1)²."""
    coords, sigma, clip, batch, s1 = 50000, 2.0, 0.5, 4.0, 4
    param = torch.nn.Parameter(torch.zeros(coords))
    optimizer = dp2(param, sgd_steps=s1, beta=0.9)
    planner = released_by(optimizer, sigma, clip, batch)
    for _ in range(s1):
        param.grad = torch.zeros(coords)
        optimizer.step()
        planner.end()
    variance = optimizer.state[param]["v"].mean() / (1 - 0.9)
    expected = sigma**2 * clip**2 / (s1 * batch**2)
    assert abs(variance / expected - 1) < 0.03


def test_adaptive_step_uses_the_preconditioned_noisy_gradient() -> None:
    """Adaptive phase: w ← w − α2·(s ⊙ ĝ) with s = 1/(√v + ε), the plan's scale; SGD phase: w ← w − α·ĝ."""
    torch.manual_seed(5)
    param = torch.nn.Parameter(torch.randn(6))
    optimizer = dp2(param)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    sgd_grads = [torch.randn(6) for _ in range(3)]
    for grad in sgd_grads:
        before = param.detach().clone()
        param.grad = grad.clone()
        optimizer.step()
        torch.testing.assert_close(param.detach(), before - 0.05 * grad, rtol=0, atol=1e-7)
    v = 0.1 * (sum(sgd_grads) / 3) ** 2
    torch.testing.assert_close(optimizer.state[param]["v"], v)
    plan = optimizer.plan_step(0.5)
    scale = 1 / (v.sqrt() + 1e-3)
    torch.testing.assert_close(plan.clip_scale[param], scale)
    before, grad = param.detach().clone(), torch.randn(6)
    param.grad = grad.clone()
    optimizer.step()
    torch.testing.assert_close(param.detach(), before - 0.5 * 0.3 * scale * grad, rtol=1e-6, atol=0)
    assert scheduler.get_last_lr() == [0.05]


def test_adagrad_variant_sums_the_squares() -> None:
    torch.manual_seed(6)
    param = torch.nn.Parameter(torch.zeros(5))
    optimizer = dp2(param, variant="adagrad", sgd_steps=2, adaptive_steps=1)
    grads = [torch.randn(5) for _ in range(5)]
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    expected = ((grads[0] + grads[1]) / 2) ** 2 + ((grads[3] + grads[4]) / 2) ** 2
    torch.testing.assert_close(optimizer.state[param]["v"], expected)


@pytest.mark.parametrize("split", [2, 4, 7])  # mid SGD phase (A ≠ 0), mid adaptive phase, second cycle
def test_dp2_state_round_trip(split: int) -> None:
    torch.manual_seed(7)
    grads = [torch.randn(3, 4) for _ in range(10)]

    def run(split: int | None) -> tuple:
        param = torch.nn.Parameter(torch.ones(3, 4))
        optimizer = dp2(param)
        plans = []
        for k, grad in enumerate(grads):
            if k == split:
                saved = copy.deepcopy(optimizer.state_dict())
                optimizer = dp2(param)
                optimizer.load_state_dict(saved)
            plans.append(optimizer.plan_step(1.0))
            param.grad = grad.clone()
            optimizer.step()
        state = optimizer.state[param]
        assert state["v"].dtype == state["accumulator"].dtype == torch.float32
        return param.detach(), state["v"], state["accumulator"], [p.clip_norm for p in plans]

    ours, reference = run(split), run(None)
    for a, b in zip(ours[:3], reference[:3], strict=True):
        assert torch.equal(a, b)
    assert ours[3] == reference[3]


def test_dp2_refusals_and_factory() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="sgd_steps and adaptive_steps must be ≥ 1"):
        dp2(param, sgd_steps=0)
    with pytest.raises(ValueError, match="adaptive_clip_norm"):
        dp2(param, adaptive_clip_norm=0.0)
    with pytest.raises(ValueError, match="variant"):
        dp2(param, variant="adam")
    with pytest.raises(ValueError, match="does not accept"):
        make_dp_optimizer("dp2", [param], lr=0.1, delay=3)
    default = make_dp_optimizer("dp2", [param], lr=0.1)  # Li et al. 2023's C2 = 5, ε = 1e-7, β = 0.9
    assert (default.sgd_steps, default.adaptive_steps, default.adaptive_clip_norm, default.beta) == (
        50,
        50,
        5.0,
        0.9,
    )
    built = make_dp_optimizer(
        "dp2", [param], lr=0.1, sgd_steps=2, adaptive_steps=2, adaptive_clip_norm=3.0, lr_adaptive=1.0
    )
    assert isinstance(built, DP2) and built.adaptive_lr_ratio == pytest.approx(10.0)
