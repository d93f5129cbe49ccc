"""DiSK (Zhang et al., Alg. 3) through the optimizer: its properties, the plan's evaluations, state and refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hf_dp.accounting import PrivacyAccountant
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.plan import StepPlan
from hf_dp.losses import per_example_loss
from hf_dp.mechanism import GaussianMechanism
from hf_dp.noise import GaussianNoise
from hf_dp.optim.disk import DiSK, build
from hf_dp.optim.registry import make_dp_optimizer
from tests import models, oracle
from tests.engine_steps import clip_and_accumulate


def disk(params, base: str = "sgd", kappa: float = 0.7, gamma: float = 0.5, **base_kwargs) -> DiSK:
    return build(
        params, mean_noise_std=0.0, kappa=kappa, gamma=gamma, base=base, **{"lr": 0.1, **base_kwargs}
    )


def _offsets(shift) -> dict | None:
    return None if shift is None else {p: shift.offset(p) for p in shift.directions}


def combined_gradient(plan: StepPlan, params: list, gradient_at) -> list[torch.Tensor]:
    """Σ_e w_e ∇F(θ + shift_e), each evaluation by real autograd at the shifted point (θ restored after)."""
    total = [torch.zeros_like(p) for p in params]
    for evaluation in plan.evaluations:
        shift = _offsets(evaluation.shift) or {}
        with torch.no_grad():
            for p in params:
                p.add_(shift.get(p, torch.zeros_like(p)))
        for k, g in enumerate(gradient_at()):
            total[k] += evaluation.weight * g
        with torch.no_grad():
            for p in params:
                p.sub_(shift.get(p, torch.zeros_like(p)))
    return total


@pytest.mark.parametrize(
    ("kappa", "factor"),
    [(0.5, 0.3333), (0.6, 0.4286), (0.7, 0.5385), (0.8, 0.6667), (0.9, 0.8182), (0.99, 0.9802)],
)
def test_stationary_variance_d2(kappa: float, factor: float) -> None:
    """D2: white input noise of variance 1 leaves g̃ with variance κ/(2 − κ) (the Opacus port's lerp: 0.1765 at 0.7)."""
    param = torch.nn.Parameter(torch.zeros(30000))
    optimizer = disk([param], kappa=kappa, lr=0.0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(25):  # (1 − κ)^{2t} of the start is gone
        param.grad = torch.randn(30000, generator=generator)
        optimizer.step()
    assert optimizer.state[param]["filtered"].var().item() == pytest.approx(factor, rel=0.03)


def test_combination_coefficients_d3() -> None:
    """D3 at κ = 0.7: c = (1 − κ)/(κγ); weights (c, 1 − c) sum to 1; one evaluation at θ + γd when c = 1."""
    table = {0.2: 2.1429, 0.3: 1.4286, 0.5: 0.8571, 1.0: 0.4286, 2.0: 0.2143, 3.0: 0.1429, -1.0: -0.4286}
    param = torch.nn.Parameter(torch.zeros(3))
    for gamma, c in table.items():
        optimizer = disk([param], gamma=gamma)
        assert optimizer.c == pytest.approx(c, abs=1e-4)
        param.grad = torch.ones(3)
        optimizer.step()
        plan = optimizer.plan_step(1.0)
        assert [e.weight for e in plan.evaluations] == pytest.approx([c, 1 - c], abs=1e-4)
        assert sum(e.weight for e in plan.evaluations) == pytest.approx(1.0, abs=1e-15)
        torch.testing.assert_close(
            plan.evaluations[0].shift.offset(param), gamma * optimizer.state[param]["displacement"]
        )
        assert plan.evaluations[1].shift is None
    nag = disk([param], gamma=0.3 / 0.7)
    param.grad = torch.ones(3)
    nag.step()
    (only,) = nag.plan_step(1.0).evaluations
    assert only.weight == 1.0 and only.shift is not None


def test_first_step_and_zero_displacement_evaluate_once_at_theta() -> None:
    """t = 0 (d = 0): u_i = ∇f(θ_0; ξ_i), one pass; also after a step that did not move (lr = 0 warm-up)."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = disk([param], lr=0.0)
    assert optimizer.plan_step(2.0) == StepPlan(clip_norm=2.0)
    param.grad = torch.ones(3)
    optimizer.step()
    assert optimizer.plan_step(2.0) == StepPlan(clip_norm=2.0)


def test_kappa_one_is_the_base_optimizer_bit_for_bit_d4() -> None:
    torch.manual_seed(1)
    start = torch.randn(4, 5)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    wrapped = disk([ours], base="adamw", kappa=1.0, lr=0.01, weight_decay=0.1)
    adamw = torch.optim.AdamW([theirs], lr=0.01, weight_decay=0.1)
    for _ in range(5):
        assert wrapped.plan_step(1.0) == StepPlan(clip_norm=1.0)
        grad = torch.randn(4, 5)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        wrapped.step()
        adamw.step()
        assert torch.equal(ours, theirs)


def test_gamma_minus_one_is_storm_d4() -> None:
    """γ = −1, SGD base, no noise or clipping: m_t = (1−κ)m_{t−1} + ∇f(x_t; ξ_t) − (1−κ)∇f(x_{t−1}; ξ_t)."""
    torch.manual_seed(2)
    data, targets = torch.randn(30, 4, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
    batches = [torch.randperm(30)[:6] for _ in range(8)]
    kappa, lr = 0.6, 0.05

    def gradient(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return data[rows].T @ (data[rows] @ x - targets[rows]) / len(rows)

    x = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    optimizer = disk([x], kappa=kappa, gamma=-1.0, lr=lr)
    trajectory = []
    for rows in batches:

        def gradient_at(rows=rows) -> list[torch.Tensor]:
            loss = 0.5 * ((data[rows] @ x - targets[rows]) ** 2).mean()
            return list(torch.autograd.grad(loss, [x]))

        (x.grad,) = combined_gradient(optimizer.plan_step(1.0), [x], gradient_at)
        optimizer.step()
        trajectory.append(x.detach().clone())

    point, previous, momentum = torch.zeros(4, dtype=torch.float64), None, None
    for rows, ours in zip(batches, trajectory, strict=True):
        if momentum is None:
            momentum = gradient(point, rows)
        else:
            momentum = (1 - kappa) * momentum + gradient(point, rows) - (1 - kappa) * gradient(previous, rows)
        previous, point = point, point - lr * momentum
        torch.testing.assert_close(ours, point, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("gamma", [0.5, 0.3 / 0.7, -1.0, 3.0])
def test_quadratic_finite_difference_is_exact_d4(gamma: float) -> None:
    """F = ½ xᵀHx + bᵀx: Σ_e w_e ∇F(x + shift_e) = ∇F(x) + ((1−κ)/κ)·H d, so the filter is the Kalman
    prediction corrected by the observation: g̃_t = (1−κ)(g̃_{t−1} + H d) + κ∇F(x_t)."""
    torch.manual_seed(3)
    root = torch.randn(5, 5, dtype=torch.float64)
    hessian, linear = root @ root.T + torch.eye(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    x = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    optimizer = disk([x], base="adam", gamma=gamma, lr=0.1)

    def gradient_at() -> list[torch.Tensor]:
        return list(torch.autograd.grad(0.5 * x @ hessian @ x + linear @ x, [x]))

    for _ in range(4):
        filtered = optimizer.state[x]["filtered"].clone() if optimizer.state else None
        plan = optimizer.plan_step(1.0)
        (x.grad,) = combined_gradient(plan, [x], gradient_at)
        if filtered is not None:
            d = optimizer.state[x]["displacement"]
            (plain,) = gradient_at()
            torch.testing.assert_close(x.grad, plain + 0.3 / 0.7 * hessian @ d, rtol=1e-12, atol=1e-12)
            kalman = 0.3 * (filtered + hessian @ d) + 0.7 * plain
        optimizer.step()
        if filtered is not None:
            torch.testing.assert_close(optimizer.state[x]["filtered"], kalman, rtol=1e-12, atol=1e-12)


def test_displacement_is_the_actual_step_with_weight_decay_and_schedule() -> None:
    torch.manual_seed(4)
    param = torch.nn.Parameter(torch.randn(6, 3))
    optimizer = disk([param], base="adamw", lr=0.01, weight_decay=0.3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(4):
        before = param.detach().clone()
        param.grad = torch.randn(6, 3)
        optimizer.step()
        scheduler.step()
        state = optimizer.state[param]
        assert torch.equal(state["displacement"], param.detach() - before)
        assert not torch.allclose(
            state["displacement"], -optimizer.base.param_groups[0]["lr"] * state["filtered"]
        )
    assert optimizer.base.param_groups[0]["lr"] == pytest.approx(0.01 / 5)


@pytest.mark.parametrize(
    ("base", "kwargs"),
    [
        ("sgd", {"momentum": 0.9, "weight_decay": 0.1, "nesterov": True}),
        ("adam", {"weight_decay": 0.1}),
        ("adamw", {"weight_decay": 0.1}),
        ("adam_bc", {"weight_decay": 0.1}),
    ],
)
def test_filter_is_lent_to_the_base_unharmed_and_grad_given_back(base: str, kwargs: dict) -> None:
    """g̃ is handed to the base as .grad without a copy: after every step g̃ is still (1−κ)g̃ + κĝ computed
    independently, the update is the base's own on g̃ (the base alone, fed g̃, moves θ the same way),
    and .grad holds the privatised ĝ again."""
    torch.manual_seed(8)
    kappa = 0.6
    param = torch.nn.Parameter(torch.randn(5, 4))
    twin = torch.nn.Parameter(param.detach().clone())
    noise_std = 0.01  # only adam_bc reads it; DiSK hands its base √(κ/(2−κ))·σC/B̄
    optimizer = build([param], mean_noise_std=noise_std, kappa=kappa, base=base, lr=0.1, **kwargs)
    reference = make_dp_optimizer(
        base, [twin], mean_noise_std=noise_std * math.sqrt(kappa / (2 - kappa)), lr=0.1, **kwargs
    )
    filtered = None
    for _ in range(3):
        grad = torch.randn(5, 4)
        param.grad = grad
        filtered = grad.clone() if filtered is None else (1 - kappa) * filtered + kappa * grad
        twin.grad = filtered.clone()
        optimizer.step()
        reference.step()
        assert param.grad is grad and torch.equal(grad, param.grad)
        torch.testing.assert_close(optimizer.state[param]["filtered"], filtered, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(param.detach(), twin.detach(), rtol=1e-6, atol=1e-7)


def test_state_round_trip_carries_base_state_and_filter() -> None:
    torch.manual_seed(5)
    grads = [torch.randn(4, 3) for _ in range(6)]

    def run(split: int | None) -> tuple:
        param = torch.nn.Parameter(torch.ones(4, 3))
        optimizer = disk([param], base="adamw", lr=0.05, weight_decay=0.1)
        for k, grad in enumerate(grads):
            if k == split:
                saved = copy.deepcopy(optimizer.state_dict())
                optimizer = disk([param], base="adamw", lr=0.05, weight_decay=0.1)
                optimizer.load_state_dict(saved)
                assert optimizer.param_groups is optimizer.base.param_groups
            shift = optimizer.plan_step(1.0).evaluations[0].shift
            shift = shift.offset(param).clone() if shift else None
            param.grad = grad.clone()
            optimizer.step()
        state = optimizer.state[param]
        return param.detach(), state["filtered"], state["displacement"], state["step"], shift

    for ours, reference in zip(run(3), run(None), strict=True):
        assert torch.equal(ours, reference)


def test_refusals() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    for kappa in (0.0, 1.5):
        with pytest.raises(ValueError, match="0 < kappa ≤ 1"):
            disk([param], kappa=kappa)
    with pytest.raises(ValueError, match="gamma ≠ 0"):
        disk([param], gamma=0.0)
    with pytest.raises(ValueError, match="plans its own clipping"):
        disk([param], base="stp")
    with pytest.raises(ValueError, match="cannot wrap itself"):
        disk([param], base="disk")


def test_one_private_step_through_engine_and_mechanism() -> None:
    """The trainer's contract end to end (σ = 0): plan → one forward per evaluation → one joint clip →
    release → DiSK step; g̃ equals the brute-force clipped combination / B̄."""
    model = models.gpt2().double().eval()
    batch = models.token_batch()
    optimizer = disk(list(model.parameters()), base="adamw", lr=1e-2)
    mechanism = GaussianMechanism(
        noise_multiplier=0.0,
        expected_batch_size=5.0,
        sample_rate=0.5,
        noise=GaussianNoise(0),
        accountant=PrivacyAccountant("rdp", 1e-5),
    )
    engine = ClippingEngine(model)
    for step in range(2):
        plan = optimizer.plan_step(0.3)
        assert len(plan.evaluations) == (1 if step == 0 else 2)
        reference, _ = oracle.per_example(
            model, batch, 0.3, evaluations=tuple((e.weight, _offsets(e.shift)) for e in plan.evaluations)
        )
        gradients = []
        for evaluation in plan.evaluations:
            offsets = _offsets(evaluation.shift) or {}
            saved = {p: p.detach().clone() for p in offsets}
            with torch.no_grad():
                for p, delta in offsets.items():
                    p.add_(delta)
            with engine.record(5):
                losses = per_example_loss(model, batch)
            gradients.append((engine.per_example_gradients(losses, verify=True), evaluation.weight))
            with torch.no_grad():
                for p, value in saved.items():
                    p.copy_(value)
        clip_and_accumulate(engine, gradients, plan.clip_norm, clip_scale=plan.clip_scale)
        filtered = {n: optimizer.state[p]["filtered"].clone() for n, p in model.named_parameters() if step}
        mechanism.release(model.parameters(), plan, engine.sums.take())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            expected = reference[name] / 5.0
            if step:
                expected = 0.3 * filtered[name] + 0.7 * expected
            torch.testing.assert_close(optimizer.state[p]["filtered"], expected, rtol=1e-9, atol=1e-13)
    assert math.isclose(optimizer.c, 6 / 7)
