"""DP-AdamBC (Tang et al. 2024): the noise bias it removes, its floor, fp32 state, checkpoints."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator

import pytest
import torch

from hf_dp.optim.adam_bc import AdamBC
from hf_dp.optim.registry import make_dp_optimizer

BETAS = (0.9, 0.999)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Element-wise work on ~1e4 coordinates: extra threads only add overhead (and spin on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _steps(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Feed each gradient as p.grad (what the privatiser leaves there) and return θ after every step."""
    trajectory = []
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
        trajectory.append(p.detach().clone())
    return trajectory


def _bruteforce_alg7(theta, grads, lrs, noise_std, eps, weight_decay, betas=BETAS) -> list[float]:
    """DP-AdamBC for one coordinate, written out in float64 with explicit sums over the past."""
    beta1, beta2 = betas
    out = []
    for t in range(1, len(grads) + 1):
        m = sum((1 - beta1) * beta1 ** (t - i) * grads[i - 1] for i in range(1, t + 1))
        v = sum((1 - beta2) * beta2 ** (t - i) * grads[i - 1] ** 2 for i in range(1, t + 1))
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        theta = theta * (1 - lrs[t - 1] * weight_decay) - lrs[t - 1] * m_hat / math.sqrt(
            max(v_hat - noise_std**2, eps**2)
        )
        out.append(theta)
    return out


def test_matches_bruteforce_alg7_with_floor_weight_decay_and_lr_schedule() -> None:
    gen = torch.Generator().manual_seed(1)
    steps, noise_std, coords = 12, 0.05, 64
    grads = [0.05 * torch.randn(coords, generator=gen, dtype=torch.float64) for _ in range(steps)]
    lrs = [1e-2 * (1 + t) / steps for t in range(steps)]  # a warm-up, written the way the scheduler does
    start = torch.linspace(-1, 1, coords, dtype=torch.float64)
    p = torch.nn.Parameter(start.clone())
    opt = make_dp_optimizer("adam_bc", [p], mean_noise_std=noise_std, lr=lrs[0], weight_decay=0.1)
    trajectory = []
    for g, lr in zip(grads, lrs, strict=True):
        opt.param_groups[0]["lr"] = lr
        trajectory += _steps(opt, p, [g])
    floored = 0
    for j in range(coords):
        stream = [g[j].item() for g in grads]
        reference = _bruteforce_alg7(start[j].item(), stream, lrs, noise_std, 1e-4, 0.1)
        assert [theta[j].item() for theta in trajectory] == pytest.approx(reference, rel=1e-9, abs=1e-12)
        v_hat = sum(0.001 * 0.999 ** (steps - i) * stream[i - 1] ** 2 for i in range(1, steps + 1)) / (
            1 - 0.999**steps
        )
        floored += v_hat < noise_std**2
    assert 10 < floored < coords - 10  # the floor and the corrected branch are both exercised


def test_floor_is_exact_at_first_step() -> None:
    """At t = 1, m̂ = g and v̂ = g²: the step is lr·g/√(g² − Φ) above the floor and lr·g/ε below it."""
    noise_std, eps, lr = 0.1, 1e-3, 1e-2
    g = torch.tensor([0.3, -0.2, 0.1000002, 0.05, -0.09], dtype=torch.float64)
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    (theta,) = _steps(AdamBC([p], noise_std=noise_std, lr=lr, eps=eps), p, [g])
    expected = [-lr * x / max(math.sqrt(max(x * x - noise_std**2, 0.0)), eps) for x in g.double().tolist()]
    assert theta.tolist() == pytest.approx(expected, rel=1e-4)
    assert theta[3].item() == pytest.approx(-lr * 0.05 / eps, rel=1e-6)  # g² < Φ: the floor, not √(negative)


def test_blackbox_adam_second_moment_is_biased_by_noise_variance_at_every_step() -> None:
    """A fixed gradient stream plus independent noise over many seeds: mean(v̂_t) − v̂*_t → Φ."""
    seeds, steps, noise_std = 20_000, 12, 0.2
    gen = torch.Generator().manual_seed(2)
    stream = [torch.tensor([0.5, -0.1, 0.0]) * (1 + 0.3 * math.sin(t)) for t in range(steps)]
    noisy = torch.nn.Parameter(torch.zeros(seeds, 3))
    clean = torch.nn.Parameter(torch.zeros(1, 3))
    adam_noisy = make_dp_optimizer("adam", [noisy], mean_noise_std=noise_std, betas=BETAS)
    adam_clean = make_dp_optimizer("adam", [clean], mean_noise_std=noise_std, betas=BETAS)
    for t, g in enumerate(stream, start=1):
        _steps(adam_noisy, noisy, [g + noise_std * torch.randn(seeds, 3, generator=gen)])
        _steps(adam_clean, clean, [g[None]])
        excess = (adam_noisy.state[noisy]["exp_avg_sq"] - adam_clean.state[clean]["exp_avg_sq"]) / (
            1 - BETAS[1] ** t
        )
        standard_error = excess.std(dim=0) / math.sqrt(seeds)
        assert (excess.mean(dim=0) - noise_std**2).abs().max() < 5 * standard_error.max(), f"t={t}"


def _denominators(name: str, noise_std: float, grads: list[torch.Tensor], lr: float = 1e-3) -> torch.Tensor:
    """The D_t of the LAST step, read off the observed parameter move: θ_t − θ_{t−1} = −lr·m̂_t/D_t."""
    p = torch.nn.Parameter(torch.zeros_like(grads[0], dtype=torch.float64))
    opt = make_dp_optimizer(name, [p], mean_noise_std=noise_std, lr=lr, betas=BETAS)
    trajectory = _steps(opt, p, grads)
    t = len(grads)
    m_hat = sum((1 - BETAS[0]) * BETAS[0] ** (t - i) * grads[i - 1] for i in range(1, t + 1)) / (
        1 - BETAS[0] ** t
    )
    move = trajectory[-1] - (trajectory[-2] if t > 1 else 0)
    return -lr * m_hat / move


def test_adam_bc_step_size_is_unbiased_where_blackbox_adam_is_not() -> None:
    """True gradient 1 (v̂* = 1) plus noise: E[D²] is v̂* for DP-AdamBC, v̂* + Φ for black-box Adam."""
    seeds, steps, noise_std = 20_000, 20, 0.3
    gen = torch.Generator().manual_seed(3)
    grads = [1 + noise_std * torch.randn(seeds, generator=gen, dtype=torch.float64) for _ in range(steps)]
    for name, expected in (("adam_bc", 1.0), ("adam", 1.0 + noise_std**2)):
        d2 = _denominators(name, noise_std, grads) ** 2
        assert abs(d2.mean().item() - expected) < 5 * d2.std().item() / math.sqrt(seeds), name


@pytest.mark.parametrize(("steps", "expected"), [(1, 0.6827), (50, 0.5266)])
def test_pure_noise_hits_the_floor_about_half_of_the_time(steps: int, expected: float) -> None:
    """Zero true gradient: v̂ − Φ is centred at 0, so D = ε on about half the coordinates (Ganesh et al. report 45–50%).

    v̂_t ≈ Φ·χ²_k/k with k = t effective samples at β2 = 0.999, so P(floor) = P(χ²_k < k): 0.6827 at k = 1
    (= P(|Z| < 1)) and 0.5266 at k = 50. Black-box Adam never gets near ε (its D ≈ σC/B̄).
    """
    coords, noise_std, eps = 20_000, 0.01, 1e-4
    gen = torch.Generator().manual_seed(4)
    grads = [noise_std * torch.randn(coords, generator=gen, dtype=torch.float64) for _ in range(steps)]
    floored = (_denominators("adam_bc", noise_std, grads) - eps).abs() < 1e-6 * eps
    assert abs(floored.double().mean().item() - expected) < 0.02
    blackbox = _denominators("adam", noise_std, grads) ** 2  # ≈ v̂, whose mean is Φ when v̂* = 0
    assert abs(blackbox.mean().item() - noise_std**2) < 5 * blackbox.std().item() / math.sqrt(coords)


def test_state_is_fp32_with_bf16_params_also_after_a_checkpoint() -> None:
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    opt = AdamBC([p], noise_std=0.01, lr=1e-3)
    g = torch.full((8,), 0.0103, dtype=torch.bfloat16)
    _steps(opt, p, [g, g])
    state = opt.state[p]
    assert state["exp_avg_sq"].dtype == state["exp_avg"].dtype == torch.float32
    # v_2 = (1−β2)(1+β2)·g² of the bf16 gradient, to fp32 accuracy (bf16 state would be off by ~4e-3)
    expected = (1 - BETAS[1]) * (1 + BETAS[1]) * g.double() ** 2
    assert torch.allclose(state["exp_avg_sq"].double(), expected, rtol=1e-6, atol=0)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    q = torch.nn.Parameter(p.detach().clone())
    fresh = AdamBC([q], noise_std=0.01, lr=1e-3)
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert fresh.state[q]["exp_avg_sq"].dtype == torch.float32  # torch alone would cast it to bf16
    assert torch.equal(fresh.state[q]["exp_avg_sq"], state["exp_avg_sq"])


@pytest.mark.parametrize("split", [1, 4])
def test_checkpoint_round_trip_continues_bit_identically(split: int) -> None:
    gen = torch.Generator().manual_seed(5)
    grads = [0.05 * torch.randn(4, 3, generator=gen) for _ in range(8)]
    start = torch.randn(4, 3, generator=gen)
    kwargs = {"noise_std": 0.05, "lr": 1e-2, "weight_decay": 0.01}

    p = torch.nn.Parameter(start.clone())
    uninterrupted = _steps(AdamBC([p], **kwargs), p, grads)[-1]

    p = torch.nn.Parameter(start.clone())
    opt = AdamBC([p], **kwargs)
    _steps(opt, p, grads[:split])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    assert set(opt.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    q = torch.nn.Parameter(p.detach().clone())
    resumed = AdamBC([q], noise_std=1.0, lr=1.0)  # hyperparameters come back from the checkpoint
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert torch.equal(_steps(resumed, q, grads[split:])[-1], uninterrupted)


@pytest.mark.parametrize("noise_std", [0.0, -1.0, None])
def test_refuses_without_noise_std_in_one_line(noise_std: float | None) -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"^adam_bc needs noise_std = σC/B̄ > 0") as error:
        make_dp_optimizer("adam_bc", [p], mean_noise_std=noise_std)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="noise_std"):
        make_dp_optimizer("adam_bc", [p])  # the factory's default noise_std is 0


def test_factory_builds_adam_bc_with_paper_defaults() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = make_dp_optimizer("adam_bc", [p], mean_noise_std=0.1, lr=3e-4)
    assert isinstance(opt, AdamBC)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["noise_std"]) == (
        3e-4,
        BETAS,
        1e-4,
        0.0,
        0.1,
    )
    with pytest.raises(ValueError, match="eps"):
        make_dp_optimizer("adam_bc", [p], mean_noise_std=0.1, eps=0.0)
    with pytest.raises(ValueError, match="does not accept"):
        make_dp_optimizer("adam_bc", [p], mean_noise_std=0.1, momentum=0.9)
