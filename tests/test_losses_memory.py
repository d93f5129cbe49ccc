"""The per-example token loss holds no float32 copy of low-precision logits, and equals the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_dp import losses
from hf_dp.losses import token_loss_per_example


def reference(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    """One F.cross_entropy over every token in float64, shifted labels, mean over each example's tokens."""
    labels = F.pad(labels[:, 1:], (0, 1), value=-100)
    tokens = F.cross_entropy(
        logits.double().transpose(1, 2),
        labels,
        ignore_index=-100,
        reduction="none",
        label_smoothing=smoothing,
    )
    return tokens.sum(dim=1) / (labels != -100).sum(dim=1).clamp(min=1)


def logits_and_labels(dtype: torch.dtype, batch: int = 3, length: int = 7, vocab: int = 50):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(batch, length, vocab, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, length), generator=g)
    labels[1, 3:] = -100
    labels[2, 1:] = -100  # after the shift, example 2 has no token: L_2 = 0
    return logits, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bf16_logits_in_ragged_chunks_equal_the_float64_loss_and_gradient(monkeypatch, smoothing):
    monkeypatch.setattr(
        losses, "_LOGITS_PER_CHUNK", 4 * 50
    )  # 4 rows a chunk: 21 rows → 6 chunks, the last of 1
    logits, labels = logits_and_labels(torch.bfloat16)
    ours = token_loss_per_example(logits, labels, shift=True, label_smoothing=smoothing)
    (ours_grad,) = torch.autograd.grad(ours.sum(), logits)
    exact_logits = logits.detach().double().requires_grad_()
    expected = reference(exact_logits, labels, smoothing)
    (expected_grad,) = torch.autograd.grad(expected.sum(), exact_logits)
    assert ours.dtype == torch.float32 and ours[2] == 0
    torch.testing.assert_close(
        ours.double(), expected, rtol=1e-6, atol=1e-6
    )  # float32 arithmetic on bf16 inputs
    torch.testing.assert_close(
        ours_grad.double(), expected_grad, rtol=1e-2, atol=1e-3
    )  # the gradient is bf16


def test_float64_logits_stay_float64():
    logits, labels = logits_and_labels(torch.float64)
    ours = token_loss_per_example(logits, labels, shift=True)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, reference(logits, labels, 0.0), rtol=1e-12, atol=1e-14)


def test_no_float32_copy_of_the_bf16_logits_is_kept_for_the_backward():
    logits = torch.randn(2, 256, 4096).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 4096, (2, 256))
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = token_loss_per_example(logits, labels, shift=True)
    large_float32 = [t for t in saved if t.dtype == torch.float32 and t.numel() >= logits[0, :8].numel()]
    assert large_float32 == []
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
