"""Every dp_optimizer through DPTrainer: it trains, costs exactly DP-SGD's ε, and DiSK's plan (two evaluations
at θ + γd and θ, the combination clipped once, the filter, d = the real displacement) runs as specified."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dp import compute_epsilon
from hf_dp.optim.registry import dp_optimizer_names
from tests import models, oracle
from tests.trainer_utils import make_trainer, pad_collate, sampled_logical_batches, snapshot

# the kwargs a rule is also trained with on the tiny GPT-2 (DP² cycles every 2 steps here); every registered
# rule trains with its defaults too
KWARGS = {
    "sgd": {"momentum": 0.9},
    "dp2": {"sgd_steps": 1, "adaptive_steps": 1, "adaptive_clip_norm": 2.0},
    "doppler": {"base": "adam_bc"},
}
CASES = [pytest.param(name, None, id=f"{name}-defaults") for name in dp_optimizer_names()] + [
    pytest.param(name, kwargs, id=f"{name}-kwargs") for name, kwargs in KWARGS.items()
]


def test_the_kwargs_name_registered_rules():
    assert set(KWARGS) <= set(dp_optimizer_names())


def test_importing_the_registry_alone_registers_every_built_in_rule():
    """The registry imports no rule; importing it runs ``hf_dp.optim``'s ``__init__``, which registers them."""
    code = (
        "import hf_dp.optim.registry as r; "
        "print(','.join(r.dp_optimizer_names())); "
        "print(','.join(n for n in r.dp_optimizer_names() if r.scaled_geometry(n))); "
        "print(','.join(n for n in r.dp_optimizer_names() if r.shifted_evaluations(n)))"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    names, scaled, shifted = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=root, env=env
    ).stdout.split()
    assert names.split(",") == list(dp_optimizer_names())
    assert scaled == "dp2,stp" and shifted == "disk"


def test_each_rule_has_one_record():
    from hf_dp.optim.dp2 import DP2
    from hf_dp.optim.registry import rule_spec

    spec = rule_spec("dp2")
    assert spec.rule_class is DP2 and spec.scaled_geometry and not spec.shifted_evaluations
    assert rule_spec("disk").shifted_evaluations and not rule_spec("disk").scaled_geometry
    with pytest.raises(ValueError, match="unknown dp_optimizer 'nope'"):
        rule_spec("nope")


@pytest.mark.parametrize(("name", "kwargs"), CASES)
def test_each_optimizer_trains_through_dptrainer_at_dp_sgd_epsilon(tmp_path, name, kwargs):
    """Every registered rule trains, with its defaults (no dp_optimizer_kwargs) and with the kwargs above: the
    parameters move and stay finite. Post-processing and per-step clip norms cost nothing extra: ε is DP-SGD's
    for the same σ, q, steps."""
    torch.manual_seed(3)
    model = models.gpt2()
    before = snapshot(model)
    trainer = make_trainer(
        tmp_path,
        model=model,
        noise_multiplier=1.0,
        max_steps=3,
        learning_rate=0.05 if name in ("sgd", "dp2") else 1e-3,
        dp_optimizer=name,
        **({} if kwargs is None else {"dp_optimizer_kwargs": kwargs}),
    )
    assert trainer.args.dp_optimizer_kwargs == ({} if kwargs is None else kwargs)
    trainer.train()
    moved = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert moved and all(torch.isfinite(p).all() for p in model.parameters())
    expected = compute_epsilon(1.0, trainer.sample_rate, 3, trainer.target_delta, "prv")
    assert trainer.accountant.steps == 3
    assert trainer.get_epsilon() == pytest.approx(expected, rel=1e-9)
    assert all(math.isfinite(log["epsilon"]) for log in trainer.state.log_history if "loss" in log)


def _count_heap_requests(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr("hf_dp.run.keep_freed_memory", lambda: calls.append(1))
    return calls


def test_disk_with_kappa_one_is_its_base_bit_for_bit(tmp_path, monkeypatch):
    """κ = 1: c = 0, one evaluation at θ, g̃ = ĝ: exactly AdamW, noise included (same seed), and the CPU
    heap is left alone (only two evaluations per step ask glibc to keep freed memory)."""
    heap_requests = _count_heap_requests(monkeypatch)
    final = {}
    for name, kwargs in (("adamw", {}), ("disk", {"kappa": 1.0, "base": "adamw"})):
        torch.manual_seed(4)
        model = models.gpt2()
        make_trainer(
            tmp_path / name,
            model=model,
            noise_multiplier=1.0,
            max_steps=3,
            learning_rate=1e-2,
            dp_optimizer=name,
            dp_optimizer_kwargs=kwargs,
            insecure_dp_seed=4,  # the same batches and noise for both
        ).train()
        final[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(final["adamw"], final["disk"])
    assert not heap_requests


def test_disk_two_steps_equal_the_algorithm_written_out(tmp_path, monkeypatch):
    """σ = 0, base SGD, 2 micro-batches per step. Step 1: d = 0, one evaluation. Step 2: per example
    u_i = c∇L_i(θ₁ + γd₀) + (1−c)∇L_i(θ₁) clipped ONCE (brute force: one backward per example and point),
    g̃₁ = (1−κ)g̃₀ + κ g₁, θ₂ = θ₁ − lr g̃₁ with d₀ = θ₁ − θ₀ the real displacement."""
    kappa, gamma, lr, clip = 0.7, 0.5, 0.5, 0.5
    c = (1 - kappa) / (kappa * gamma)
    heap_requests = _count_heap_requests(monkeypatch)
    torch.manual_seed(5)
    model = models.gpt2().double()
    reference = models.gpt2().double()
    reference.load_state_dict(model.state_dict())
    trainer = make_trainer(
        tmp_path,
        model=model,
        noise_multiplier=0.0,
        max_steps=2,
        learning_rate=lr,
        per_sample_max_grad_norm=clip,
        dp_optimizer="disk",
        dp_optimizer_kwargs={"kappa": kappa, "gamma": gamma, "base": "sgd"},
    )
    first, second = sampled_logical_batches(trainer, 2)
    batch_size = trainer.expected_batch_size
    params = dict(reference.named_parameters())

    def clipped_mean(indices, evaluations):
        batch = pad_collate([trainer.train_dataset[i] for i in indices])
        total, _ = oracle.per_example(reference, batch, clip, evaluations=evaluations)
        return {n: g / batch_size for n, g in total.items()}

    g0 = clipped_mean(first, ((1.0, None),))
    with torch.no_grad():
        theta0 = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p -= lr * g0[n]  # g̃₀ = g₀
        d0 = {params[n]: gamma * (params[n] - theta0[n]) for n in params}
    g1 = clipped_mean(second, ((c, d0), (1 - c, None)))
    # the combination really has two points: the gradient at θ₁ alone differs
    alone = clipped_mean(second, ((1.0, None),))
    assert max((alone[n] - g1[n]).abs().max().item() for n in g1) > 1e-6
    with torch.no_grad():
        for n, p in params.items():
            p -= lr * ((1 - kappa) * g0[n] + kappa * g1[n])

    trainer.train()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[n].detach(), rtol=1e-9, atol=1e-12, msg=n)
    assert heap_requests  # step 2 evaluated twice, on CPU


def test_parameter_shifter_evaluates_at_the_shift_and_restores_theta_exactly():
    """Inside: every parameter is θ + scale·d. After: the very tensor θ was (same storage, same bits). A θ
    written in place under the same plan (a loaded checkpoint) is noticed and the shifted point recomputed."""
    from hf_dp.clipping.plan import Shift
    from hf_dp.clipping.shifts import ParameterShifter

    torch.manual_seed(6)
    model = models.gpt2()
    params = list(model.parameters())
    theta = {p: p.detach().clone() for p in params}
    pointers = {p: p.data_ptr() for p in params}
    shift = Shift(0.3, {p: torch.randn_like(p) for p in params})
    shifter = ParameterShifter()
    for _ in range(2):  # the second use of the same plan reuses the filled buffers
        with shifter(shift):
            for p in params:
                torch.testing.assert_close(
                    p.detach(), theta[p] + 0.3 * shift.directions[p], rtol=0, atol=1e-6
                )
        assert all(torch.equal(p.detach(), theta[p]) and p.data_ptr() == pointers[p] for p in params)
    with torch.no_grad():
        params[0].add_(1.0)
    with shifter(shift):
        torch.testing.assert_close(
            params[0].detach(), theta[params[0]] + 1.0 + 0.3 * shift.directions[params[0]], rtol=0, atol=1e-6
        )


def test_a_users_registered_rule_trains_through_dptrainer(tmp_path, monkeypatch):
    from hf_dp.optim import registry

    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))  # the registration ends with the test
    seen = {}

    @registry.register_dp_optimizer("sign_sgd")
    def build_sign_sgd(params, *, mean_noise_std, lr=1e-3):
        seen["mean_noise_std"] = mean_noise_std
        return torch.optim.SGD(params, lr=lr)  # a stand-in update rule

    assert "sign_sgd" in registry.dp_optimizer_names()
    assert not registry.scaled_geometry("sign_sgd") and not registry.shifted_evaluations("sign_sgd")
    trainer = make_trainer(tmp_path, noise_multiplier=1.0, dp_optimizer="sign_sgd", learning_rate=0.1)
    trainer.train()
    assert trainer.accountant.steps == 2
    assert seen["mean_noise_std"] == pytest.approx(1.0 * 0.5 / trainer.expected_batch_size)
    with pytest.raises(ValueError, match="'momentum'"):
        registry.make_dp_optimizer("sign_sgd", [torch.nn.Parameter(torch.zeros(2))], momentum=0.9)
