"""DP-BandMF: the correlated noise, its cyclic Poisson sampling and its accounting, measured from outside.

References: brute force (the strategy matrix materialised and inverted with numpy), dp_accounting (DP-SGD's
ε for ⌈n/b⌉ steps at p = bB̄/N) and jax-privacy 2.0's amplified BandMF event.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import TrainerCallback

from hf_dp import DPTrainer
from hf_dp.accounting import PrivacyAccountant
from hf_dp.bandmf import banded_strategy
from hf_dp.clipping.plan import StepPlan
from hf_dp.clipping.sums import ClippedSums
from hf_dp.mechanism import BandMFMechanism, GaussianMechanism
from hf_dp.noise import GaussianNoise
from hf_dp.optim.registry import dp_optimizer_names
from tests.trainer_utils import make_args

D_IN, D_OUT = 64, 128  # 8192 noised coordinates per step


def _strategy_matrix(coefs, n: int) -> np.ndarray:
    """C: n×n lower-triangular banded Toeplitz, C[t, t−j] = c_j."""
    matrix = np.zeros((n, n))
    for j, c in enumerate(coefs):
        matrix += np.diag(np.full(n - j, c), -j)
    return matrix


def _mechanism(coefs=None, sigma: float = 1.5, cls=BandMFMechanism, **kwargs) -> GaussianMechanism:
    options = (
        {} if cls is GaussianMechanism else {"strategy": banded_strategy(24, 4) if coefs is None else coefs}
    )
    return cls(
        noise_multiplier=sigma,
        expected_batch_size=1,
        sample_rate=0.5,
        noise=GaussianNoise(3),
        accountant=PrivacyAccountant("rdp", 1e-5),
        **options,
        **kwargs,
    )


def _release_steps(mechanism: GaussianMechanism, steps: int, shapes=((4000,), (30, 200))) -> np.ndarray:
    """The noise of ``steps`` releases on zero clipped sums: (steps, coordinates)."""
    params = [nn.Parameter(torch.zeros(shape)) for shape in shapes]
    plan = StepPlan(clip_norm=0.5)
    rows = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.zeros_like(p)
        mechanism.release(params, plan, ClippedSums())
        mechanism.account()
        mechanism.end_step()
        rows.append(torch.cat([p.grad.reshape(-1) for p in params]).double().numpy())
    return np.stack(rows)


def test_released_noise_has_the_strategys_covariance_across_steps():
    """Cov(x) = σ²C²·C⁻¹C⁻ᵀ, C materialised and inverted with numpy; dropping the buffers (x = z/c_0) fails."""
    n, strategy = 12, banded_strategy(12, 4)
    noise = _release_steps(_mechanism(strategy), n)
    measured = noise @ noise.T / noise.shape[1]
    inverse = np.linalg.inv(_strategy_matrix(strategy.coefs, n))
    expected = (1.5 * 0.5) ** 2 * inverse @ inverse.T
    # each entry is a mean of 10000 products: std sqrt((Σ_ii Σ_jj + Σ_ij²)/d)
    d = noise.shape[1]
    tolerance = 5 * np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / d)
    assert (np.abs(measured - expected) <= tolerance).all()
    # what noise-aware rules are told: the root mean square of x_t's std over the n steps
    assert strategy.marginal_std**2 == pytest.approx(np.diag(inverse @ inverse.T).mean(), rel=1e-12)
    dropped = (1.5 * 0.5 / strategy.coefs[0]) ** 2 * np.eye(n)  # a mechanism that lost its buffers
    assert (np.abs(measured - dropped) > tolerance).sum() > n


def test_one_band_is_the_independent_mechanism_bit_for_bit():
    independent = _release_steps(_mechanism(cls=GaussianMechanism), 5)
    one_band = _release_steps(_mechanism(banded_strategy(24, 1)), 5)
    assert np.array_equal(independent, one_band)


def test_the_buffers_hold_b_minus_one_outputs_in_float32_and_can_live_on_the_cpu():
    mechanism = _mechanism(buffers_on_cpu=True)
    _release_steps(mechanism, 6, shapes=((1000,), (10, 10)))
    assert mechanism.buffer_bytes() == 3 * 1100 * 4
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for past in mechanism._past for t in past)


def test_the_ledger_takes_one_step_every_b_releases():
    mechanism = _mechanism()
    _release_steps(mechanism, 9, shapes=((10,),))
    assert mechanism.accountant.history == [(1.5, 0.5, 3)]  # steps 0, 4, 8


def test_a_restored_mechanism_continues_the_same_noise_sequence():
    whole = _release_steps(_mechanism(), 9)
    first = _mechanism()
    head = _release_steps(first, 5)
    state = first.state_dict()
    resumed = _mechanism()
    resumed.load_state_dict(state)
    tail = _release_steps(resumed, 4)
    assert np.array_equal(np.concatenate([head, tail]), whole)
    other = _mechanism(banded_strategy(24, 2))
    with pytest.raises(ValueError, match="not this run's BandMF strategy"):
        other.load_state_dict(state)


def test_a_changed_parameter_is_refused():
    mechanism = _mechanism()
    _release_steps(mechanism, 1, shapes=((10,),))
    with pytest.raises(RuntimeError, match="trainable parameters changed"):
        _release_steps(mechanism, 1, shapes=((11,),))


# ---- a DPTrainer run, measured through its released updates ------------------------------------------------


class ZeroInputs(Dataset):
    """Rows whose gradient is exactly zero (input 0 into a bias-free linear layer): the update is the noise."""

    def __init__(self, n: int, rows_per_user: int = 1) -> None:
        self.n, self.rows_per_user = n, rows_per_user

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"x": torch.zeros(D_IN), "row": i, "user_id": i // self.rows_per_user}


class NoiseProbeTrainer(DPTrainer):
    seen: list[list[int]]

    def compute_per_example_loss(self, model, inputs):
        if model.training:  # not the first step's check of examples alone (in eval mode)
            self.seen.append(inputs["row"].tolist())
        return (model(inputs["x"]) ** 2).sum(-1)


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    if not examples:
        return {"x": torch.zeros(0, D_IN), "row": torch.zeros(0, dtype=torch.long)}
    return {"x": torch.stack([e["x"] for e in examples]), "row": torch.tensor([e["row"] for e in examples])}


def _probe_run(tmp_path, steps: int, dataset=None, **overrides):
    """A run of ``steps`` SGD steps at lr 1 with batches of expected size 4 from N = 64: ΔW_t = −x_t/B̄."""
    torch.manual_seed(0)
    model = nn.Linear(D_IN, D_OUT, bias=False)
    settings = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1.0,
        "max_steps": steps,
        "per_sample_max_grad_norm": 1.0,
        "insecure_dp_seed": 5,
        "remove_unused_columns": False,
    }
    args = make_args(tmp_path, **{**settings, **overrides})
    dataset = ZeroInputs(64) if dataset is None else dataset
    trainer = NoiseProbeTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    trainer.seen = []
    weights = [model.weight.detach().clone()]

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            weights.append(model.weight.detach().clone())

    trainer.add_callback(Snapshot())
    trainer.train()
    updates = torch.stack([b - a for a, b in zip(weights, weights[1:], strict=False)])
    released = -updates.reshape(steps, -1).double().numpy() * trainer.expected_batch_size
    return trainer, released


def test_bar_a_bandmf_run_measured_from_outside(tmp_path):
    """noise_mechanism='bandmf', num_bands=4: a 4-banded strategy with column norms ≤ 1 (recovered from the
    released noise's covariance), noise correlated across steps with less noisy prefix sums than independent
    noise, every example only in steps of one residue mod 4, and ε = DP-SGD's for ⌈n/4⌉ steps at p = 4B̄/N."""
    n, sigma = 16, 1.0
    trainer, released = _probe_run(
        tmp_path, n, noise_mechanism="bandmf", num_bands="4", noise_multiplier=sigma, accountant="rdp"
    )
    d = released.shape[1]
    covariance = released @ released.T / d  # (n, n) across steps
    gram = np.linalg.inv(covariance) * sigma**2  # σ²C²·(C⁻¹C⁻ᵀ)⁻¹ / σ²C² = CᵀC, C = 1
    column_norms = np.sqrt(np.diag(gram))
    assert column_norms.max() <= 1 + 6 * math.sqrt(2 / d) and column_norms.max() >= 1 - 6 * math.sqrt(2 / d)
    far = np.abs(np.triu(gram, 4))  # CᵀC of a 4-banded C is zero beyond |i − j| ≥ 4
    assert far.max() < 6 * math.sqrt(2 / d) * gram.diagonal().max()
    assert np.abs(np.diag(gram, 3)).max() > 10 * math.sqrt(2 / d)  # and not 3-banded
    prefix = np.cumsum(released, axis=0).var(axis=1)
    independent = sigma**2 * np.arange(1, n + 1)
    assert (prefix[4:] < 0.8 * independent[4:]).all()
    assert abs(np.corrcoef(released[0], released[1])[0, 1]) > 0.2
    # every example only in steps of one residue mod 4
    residues: dict[int, set[int]] = {}
    for step, rows in enumerate(trainer.seen):
        for row in rows:
            residues.setdefault(row, set()).add(step % 4)
    assert residues and all(len(r) == 1 for r in residues.values())
    # ε: DP-SGD with ⌈16/4⌉ = 4 steps at p = 4·4/64, by dp_accounting
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(sigma)), 4
    )
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(event)
    expected = rdp.get_epsilon(trainer.privacy_plan.delta)
    assert trainer.get_epsilon() == pytest.approx(expected, rel=0.03)
    assert trainer.privacy_plan.sample_rate == 0.25


def test_epsilon_and_calibration_match_jax_privacy_amplified_bandmf(tmp_path):
    """The run's ε (PRV and RDP) equals dp_accounting on jax-privacy's amplified BandMF event; σ calibrated for a
    target ε spends it."""
    import dp_accounting
    from jax_privacy.experimental import accounting as jp

    for accountant in ("prv", "rdp"):
        trainer, _ = _probe_run(
            tmp_path / accountant,
            10,
            noise_mechanism="bandmf",
            num_bands="4",
            target_epsilon=3.0,
            accountant=accountant,
        )
        plan = trainer.privacy_plan
        event = jp.amplified_bandmf_event(
            noise_multiplier=plan.noise_multiplier, iterations=10, num_bands=4, sampling_prob=plan.sample_rate
        )
        reference = (
            dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
            if accountant == "prv"
            else dp_accounting.rdp.RdpAccountant()
        )
        reference.compose(event)
        assert trainer.get_epsilon() == pytest.approx(reference.get_epsilon(plan.delta), rel=0.03)
        assert trainer.get_epsilon() == pytest.approx(3.0, rel=0.03)


def test_the_default_mechanism_is_unchanged_and_one_band_equals_it(tmp_path):
    _, default = _probe_run(tmp_path / "default", 3, noise_multiplier=1.0)
    _, one_band = _probe_run(
        tmp_path / "one", 3, noise_multiplier=1.0, noise_mechanism="bandmf", num_bands="1"
    )
    assert np.array_equal(default, one_band)
    np.testing.assert_allclose(default.std(axis=1), 1.0, rtol=0.05)
    assert abs(np.corrcoef(default[0], default[1])[0, 1]) < 0.05


def test_users_are_sampled_cyclically_as_units(tmp_path):
    """User-level DP with 4 bands: the 24 users (3 rows each) split into 4 groups; all of a user's rows appear only
    in steps of its residue; the ledger is DP-SGD's over ⌈12/4⌉ steps at p = 4·4/24."""
    trainer, _ = _probe_run(
        tmp_path,
        12,
        dataset=ZeroInputs(72, rows_per_user=3),
        noise_mechanism="bandmf",
        num_bands="4",
        noise_multiplier=1.0,
        privacy_unit_column="user_id",
        max_examples_per_unit=3,
        accountant="rdp",
    )
    residues: dict[int, set[int]] = {}
    for step, rows in enumerate(trainer.seen):
        for row in rows:
            residues.setdefault(row // 3, set()).add(step % 4)
    assert len(residues) > 12 and all(len(r) == 1 for r in residues.values())
    report = trainer.privacy_report()
    assert report["unit"] == "user" and report["sampling"] == "cyclic poisson over 4 groups"
    assert trainer.accountant.history == [(1.0, pytest.approx(16 / 24), 3)]


def test_the_budget_stop_counts_only_the_steps_that_spend():
    """With 4 bands only steps 0, 4, 8, … take a ledger step: a budget that holds 3 of them runs 12 steps and stops
    before step 12, the first that would spend a 4th."""
    from types import SimpleNamespace

    from hf_dp.accounting import compute_epsilon
    from hf_dp.budget import PrivacyBudgetCallback

    accountant = PrivacyAccountant("rdp", 1e-5)
    plan = SimpleNamespace(
        private=True, noise_multiplier=1.0, sample_rate=0.25, bands=4, ledger_steps=lambda t: -(-t // 4)
    )
    run = SimpleNamespace(plan=plan, accountant=accountant, epsilon=accountant.get_epsilon)
    budget = PrivacyBudgetCallback(run)
    args = SimpleNamespace(target_epsilon=compute_epsilon(1.0, 0.25, 3, 1e-5, "rdp") * 1.0001)
    state = SimpleNamespace(global_step=0, max_steps=40)
    control = SimpleNamespace(should_training_stop=False)
    budget.on_train_begin(args, state, control)
    while not control.should_training_stop and state.global_step < state.max_steps:
        if state.global_step % 4 == 0:
            accountant.step(1.0, 0.25)
        state.global_step += 1
        budget.on_step_end(args, state, control)
    assert accountant.steps == 3 and state.global_step == 12
    assert accountant.get_epsilon() <= args.target_epsilon < accountant.epsilon_after(1.0, 0.25)
    ended = SimpleNamespace(global_step=12, max_steps=12)  # the planned end: no early-stop warning
    control.should_training_stop = False
    budget.on_step_end(args, ended, control)
    assert not control.should_training_stop


@pytest.mark.parametrize("rule", dp_optimizer_names())
def test_every_update_rule_takes_the_correlated_release(tmp_path, rule):
    """Post-processing: every registered rule trains on BandMF's release (2 bands, 4 steps), its parameters move
    and the ledger holds ⌈4/2⌉ steps."""
    kwargs = {"dp_optimizer": rule, "learning_rate": 1e-2}
    trainer, released = _probe_run(
        tmp_path, 4, noise_mechanism="bandmf", num_bands="2", noise_multiplier=1.0, accountant="rdp", **kwargs
    )
    assert np.isfinite(released).all() and np.abs(released).sum(axis=1).min() > 0
    assert trainer.accountant.steps == 2 and trainer.dp.mechanism.step == 4


def test_the_guarantee_names_the_mechanism_wherever_it_is_stated(tmp_path, caplog):
    """The model card, privacy_report(), the train metrics and the start log line: the mechanism, b, the cyclic
    Poisson sampling over b groups and the amplified accounting."""
    from hf_dp.hub import privacy_metadata, privacy_section

    with caplog.at_level("INFO", logger="hf_dp"):
        trainer, _ = _probe_run(tmp_path, 8, noise_mechanism="bandmf", num_bands="4", noise_multiplier=1.0)
    report = trainer.privacy_report()
    assert report["noise_mechanism"] == "bandmf" and report["num_bands"] == 4
    assert report["sampling"] == "cyclic poisson over 4 groups" and len(report["strategy_coefs"]) == 4
    assert "ceil(n/4) = 2 steps" in report["accounting"] and report["steps"] == 8
    section = privacy_section(report)
    assert "cyclic Poisson sampling" in section and "4-banded Toeplitz strategy (DP-BandMF" in section
    meta = privacy_metadata(report)
    assert meta["noise_mechanism"] == "bandmf" and meta["num_bands"] == 4
    metrics = trainer.privacy_metrics()
    assert metrics["noise_mechanism"] == "bandmf" and metrics["num_bands"] == 4
    assert any(
        "bandmf noise with 4 bands, cyclic Poisson sampling over 4 groups" in r.message
        for r in caplog.records
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_bands": "32"}, "num_bands=32 exceeds the 16 planned steps"),
        ({"num_bands": "8", "per_device_train_batch_size": 16}, "num_bands=8 exceeds N/B̄ = 2"),
        ({"noise_mechanism": "laplace", "num_bands": "auto"}, "noise_mechanism='laplace' is unknown"),
    ],
)
def test_what_bandmf_cannot_account_is_refused_before_training(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message) as info:  # by the arguments (a name) or the trainer (a plan)
        args = make_args(
            tmp_path,
            noise_multiplier=1.0,
            max_steps=16,
            **{"noise_mechanism": "bandmf", "num_bands": "4", **overrides},
        )
        NoiseProbeTrainer(model=nn.Linear(D_IN, D_OUT, bias=False), args=args, train_dataset=ZeroInputs(64))
    assert "\n" not in str(info.value)


def test_a_run_resumed_mid_run_continues_bit_for_bit(tmp_path):
    """Saved after step 3 of 8 (4 bands: the buffers then hold x_0..x_2), resumed by a new trainer: the same
    released noise at steps 4..8 and the same final weights, bit for bit; the buffers sit only in the private
    noise state."""
    from hf_dp.checkpoint import load_noise_state

    bandmf = {"noise_mechanism": "bandmf", "num_bands": "4", "noise_multiplier": 1.0}
    whole, released = _probe_run(tmp_path / "whole", 8, save_strategy="steps", save_steps=3, **bandmf)
    checkpoint = tmp_path / "whole" / "out" / "checkpoint-3"
    saved = load_noise_state(str(checkpoint), 0)
    assert len(saved["past"][0]) == 3 and saved["step"] == 3
    assert not any("noise" in f.name for f in (tmp_path / "whole" / "out").iterdir() if f.is_file())
    torch.manual_seed(0)
    model = nn.Linear(D_IN, D_OUT, bias=False)
    args = make_args(
        tmp_path / "resumed",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=1.0,
        max_steps=8,
        per_sample_max_grad_norm=1.0,
        insecure_dp_seed=5,
        remove_unused_columns=False,
        **bandmf,
    )
    resumed = NoiseProbeTrainer(model=model, args=args, train_dataset=ZeroInputs(64), data_collator=collate)
    resumed.seen = []
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert torch.equal(resumed.model.weight, whole.model.weight)
    assert resumed.seen == whole.seen[3:]
    assert resumed.get_epsilon() == whole.get_epsilon() and resumed.accountant.steps == 2
