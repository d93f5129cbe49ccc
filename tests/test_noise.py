"""The Gaussian noise source: right std, independent chunks, reproducible from its state, secure mode."""

from __future__ import annotations

import torch

from hf_dp.noise import GaussianNoise

CPU = torch.device("cpu")


def test_large_draws_have_the_right_std_and_independent_chunks():
    noise = GaussianNoise(seed=3).sample(torch.Size([4_000_000]), 0.25, CPU, torch.float32)
    assert abs(noise.std().item() / 0.25 - 1) < 0.003
    assert abs(noise.mean().item()) < 4 * 0.25 / 2000
    first, second = noise.view(2, -1)
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 0.003
    assert not torch.equal(first, second)


def test_successive_draws_are_independent_and_replayable_from_state():
    source = GaussianNoise(seed=11)
    source.sample(torch.Size([10]), 1.0, CPU, torch.float32)
    state = source.state_dict()
    a = source.sample(torch.Size([3_000_000]), 1.0, CPU, torch.float32)
    b = source.sample(torch.Size([3_000_000]), 1.0, CPU, torch.float32)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.003
    replay = GaussianNoise(seed=0)
    replay.load_state_dict(state)
    assert torch.equal(replay.sample(torch.Size([3_000_000]), 1.0, CPU, torch.float32), a)


def test_same_seed_same_noise_and_secure_mode_is_not_reproducible():
    shape = torch.Size([2_000_000])
    assert torch.equal(
        GaussianNoise(5).sample(shape, 1.0, CPU, torch.float32),
        GaussianNoise(5).sample(shape, 1.0, CPU, torch.float32),
    )
    secure = GaussianNoise(5, secure_mode=True)
    first = secure.sample(torch.Size([100_000]), 2.0, CPU, torch.float32)
    assert not torch.equal(first, secure.sample(torch.Size([100_000]), 2.0, CPU, torch.float32))
    assert abs(first.std().item() / 2.0 - 1) < 0.02
