"""DPTrainer end to end: updates equal brute force, noise, accounting, logging, resume, budget, errors."""

from __future__ import annotations

import logging
import math
import warnings

import dp_accounting
import pytest
import torch
from transformers import Trainer

from hf_dp import DPTrainer, DPTrainerMixin
from hf_dp.losses import per_example_loss
from tests import models, oracle
from tests.trainer_utils import (
    TokenRows,
    make_trainer,
    pad_collate,
    sampled_logical_batches,
    snapshot,
)


def brute_force_update(model, dataset, indices, max_norm, expected_batch):
    """Σ_{i in batch} clip(∇L_i, C) / B̄, each example run alone in its own forward and backward."""
    batch = pad_collate([dataset[i] for i in indices])
    total, _ = oracle.per_example(model, batch, max_norm)
    return {n: g / expected_batch for n, g in total.items()}


@pytest.mark.parametrize("accumulation", [1, 3])
def test_one_step_equals_brute_force_whatever_the_accumulation(tmp_path, accumulation):
    """Noise-free step: θ₁ = θ₀ − lr Σ_i clip(g_i)/B̄. Equal for 1 and 3 micro-batches, so the Trainer's
    division of the loss by the accumulation steps and its token normalisation are neutralised."""
    torch.manual_seed(1)
    model = models.gpt2().double()  # float64, so that θ₀ − θ₁ resolves the step exactly
    trainer = make_trainer(
        tmp_path,
        model=model,
        noise_multiplier=0.0,
        max_steps=1,
        per_device_train_batch_size=12 // accumulation,
        gradient_accumulation_steps=accumulation,
    )
    before = snapshot(model)
    (indices,) = sampled_logical_batches(trainer, 1)
    reference_model = models.gpt2().double()
    reference_model.load_state_dict(model.state_dict())
    expected = brute_force_update(
        reference_model, trainer.train_dataset, indices, 0.5, trainer.expected_batch_size
    )
    trainer.train()
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            continue
        step = (before[name] - p.detach()) / 0.5
        torch.testing.assert_close(step, expected[name], rtol=1e-9, atol=1e-13, msg=name)


def test_per_example_token_mean_differs_from_batch_token_mean():
    """Sensitivity check for the test above: HF's batch token mean would give a different gradient."""
    model = models.gpt2()
    batch = pad_collate([TokenRows(8)[i] for i in range(8)])
    ours = torch.autograd.grad(per_example_loss(model, batch).mean(), model.transformer.wte.weight)[0]
    theirs = torch.autograd.grad(model(**batch).loss, model.transformer.wte.weight)[0]
    assert (ours - theirs).norm() > 1e-3 * ours.norm()


def test_noise_std_is_sigma_c_over_expected_batch(tmp_path):
    """Same seed with and without noise: the update difference is lr·N(0, (σC/B̄)²) per coordinate."""
    sigma, clip = 2.0, 0.3
    runs = {}
    for s in (0.0, sigma):
        torch.manual_seed(3)
        model = models.gpt2()
        trainer = make_trainer(
            tmp_path,
            model=model,
            noise_multiplier=s,
            per_sample_max_grad_norm=clip,
            max_steps=1,
            learning_rate=1.0,
            insecure_dp_seed=11,  # the same batches in both runs, so the difference is the noise alone
        )
        trainer.train()
        runs[s] = torch.cat(
            [p.detach().flatten() for n, p in model.named_parameters() if n != "lm_head.weight"]
        )
    noise = runs[0.0] - runs[sigma]
    expected = sigma * clip / trainer.expected_batch_size
    assert noise.numel() > 8_000
    assert abs(noise.std().item() / expected - 1) < 0.03
    assert abs(noise.mean().item()) < 4 * expected / math.sqrt(noise.numel())
    halves = noise[: noise.numel() // 2 * 2].view(2, -1)
    assert abs(torch.corrcoef(halves)[0, 1].item()) < 0.03


def _dp_accounting_epsilon(sigma, q, steps, delta, accountant):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    if accountant == "rdp":
        acc = dp_accounting.rdp.RdpAccountant()
    else:
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    return acc.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_calibrated_sigma_and_reported_epsilon_match_dp_accounting(tmp_path, accountant):
    trainer = make_trainer(tmp_path, target_epsilon=3.0, accountant=accountant, max_steps=6)
    independent = _dp_accounting_epsilon(
        trainer.noise_multiplier, trainer.sample_rate, 6, trainer.target_delta, accountant
    )
    assert 0.97 * 3.0 <= independent <= 1.01 * 3.0
    trainer.train()
    assert trainer.state.global_step == 6
    assert trainer.get_epsilon() == pytest.approx(independent, rel=0.01)
    assert trainer.target_delta == pytest.approx(32**-1.1)


def test_every_log_line_carries_epsilon_and_no_unnoised_grad_norm(tmp_path):
    trainer = make_trainer(tmp_path, target_epsilon=5.0, max_steps=3)
    trainer.train()
    history = trainer.state.log_history
    assert len(history) == 4
    epsilons = [h["epsilon"] for h in history]
    assert all(0 < e <= 5.0 for e in epsilons)
    assert epsilons[:3] == sorted(epsilons[:3]) and epsilons[0] < epsilons[2]
    assert all(h.get("grad_norm") is None for h in history)


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    """Adam state, noise generator, sampler position, dropout RNG and accountant all come back."""
    common = dict(
        noise_multiplier=1.0,
        dp_optimizer="adamw",
        learning_rate=1e-2,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
    )
    torch.manual_seed(5)
    model = models.gpt2(resid_pdrop=0.1)
    initial = model.state_dict()
    full = make_trainer(tmp_path / "full", model=model, **common)
    full.train()
    torch.manual_seed(5)
    fresh = models.gpt2(resid_pdrop=0.1)
    fresh.load_state_dict(initial)
    resumed = make_trainer(tmp_path / "full", model=fresh, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-3"))
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    assert resumed.get_epsilon() == pytest.approx(full.get_epsilon(), rel=1e-12)
    assert resumed.accountant.steps == 6
    losses = [h["loss"] for h in full.state.log_history if "loss" in h]
    resumed_losses = [h["loss"] for h in resumed.state.log_history if "loss" in h]
    assert resumed_losses[-3:] == pytest.approx(losses[-3:], rel=1e-5)


def test_training_stops_before_the_budget_would_be_exceeded(tmp_path, caplog):
    trainer = make_trainer(tmp_path, target_epsilon=2.0, max_steps=8)
    trainer.dp.set_noise_multiplier(trainer.noise_multiplier * 0.6)  # spend faster than planned
    with caplog.at_level(logging.WARNING, logger="hf_dp.trainer"):
        trainer.train()
    assert 0 < trainer.state.global_step < 8
    assert trainer.get_epsilon() <= 2.0
    assert trainer.accountant.epsilon_after(trainer.noise_multiplier, trainer.sample_rate) > 2.0
    assert any("one more step would spend epsilon" in r.message for r in caplog.records)


def test_resuming_a_spent_budget_refuses_to_train(tmp_path):
    first = make_trainer(tmp_path, target_epsilon=2.0, max_steps=3, save_strategy="steps", save_steps=3)
    first.train()
    longer = make_trainer(tmp_path, target_epsilon=2.0, max_steps=6)
    longer.dp.set_noise_multiplier(first.noise_multiplier)
    with pytest.raises(ValueError, match="privacy budget is spent"):
        longer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))


def test_poisson_batches_vary_and_drop_last_is_ignored(tmp_path):
    trainer = make_trainer(
        tmp_path,
        noise_multiplier=1.0,
        dataset=TokenRows(400),
        per_device_train_batch_size=5,
        gradient_accumulation_steps=2,
        dataloader_drop_last=True,
    )
    sizes = []
    for epoch in range(4):
        loader = trainer.get_train_dataloader()
        loader.set_epoch(epoch)
        micro = [int(b["hf_dp_example_mask"].sum()) for b in loader]
        sizes += [micro[k] + micro[k + 1] for k in range(0, len(micro), 2)]
    assert len(sizes) == 4 * 40
    assert len(set(sizes)) > 5
    assert abs(sum(sizes) / len(sizes) - 10) < 1.0


def test_empty_logical_batches_train_and_add_only_noise(tmp_path):
    """q = 0.002: a logical batch can be empty. With σ = 0 that step leaves SGD's weights exactly alone;
    with σ > 0 it still adds noise (skipping it would reveal that the batch was empty)."""
    dataset = TokenRows(1000)
    settings = dict(
        dataset=dataset, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1
    )
    seed = next(
        s
        for s in range(1000)
        if sampled_logical_batches(
            make_trainer(tmp_path, noise_multiplier=0.0, insecure_dp_seed=s, **settings), 1
        )
        == [[]]
    )
    for sigma in (0.0, 1.0):
        model = models.gpt2()
        before = snapshot(model)
        make_trainer(tmp_path, model=model, noise_multiplier=sigma, insecure_dp_seed=seed, **settings).train()
        moved = [not torch.equal(before[n], p) for n, p in model.named_parameters()]
        assert all(moved) if sigma else not any(moved)


def test_micro_batches_with_no_examples_are_skipped_but_counted(tmp_path):
    trainer = make_trainer(
        tmp_path,
        noise_multiplier=1.0,
        dataset=TokenRows(1000),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=12,
    )
    assert any(len(b) < 2 for b in sampled_logical_batches(trainer, 12))
    trainer.train()
    assert trainer.state.global_step == 12 and trainer.accountant.steps == 12


class PerExampleLossTrainer(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return per_example_loss(model, inputs)


class ScalarLossTrainer(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss


def test_subclass_compute_loss_keeps_per_example_clipping(tmp_path):
    results = []
    for cls in (DPTrainer, PerExampleLossTrainer):
        torch.manual_seed(4)
        model = models.gpt2()
        make_trainer(
            tmp_path, model=model, trainer_class=cls, noise_multiplier=0.5, insecure_dp_seed=2
        ).train()
        results.append(snapshot(model))
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], msg=name)


def test_subclass_compute_loss_returning_a_scalar_is_a_clear_error(tmp_path):
    trainer = make_trainer(tmp_path, trainer_class=ScalarLossTrainer, noise_multiplier=0.5)
    with pytest.raises(
        ValueError, match=r"compute_loss returned \(\); under DP it must return one loss per privacy unit"
    ):
        trainer.train()


def test_disable_dp_is_the_plain_mean_gradient(tmp_path):
    torch.manual_seed(6)
    model = models.gpt2().double()
    trainer = make_trainer(tmp_path, model=model, disable_dp=True, max_steps=1)
    (indices,) = sampled_logical_batches(trainer, 1)
    reference_model = models.gpt2().double()
    reference_model.load_state_dict(model.state_dict())
    expected = brute_force_update(
        reference_model, trainer.train_dataset, indices, math.inf, trainer.expected_batch_size
    )
    before = snapshot(model)
    trainer.train()
    assert math.isinf(trainer.get_epsilon())
    for name, p in model.named_parameters():
        if name != "lm_head.weight":
            torch.testing.assert_close(
                (before[name] - p.detach()) / 0.5, expected[name], rtol=1e-9, atol=1e-13, msg=name
            )


def test_secure_mode_reaches_the_noise_and_the_sampler(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0, secure_mode=True)
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.dp.mechanism.noise.secure_mode and trainer.dp.state.sampler.secure_mode
    assert trainer.privacy_report()["noise_randomness"] == "secure_mode"


class CountingTrainer(Trainer):
    """Another Trainer subclass that wraps both hooks and calls super(), as TRL's trainers do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"training_step": 0, "compute_loss": 0}

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.calls["training_step"] += 1
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls["compute_loss"] += 1
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class DPCountingTrainer(DPTrainerMixin, CountingTrainer):
    pass


def test_the_mixin_composes_with_another_trainer_subclass(tmp_path):
    results, trainers = [], []
    for cls in (DPTrainer, DPCountingTrainer):
        torch.manual_seed(4)
        model = models.gpt2()
        trainer = make_trainer(
            tmp_path,
            model=model,
            trainer_class=cls,
            noise_multiplier=0.5,
            insecure_dp_seed=2,
            eval_strategy="no",
        )
        trainer.train()
        results.append(snapshot(model))
        trainers.append(trainer)
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], msg=name)
    counting = trainers[1]
    assert counting.calls["training_step"] == 2 * counting.args.gradient_accumulation_steps
    assert counting.calls["compute_loss"] == 0  # under DP the loss is the per-example one
    counting.evaluate(TokenRows(8))
    assert counting.calls["compute_loss"] > 0  # evaluation keeps the parent's batch loss


class ExtraBackwardTrainer(DPTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        unclipped = {k: v for k, v in self._prepare_inputs(inputs).items() if k != "hf_dp_example_mask"}
        model(**unclipped).loss.backward()  # a gradient that bypasses per-example clipping
        return loss


def test_a_gradient_written_outside_clipping_is_refused(tmp_path):
    trainer = make_trainer(tmp_path, trainer_class=ExtraBackwardTrainer, noise_multiplier=0.5)
    with pytest.raises(RuntimeError, match="a gradient reached the parameters outside per-example clipping"):
        trainer.train()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"noise_multiplier": 1.0, "per_device_train_batch_size": 40}, "exceeds the 32 training examples"),
        ({}, "give one of target_epsilon"),
    ],
)
def test_trainer_set_up_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(tmp_path, **overrides)


def test_plain_training_arguments_are_refused(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match="needs DPTrainingArguments"):
        DPTrainer(
            model=models.gpt2(),
            args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True),
            train_dataset=TokenRows(8),
            data_collator=pad_collate,
        )


def test_bf16_autocast_step_is_close_to_the_float32_step(tmp_path):
    """Under bf16 autocast the norms are computed in float32 from bf16 activations: same step to bf16 precision."""
    steps = {}
    for bf16 in (False, True):
        torch.manual_seed(8)
        model = models.gpt2()
        before = snapshot(model)
        make_trainer(
            tmp_path, model=model, noise_multiplier=0.0, bf16=bf16, max_steps=1, insecure_dp_seed=3
        ).train()
        steps[bf16] = torch.cat([(before[n] - p.detach()).flatten() for n, p in model.named_parameters()])
    assert steps[False].norm() > 0
    assert (steps[True] - steps[False]).norm() < 0.05 * steps[False].norm()


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_the_engines_hooks_leave_the_model_when_training_ends_or_the_trainer_goes(tmp_path):
    import gc

    model = models.gpt2()
    bare = _hook_count(model)
    trainer = make_trainer(tmp_path, model=model, noise_multiplier=1.0, max_steps=1)
    assert _hook_count(model) > bare
    trainer.train()
    assert _hook_count(model) == bare
    untrained = make_trainer(tmp_path, model=model, noise_multiplier=1.0, max_steps=1)
    assert _hook_count(model) > bare
    del untrained
    gc.collect()
    assert _hook_count(model) == bare
