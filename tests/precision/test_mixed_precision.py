"""Low precision: bf16/fp16 weights keep a float32 clipped sum and float32 noise; overflowing examples weigh 0.

(The overflow of an example's norm or of its fp16-scaled gradient: ``test_an_overflowing_example_weighs_zero_and_is_counted``
in tests/precision/test_fp16.py.)

The released gradient of a bf16 or fp16 GPT-2 is compared with the float64 brute force (one backward per
example, clipping active) within a stated tolerance; the measured errors were 0.56% (bf16) and 0.075% (fp16)
on this model, so the tolerances are about 3× and 5× those.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.plan import StepPlan
from hf_dp.noise import GaussianNoise
from tests import models
from tests.test_trainer import brute_force_update
from tests.trainer_utils import make_trainer, sampled_logical_batches

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def released_gradients(trainer) -> dict[str, torch.Tensor]:
    """ĝ as the update rule receives it (after the mechanism's release), by parameter name."""
    trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    released: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            released.update({names[id(p)]: p.grad.detach().double().clone() for p in group["params"]})

    trainer.optimizer.register_step_pre_hook(capture)
    return released


def released_and_brute_force(tmp_path, model: nn.Module, reference_model: nn.Module, checkpointing: bool):
    """One logical batch (2 × 6 rows, every example clipped at C 0.1, no noise) of ``model`` through the trainer:
    the released ĝ and the float64 ``reference_model``'s brute-force clipped mean, by parameter name."""
    trainer = make_trainer(
        tmp_path,
        model=model,
        noise_multiplier=0.0,
        max_steps=1,
        per_device_train_batch_size=6,
        gradient_accumulation_steps=2,
        insecure_dp_seed=3,
        per_sample_max_grad_norm=0.1,  # below every example's norm: clipping is active
        activation_checkpointing=checkpointing,
    )
    (indices,) = sampled_logical_batches(trainer, 1)
    expected = brute_force_update(
        reference_model, trainer.train_dataset, indices, 0.1, trainer.expected_batch_size
    )
    released = released_gradients(trainer)
    trainer.train()
    return released, expected


def relative_error(released: dict, expected: dict) -> float:
    error = sum((released[n] - expected[n]).norm() ** 2 for n in released) ** 0.5
    return float(error / sum(expected[n].norm() ** 2 for n in released) ** 0.5)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_release_the_float32_clipped_mean(tmp_path, dtype, checkpointing):
    torch.manual_seed(1)
    model = models.gpt2()
    reference_model = models.gpt2().double()
    reference_model.load_state_dict(model.state_dict())
    model = model.to(dtype)
    released, expected = released_and_brute_force(tmp_path, model, reference_model, checkpointing)
    assert set(released) == set(expected) - {"lm_head.weight"}  # tied to transformer.wte.weight
    assert relative_error(released, expected) < TOLERANCE[dtype]
    assert all(p.dtype == dtype for p in model.parameters())


def test_low_precision_noise_is_drawn_and_added_in_float32(tmp_path, monkeypatch):
    """The clipped sum of a bf16 parameter is float32 when the noise is drawn and added; ĝ is cast after."""
    drawn_in = []
    sample = GaussianNoise.sample

    def spy(self, shape, std, device, dtype):
        drawn_in.append(dtype)
        return sample(self, shape, std, device, dtype)

    monkeypatch.setattr(GaussianNoise, "sample", spy)
    model = models.gpt2().to(torch.bfloat16)
    trainer = make_trainer(tmp_path, model=model, noise_multiplier=1.0, max_steps=1, insecure_dp_seed=3)
    released = released_gradients(trainer)
    trainer.train()
    assert drawn_in and set(drawn_in) == {torch.float32}
    assert trainer.dp.engine.sums.low_precision == {}  # consumed by the release
    assert released and all(torch.isfinite(g).all() for g in released.values())


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_an_overflowing_forward_is_dropped_by_book_keeping_and_refused_with_checkpointing():
    model = _Probe()
    x = torch.randn(4, 4)
    x[1] = float("inf")
    engine = ClippingEngine(model)
    clipped_step(engine, model, Backend()).run(lambda m: m(x).squeeze(1), torch.ones(4), StepPlan(1.0), model)
    assert engine.sums.nonfinite_examples == 1 and torch.isfinite(model.layer.weight.grad).all()
    model.zero_grad(set_to_none=True)
    strategy = clipped_step(engine, model, Backend(checkpointing=True))
    with pytest.raises(FloatingPointError, match="loss overflowed") as info:
        strategy.run(lambda m: m(x).squeeze(1), torch.ones(4), StepPlan(1.0), model)
    assert "\n" not in str(info.value)


def _from_the_same_values(part) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense OuterProductSum's factors in float64: the values it holds, whatever their dtype."""
    return part.left.double(), part.right.double()


def test_bf16_factors_are_multiplied_and_summed_in_float32():
    """Norms, cross-Grams, explicit G_i and Σ_i c_i G_i of bf16 factors equal float64 arithmetic on the same
    bf16 values to float32 precision (a bf16 sum or bf16 clip factors would be ~1e-3 off)."""
    from hf_dp.clipping.per_example import OuterProductSum

    torch.manual_seed(0)
    batch, steps, rows, cols = 3, 33, 40, 24
    dense = OuterProductSum(
        torch.randn(batch, steps, rows).bfloat16(), torch.randn(batch, steps, cols).bfloat16(), rows
    )
    other = OuterProductSum(
        torch.randn(batch, steps, rows).bfloat16(), torch.randn(batch, steps, cols).bfloat16(), rows
    )
    ids = torch.randint(0, rows, (batch, steps))
    index = OuterProductSum(ids, torch.randn(batch, steps, cols).bfloat16(), rows)
    explicit = {
        "dense": torch.einsum("btr,btc->brc", *_from_the_same_values(dense)),
        "other": torch.einsum("btr,btc->brc", *_from_the_same_values(other)),
        "index": torch.zeros(batch, rows, cols, dtype=torch.float64).scatter_add_(
            1, ids[:, :, None].expand(-1, -1, cols), index.right.double()
        ),
    }
    parts = {"dense": dense, "other": other, "index": index}

    def close(ours: torch.Tensor, truth: torch.Tensor) -> None:
        assert ours.dtype == torch.float32
        assert (ours.double() - truth).norm() <= 1e-6 * truth.norm()

    for name, part in parts.items():
        truth = explicit[name].pow(2).sum(dim=(1, 2))
        close(part.squared_norm(materialise=False), truth)
        close(part.squared_norm(materialise=True), truth)
        close(part.materialise(0, batch), explicit[name])
    close(dense.inner(other), (explicit["dense"] * explicit["other"]).sum(dim=(1, 2)))
    close(dense.inner(index), (explicit["dense"] * explicit["index"]).sum(dim=(1, 2)))
    factors = torch.tensor([1 / 3, 0.7, 0.123])  # not bf16 numbers
    for name, part in parts.items():
        like = torch.zeros(rows, cols)
        summed = part.accumulate(torch.zeros(rows, cols), factors, like)
        close(summed, torch.einsum("b,brc->rc", factors.double(), explicit[name]))


def test_under_autocast_a_linear_layers_norm_is_that_of_the_bf16_product_autograd_takes():
    """bf16 autocast multiplies bf16(x) by the bf16 output gradient: the rule keeps those factors, so the norm is
    that gradient's to float32 precision, not that of the float32 input (~1e-4 away)."""
    from hf_dp.clipping.rules import linear_rule

    torch.manual_seed(1)
    layer = nn.Linear(48, 32, bias=False)
    x = torch.randn(2, 17, 48)
    seen = {}
    layer.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    layer.register_full_backward_hook(lambda m, gin, gout: seen.update(grad_out=gout[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x.requires_grad_())
    assert out.dtype == torch.bfloat16
    out.float().pow(2).sum().backward()
    part = linear_rule(layer, seen["x"], seen["grad_out"])["weight"]
    assert part.right.dtype == part.left.dtype == torch.bfloat16
    assert torch.equal(part.right, seen["x"].bfloat16())
    per_example = torch.einsum("bto,bti->boi", seen["grad_out"].double(), seen["x"].bfloat16().double())
    truth = per_example.pow(2).sum(dim=(1, 2))
    ours = part.squared_norm(materialise=False)
    assert ((ours.double() - truth).abs() <= 1e-6 * truth).all()
    float32_input = torch.einsum("bto,bti->boi", seen["grad_out"].double(), seen["x"].double())
    assert ((float32_input.pow(2).sum(dim=(1, 2)) - truth).abs() > 1e-6 * truth).any()  # the test can tell


def test_three_bf16_pieces_sum_to_the_float32_operand_exactly():
    """The clipped sum's weighted side goes to CUDA's bf16 tensor cores as three bf16 pieces: 8 + 8 + 8
    significand bits hold a float32 value exactly while the third piece is a normal number (|x| ≥ 2^-110, about
    1e-33); two pieces would leave ~2^-17."""
    from hf_dp.clipping.wide_gemm import bf16_pieces

    torch.manual_seed(2)
    signs = torch.randint(0, 2, (200_000,)) * 2 - 1
    x = signs * (1 + torch.rand(200_000)) * torch.logspace(-33, 33, 200_000)
    pieces = bf16_pieces(x)
    assert len(pieces) == 3 and all(p.dtype == torch.bfloat16 for p in pieces)
    assert torch.equal(sum(p.double() for p in pieces), x.double())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_bf16_moe_releases_the_float32_clipped_mean(tmp_path, checkpointing):
    """bf16 Mixtral: its routers' and fused experts' call rules back-propagate each routed pair in bf16, as the
    forward ran. Measured 0.69% of the float64 brute force's clipped mean (0.56% for GPT-2 above). The first step's
    check that an example's loss in its batch equals its loss alone allows bf16 weights bf16 rounding (it refused
    this model at float32's tolerance). Per parameter, a router whose top-k flips between bf16 and float64 differs
    more: the stock bf16 gradient of this model is 13% off float64 on its second router's weight."""
    torch.manual_seed(1)
    model = models.mixtral()
    reference_model = models.mixtral().double()
    reference_model.load_state_dict(model.state_dict())
    reference_model.config._experts_implementation = "batched_mm"  # the grouped GEMM takes no float64
    model = model.to(torch.bfloat16)
    released, expected = released_and_brute_force(tmp_path, model, reference_model, checkpointing)
    assert relative_error(released, expected) < TOLERANCE[torch.bfloat16]
