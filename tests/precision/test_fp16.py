"""fp16=True under DP: fp16 autocast with a fixed loss scale S, the per-example gradients unscaled before clipping.

The clipped sum of a float32 model run under fp16 autocast is compared with the float64 brute force (one
backward per example, clipping active: C = half the smallest norm). Measured relative errors ‖ours − ref‖/‖ref‖
at the default S = 2^10 on CPU: Llama 3.2e-4 (book-keeping), 3.9e-4 (checkpointing, either mode); tied GPT-2 3.6e-4
(book-keeping), 4.0e-4 (checkpointing); LoRA Llama 6.2e-4 (both the checked two-pass step and the one-pass
step). That is fp16's rounding of the forward (2^-11 per op), not the scaling: S = 1 and S = 2^15 give the
same errors on these models. The tolerance, 2e-3, is 3-6× those.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from hf_dp import DPTrainer
from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.loss_scale import DEFAULT_FP16_LOSS_SCALE, LossScale
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.plan import StepPlan
from hf_dp.distributed import check_fp16
from hf_dp.losses import unwrap_model
from tests import models, oracle
from tests.precision.test_mixed_precision import released_gradients
from tests.test_checkpointing import checkpointed_steps, llama_lora
from tests.trainer_utils import make_args, make_trainer, sampled_logical_batches, snapshot

TOLERANCE = 2e-3
FP16 = LossScale(DEFAULT_FP16_LOSS_SCALE, "cpu")


def relative_error(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    error = sum((ours[n].double() - reference[n]).norm() ** 2 for n in reference) ** 0.5
    return float(error / sum(r.norm() ** 2 for r in reference.values()) ** 0.5)


def clipped_reference(model: nn.Module, batch: dict) -> tuple[dict[str, torch.Tensor], float]:
    """The float64 brute-force clipped sum at C = half the smallest per-example norm (every example clipped)."""
    reference_model = copy.deepcopy(model).double()
    _, norms = oracle.per_example(reference_model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = oracle.per_example(reference_model, batch, max_norm=max_norm)
    return reference, max_norm


CASES = {
    "llama": (models.llama, None),
    "llama_nonreentrant": (models.llama, False),
    "llama_reentrant": (models.llama, True),
    "gpt2_tied": (models.gpt2, None),
    "gpt2_tied_nonreentrant": (models.gpt2, False),
    "gpt2_tied_reentrant": (models.gpt2, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp16_clipped_sum_matches_the_float64_brute_force(case: str) -> None:
    build, reentrant = CASES[case]
    torch.manual_seed(0)
    model = build().train()
    batch = models.token_batch()
    reference, max_norm = clipped_reference(model, batch)
    checkpointing = reentrant is not None
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": reentrant})
    engine = ClippingEngine(model)
    strategy = clipped_step(engine, model, Backend(checkpointing=checkpointing, fp16_loss_scale=FP16.scale))
    # with checkpointing: the checked first step, then the step whose weighted pass skips the LM head (tail.py)
    # and runs the layers one by one (layerwise.py)
    for ours in checkpointed_steps(model, batch, max_norm, strategy=strategy):
        assert relative_error(ours, reference) < TOLERANCE
    assert strategy.calibration.skips_tail is checkpointing
    assert strategy.calibration.layerwise is checkpointing
    assert engine.sums.nonfinite_examples == 0
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def test_fp16_lora_with_checkpointing_is_exact_in_the_one_pass_step_too(monkeypatch) -> None:
    """The first step checks the taps and the layer-by-layer weighted pass (no forward: the embeddings are frozen);
    the next keeps the explicit S-scaled adapter gradients of the norm pass and sums them with c_i / S (the
    threshold is lifted: the tiny model's adapters are large)."""
    monkeypatch.setattr("hf_dp.clipping.pipeline.KEPT_GRADIENTS_SHARE", 1e9)
    torch.manual_seed(0)
    model = llama_lora().train()
    batch = models.token_batch()
    reference, max_norm = clipped_reference(model, batch)
    unwrap_model(model).activation_checkpointing_enable({"use_reentrant": False})
    strategy = clipped_step(
        ClippingEngine(model), model, Backend(checkpointing=True, fp16_loss_scale=FP16.scale)
    )
    forwards = []
    for ours in checkpointed_steps(model, batch, max_norm, strategy=strategy, forwards=forwards):
        assert relative_error(ours, reference) < TOLERANCE
    assert strategy.calibration.layerwise and forwards == [
        3,
        1,
    ]  # step 1: one more, calibration's attribution


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x)).squeeze(1)


def _run(
    model: nn.Module, losses_of, max_norm: float, checkpointing: bool, scale: float | None
) -> ClippingEngine:
    """One step of book-keeping (under fp16 autocast with loss scale ``scale``, or none: float32)."""
    model.zero_grad(set_to_none=True)
    engine = ClippingEngine(model)
    strategy = clipped_step(engine, model, Backend(checkpointing=checkpointing, fp16_loss_scale=scale))
    strategy.run(losses_of, torch.ones(4), StepPlan(max_norm), model)
    engine.remove_hooks()
    return engine


def _brute_force(model: nn.Module, losses_of, max_norm: float, keep: list[int]) -> dict[str, torch.Tensor]:
    """Σ_i c_i ∇L_i over ``keep`` in float64 (the oracle on a float64 copy), one backward per example, c_i the
    engine's "abadi" clipping (its 1e-6 matters at these tiny norms)."""
    reference = copy.deepcopy(model).double()
    units = [lambda i=i: losses_of(reference)[i] for i in keep]
    return oracle.clipped_sum(reference, units, max_norm).total


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_loss_is_scaled_so_small_gradients_survive_fp16(checkpointing: bool) -> None:
    """L_i = 1e-8·f(x_i), |x| ~ 10^3: the gradients (norms ~1e-5) are fine in float32, but the output gradient
    1e-8 is below half fp16's smallest subnormal (6e-8) and flushes to 0 unscaled, so S = 1 gives a zero clipped
    sum; S = 2^20 lifts it to 1e-2 and the clipped sum is the brute force. (With checkpointing the weighted
    backward's output gradients are c_i·S·1e-8, c_i ~ 0.1 here: at S = 2^16 they are partly subnormal and the
    error was 1.4e-3; at 2^20 it is 4.0e-4, 2.0e-4 without checkpointing.)"""
    torch.manual_seed(0)
    model, x = _TwoLayers(), 1e3 * torch.randn(4, 4)

    def losses_of(module: nn.Module) -> torch.Tensor:
        return 1e-8 * module(x.to(next(module.parameters()).dtype)).float()

    expected = _brute_force(model, losses_of, 2e-6, keep=[0, 1, 2, 3])
    _run(model, losses_of, 2e-6, checkpointing, scale=1.0)
    assert all(not p.grad.any() for p in model.parameters())  # the failure the scaling prevents
    engine = _run(model, losses_of, 2e-6, checkpointing, scale=2.0**20)
    assert engine.sums.nonfinite_examples == 0
    for param, reference in zip(model.parameters(), expected.values(), strict=True):
        assert (param.grad.double() - reference).norm() < TOLERANCE * reference.norm()


def _norm_overflows() -> tuple:
    """float32, no loss scale. A 64 → 64 layer at T = 1 takes its norm by the Gram ⟨x, x⟩⟨g, g⟩ (cheaper than the
    explicit g xᵀ): example 2's x is 1e30, its loss 1e-10·f(x) and gradient are finite, but ⟨x, x⟩ = 6.4e61
    overflows float32. The others are not clipped (norms ~1e-8 below C = 1)."""
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    model.layer = model[0]
    x = torch.randn(4, 64)
    x[2] = 1e30

    def losses_of(module: nn.Module) -> torch.Tensor:
        return 1e-10 * module(x.to(next(module.parameters()).dtype)).sum(dim=1)

    def check(grad: torch.Tensor, reference: torch.Tensor) -> None:
        # float32 sums of three examples: an entry where they cancel is exact to float32 of the largest term
        torch.testing.assert_close(
            grad.double(), reference, rtol=1e-6, atol=1e-6 * float(reference.abs().max())
        )

    return model, losses_of, 1.0, None, check


def _fp16_scaled_gradient_overflows() -> tuple:
    """Example 2's loss is 10^4·f(x_2): finite, and so is its gradient, but S = 2^8 lifts its fp16 output gradient
    past 65504. The others' clipped sum is the brute force (measured 3.4e-4, 5.0e-4 with checkpointing)."""
    model, x = _TwoLayers(), torch.randn(4, 4)
    weights = torch.tensor([1.0, 1.0, 1e4, 1.0])

    def losses_of(module: nn.Module) -> torch.Tensor:
        return (
            weights.to(next(module.parameters()).dtype)
            * module(x.to(next(module.parameters()).dtype)).float()
        )

    def check(grad: torch.Tensor, reference: torch.Tensor) -> None:
        assert (grad.double() - reference).norm() < TOLERANCE * reference.norm()

    return model, losses_of, 0.05, 2.0**8, check


OVERFLOWS = {
    "norm_overflows_float32": _norm_overflows,
    "fp16_gradient_overflows": _fp16_scaled_gradient_overflows,
}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("overflow", list(OVERFLOWS))
def test_an_overflowing_example_weighs_zero_and_is_counted(overflow: str, checkpointing: bool) -> None:
    """Example 2 overflows (its norm in float32, or its fp16-scaled gradient): it gets c_2 = 0 and is counted,
    .grad is finite, and the others' clipped sum is the float64 brute force over examples 0, 1 and 3."""
    torch.manual_seed(0)
    model, losses_of, max_norm, scale, check = OVERFLOWS[overflow]()
    expected = _brute_force(model, losses_of, max_norm, keep=[0, 1, 3])
    engine = _run(model, losses_of, max_norm, checkpointing, scale)
    assert engine.sums.nonfinite_examples == 1
    for param, reference in zip(model.parameters(), expected.values(), strict=True):
        assert torch.isfinite(param.grad).all()
        check(param.grad, reference)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("overflow", list(OVERFLOWS))
def test_an_overflowing_example_weighs_zero_in_its_group_and_is_counted(
    overflow: str, checkpointing: bool
) -> None:
    """Group-wise clipping (``clipping_groups="layer"``), each group formed in the backward without a host read: the
    overflowing example 2 gets c_2g = 0 in every group it overflows (its rows are set to 0 before the products,
    0 · inf being nan), is counted once, .grad is finite, and the others' sum is the per-group brute force."""
    torch.manual_seed(0)
    model, losses_of, max_norm, scale, check = OVERFLOWS[overflow]()
    model.zero_grad(set_to_none=True)
    engine = ClippingEngine(model, grouping="layer", clip_norm=max_norm)
    share = max_norm * engine.groups.shares[0]
    names = [name for name, _ in model.named_parameters()]
    groups = {name: (name.rpartition(".")[0], share) for name in names}
    reference = copy.deepcopy(model).double()
    units = [lambda i=i: losses_of(reference)[i] for i in (0, 1, 3)]
    expected = oracle.clipped_sum(reference, units, max_norm, groups=groups).total
    strategy = clipped_step(engine, model, Backend(checkpointing=checkpointing, fp16_loss_scale=scale))
    strategy.run(losses_of, torch.ones(4), StepPlan(max_norm), model)
    engine.remove_hooks()
    assert engine.sums.nonfinite_examples == 1
    for name, param in model.named_parameters():
        assert torch.isfinite(param.grad).all()
        check(param.grad, expected[name])


def _fp16_trainer(tmp_path, **overrides) -> DPTrainer:
    return make_trainer(tmp_path, model=models.llama(), fp16=True, insecure_dp_seed=3, **overrides)


def test_a_train_step_with_an_overflowing_example_still_releases_a_noisy_step(tmp_path) -> None:
    """One drawn example's loss is multiplied by 10^6 (its fp16 gradient overflows): the step is not skipped,
    the example is counted, the released gradient is finite, the parameters move and the accountant counts."""
    torch.manual_seed(0)

    class OneOverflows(DPTrainer):
        def compute_per_example_loss(self, model, inputs):
            losses = super().compute_per_example_loss(model, inputs)
            return losses * torch.where(inputs["input_ids"][:, 0] == models.PAD + 1, 1e6, 1.0)

    trainer = _fp16_trainer(tmp_path, trainer_class=OneOverflows, noise_multiplier=1.0, max_steps=1)
    (indices,) = sampled_logical_batches(trainer, 1)
    trainer.train_dataset.rows[indices[0]][0] = models.PAD + 1  # the token no other row starts with
    before = snapshot(trainer.model)
    released = released_gradients(trainer)
    trainer.train()
    assert trainer.dp.engine.sums.nonfinite_examples == 1
    assert any(entry.get("nonfinite_examples") == 1 for entry in trainer.state.log_history)
    assert released and all(torch.isfinite(g).all() for g in released.values())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    assert trainer.accountant.steps == 1 and trainer.state.global_step == 1


def test_dptrainer_trains_with_fp16_on_cpu(tmp_path) -> None:
    """fp16=True on CPU: accelerate installs neither autocast nor a GradScaler there, so the DP step installs the
    autocast itself (the DP forwards' linear layers compute in fp16), and no GradScaler is left to unscale or
    skip; the loss is finite and ε is reported. The noise-free step is the float32 one to fp16 precision
    (measured 3.5e-4 relative)."""
    seen = set()
    steps = []
    for fp16 in (False, True):
        torch.manual_seed(8)
        model = models.llama()
        model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.add(out.dtype))
        before = snapshot(model)
        trainer = make_trainer(
            tmp_path, model=model, noise_multiplier=0.0, max_steps=1, insecure_dp_seed=3, fp16=fp16
        )
        trainer.train()
        steps.append(torch.cat([(before[n] - p.detach()).flatten() for n, p in model.named_parameters()]))
    assert torch.float16 in seen and trainer.accelerator.scaler is None
    assert steps[0].norm() > 0 and (steps[1] - steps[0]).norm() < TOLERANCE * steps[0].norm()
    trainer = _fp16_trainer(tmp_path, noise_multiplier=1.0, max_steps=2, activation_checkpointing=True)
    output = trainer.train()
    assert math.isfinite(output.training_loss) and 0 < output.metrics["epsilon"] < math.inf
    # correlated noise under fp16: its one buffer (2 bands) in float32
    trainer = _fp16_trainer(
        tmp_path, noise_multiplier=1.0, max_steps=2, noise_mechanism="bandmf", num_bands="2"
    )
    output = trainer.train()
    assert math.isfinite(output.training_loss) and output.metrics["num_bands"] == 2
    assert trainer.dp.mechanism.buffer_bytes() == 4 * sum(p.numel() for p in trainer.model.parameters())


def test_fp16_without_dp_still_trains(tmp_path) -> None:
    trainer = _fp16_trainer(tmp_path, disable_dp=True, max_steps=1)
    assert math.isfinite(trainer.train().training_loss)


@pytest.mark.parametrize("scale", [3.0, 0.0, -256.0, 1000.0, float("inf")])
def test_a_loss_scale_that_is_not_a_positive_power_of_two_is_refused_in_one_line(tmp_path, scale) -> None:
    with pytest.raises(ValueError, match="dp_fp16_loss_scale must be a positive power of two") as info:
        make_args(tmp_path, noise_multiplier=1.0, fp16=True, dp_fp16_loss_scale=scale)
    assert "\n" not in str(info.value)


def test_a_loss_scale_without_fp16_is_refused_in_one_line(tmp_path) -> None:
    with pytest.raises(ValueError, match="dp_fp16_loss_scale=4096 scales the loss under fp16") as info:
        make_args(tmp_path, noise_multiplier=1.0, dp_fp16_loss_scale=4096.0)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("model", "deepspeed", "fsdp", "message"),
    [
        (models.llama(), True, False, "fp16=True under DeepSpeed"),
        (models.llama(), False, True, "fp16=True under FSDP"),
        (models.llama().half(), False, False, "trains torch.float16 parameters; load it in float32"),
    ],
)
def test_fp16_is_refused_where_its_fixed_loss_scale_cannot_run(model, deepspeed, fsdp, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_fp16(model, deepspeed, fsdp)
    assert "\n" not in str(info.value)


def test_fp16_weights_with_fp16_autocast_are_refused_before_training(tmp_path) -> None:
    with pytest.raises(ValueError, match="load it in float32"):
        make_trainer(tmp_path, model=models.llama().half(), fp16=True, noise_multiplier=1.0)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fp16_groupwise_clipping_matches_the_float64_brute_force(checkpointing: bool) -> None:
    """Group-wise clipping (groups.py) under fp16's loss scale: each group's norm is unscaled by S before its clip
    factor, and the S-scaled per-example gradients are weighted by c_ig / S."""
    torch.manual_seed(0)
    model = models.llama().train()
    batch = models.token_batch()
    reference_model = copy.deepcopy(model).double()
    _, norms = oracle.per_example(reference_model, batch, max_norm=1e9)
    max_norm = 0.5 * norms.min().item()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    engine = ClippingEngine(model, grouping="layer", clip_norm=max_norm)
    groups, group_norms = engine.groups, engine.groups.norms(max_norm)
    group = {n: groups.of[engine.parameter_name(p)] for n, p in model.named_parameters() if p.requires_grad}
    by_name = {name: (groups.names[g], group_norms[g]) for name, g in group.items()}
    reference, _ = oracle.per_example(reference_model, batch, max_norm, groups=by_name)
    strategy = clipped_step(engine, model, Backend(checkpointing=checkpointing, fp16_loss_scale=FP16.scale))
    for ours in checkpointed_steps(model, batch, max_norm, strategy=strategy):
        assert relative_error(ours, reference) < TOLERANCE
    assert engine.sums.nonfinite_examples == 0
