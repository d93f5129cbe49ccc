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


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_release_the_float32_clipped_mean(tmp_path, dtype, checkpointing):
    torch.manual_seed(1)
    model = models.gpt2()
    reference_model = models.gpt2().double()
    reference_model.load_state_dict(model.state_dict())
    model = model.to(dtype)
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
    assert set(released) == set(expected) - {"lm_head.weight"}  # tied to transformer.wte.weight
    error = sum((released[n] - expected[n]).norm() ** 2 for n in released) ** 0.5
    size = sum(expected[n].norm() ** 2 for n in released) ** 0.5
    assert error < TOLERANCE[dtype] * size
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
    assert trainer.dp.engine.low_precision_sums == {}  # consumed by the release
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
    assert engine.nonfinite_examples == 1 and torch.isfinite(model.layer.weight.grad).all()
    model.zero_grad(set_to_none=True)
    strategy = clipped_step(engine, model, Backend(checkpointing=True))
    with pytest.raises(FloatingPointError, match="loss overflowed") as info:
        strategy.run(lambda m: m(x).squeeze(1), torch.ones(4), StepPlan(1.0), model)
    assert "\n" not in str(info.value)
