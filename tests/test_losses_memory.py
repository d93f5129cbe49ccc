"""The per-example token loss equals the plain one and holds no float32 copy or log-softmax of all the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks import token_loss
from hf_dp import losses
from hf_dp.losses import token_loss_per_example

VOCAB = 50


def reference(logits: torch.Tensor, labels: torch.Tensor, shift: bool, smoothing: float) -> torch.Tensor:
    """One F.cross_entropy over every token in float64, mean over each example's labelled tokens."""
    if shift:
        labels = F.pad(labels[:, 1:], (0, 1), value=-100)
    tokens = F.cross_entropy(
        logits.double().transpose(1, 2),
        labels,
        ignore_index=-100,
        reduction="none",
        label_smoothing=smoothing,
    )
    return tokens.sum(dim=1) / (labels != -100).sum(dim=1).clamp(min=1)


def logits_and_labels(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 9, VOCAB, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (4, 9), generator=g)
    labels[0, ::3] = -100  # holes
    labels[1, 4:] = -100  # padding
    labels[2, :] = -100  # no labelled token (shifted or not): L_2 = 0
    return logits, labels  # 22 labelled tokens shifted, 23 unshifted


WEIGHTS = torch.arange(1.0, 5.0, dtype=torch.float64)  # a distinct gradient weight per example


def loss_and_grad(loss_fn, logits, labels, shift, smoothing) -> tuple[torch.Tensor, torch.Tensor]:
    loss = loss_fn(logits, labels, shift, smoothing)
    (grad,) = torch.autograd.grad((WEIGHTS.to(loss.dtype) * loss).sum(), logits)
    return loss, grad


def ours(logits, labels, shift, smoothing):
    return token_loss_per_example(logits, labels, shift=shift, label_smoothing=smoothing)


def exact(logits, labels, shift, smoothing) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference loss and gradient at the same logits in float64."""
    return loss_and_grad(reference, logits.detach().double().requires_grad_(), labels, shift, smoothing)


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float64, {"rtol": 1e-12, "atol": 1e-12}), (torch.float32, {})]
)
def test_loss_and_gradient_in_ragged_chunks_equal_plain_cross_entropy(
    monkeypatch, shift, smoothing, dtype, tolerance
):
    # 4 rows a chunk: 6 chunks, the last ragged
    monkeypatch.setattr(losses, "_LOGITS_PER_CHUNK", 5 * VOCAB - 1)
    logits, labels = logits_and_labels(dtype)
    loss, grad = loss_and_grad(ours, logits, labels, shift, smoothing)
    expected, expected_grad = exact(logits, labels, shift, smoothing)
    assert loss.dtype == grad.dtype == dtype and loss[2] == 0 and not grad[2].any()
    torch.testing.assert_close(loss, expected.to(dtype), **tolerance)
    torch.testing.assert_close(grad, expected_grad.to(dtype), **tolerance)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bf16_logits_give_the_float64_loss_and_a_bf16_rounded_gradient(monkeypatch, smoothing):
    monkeypatch.setattr(losses, "_LOGITS_PER_CHUNK", 4 * VOCAB)
    logits, labels = logits_and_labels(torch.bfloat16)
    loss, grad = loss_and_grad(ours, logits, labels, True, smoothing)
    expected, expected_grad = exact(logits, labels, True, smoothing)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    # the bf16 logits are exact inputs: the loss carries float32 rounding only, the gradient bf16 rounding (2^-9)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=2**-8, atol=1e-6)


def test_no_copy_of_the_bf16_logits_is_saved_for_the_backward():
    logits = torch.randn(2, 512, 32000).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 32000, (2, 512))
    ours = token_loss.LOSSES["ours"]
    # plain F.cross_entropy on the upcast logits saves their float32 log-softmax: 4·B·T·V bytes (125 MiB)
    assert token_loss.saved_bytes(ours, logits, labels) < 2**20
    ours(logits, labels).sum().backward()
    assert logits.grad.dtype == torch.bfloat16


class _LogitSizedOutputs(TorchDispatchMode):
    """The storages of op outputs with at least ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.storages = numel, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.storages[t.untyped_storage().data_ptr()] = (str(func), t.dtype)
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_only_logit_sized_tensor_made_is_the_gradient(monkeypatch, dtype):
    monkeypatch.setattr(losses, "_LOGITS_PER_CHUNK", 64 * 4096)  # 8 chunks
    logits = torch.randn(2, 256, 4096).to(dtype).requires_grad_()
    labels = torch.randint(0, 4096, (2, 256))
    labels[:, :100] = -100
    with _LogitSizedOutputs(logits.numel()) as made:
        token_loss_per_example(logits, labels, shift=True, label_smoothing=0.1).sum().backward()
    made.storages.pop(logits.untyped_storage().data_ptr(), None)
    # not a float32 copy, a log-softmax or its gradient (HF's loss makes all three), nor one gradient per chunk
    assert list(made.storages) == [logits.grad.untyped_storage().data_ptr()], made.storages
    assert logits.grad.dtype == dtype


def test_an_ignored_position_with_overflowed_logits_contributes_nothing():
    """A position labelled -100 is never read: inf logits there leave the loss and every gradient finite (0 there)."""
    logits, labels = logits_and_labels(torch.float32)
    logits = logits.detach().clone()
    logits[1, 6] = float("inf")  # row 1 is padding from position 4 on
    logits.requires_grad_()
    loss, grad = loss_and_grad(ours, logits, labels, False, 0.1)
    expected, expected_grad = exact(logits.detach().nan_to_num(posinf=0.0), labels, False, 0.1)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all() and not grad[1, 6].any()
    torch.testing.assert_close(loss, expected.float())
    torch.testing.assert_close(grad, expected_grad.float())
