"""Gaussian noise for the privatised gradient, from a seeded (reproducible) or OS-entropy source."""

from __future__ import annotations

import math
import secrets
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# Large draws are split into this many chunks, each from its own generator seeded by the main one and
# filled on its own thread (torch's CPU normal sampler is single-threaded). A fixed count keeps the
# noise a function of the seed alone, whatever the machine's thread count.
_CHUNKS = 2
_CHUNKED_ABOVE = 1 << 20
_POOL = ThreadPoolExecutor(max_workers=_CHUNKS)


def _fill_normal(chunk: torch.Tensor, generator: torch.Generator) -> None:
    chunk.normal_(generator=generator)


class GaussianNoise:
    """Draws N(0, std²) tensors from a dedicated generator whose state can be saved and restored.

    ``secure_mode`` draws each tensor from a fresh PCG64DXSM stream with a 128-bit seed from the OS
    CSPRNG (torch's CPU generator keeps only 32 bits of a seed, which a search could recover) and
    averages two draws (scaled by √2) as a guard against floating-point attacks on the sampler
    (Holohan & Braghin 2021). Such noise is not reproducible, so checkpoints do not replay it.
    """

    def __init__(self, seed: int, secure_mode: bool = False) -> None:
        self.seed = seed
        self.secure_mode = secure_mode
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def sample(self, shape: torch.Size, std: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """One N(0, std²) tensor of ``shape`` (computed in at least float32)."""
        work = torch.promote_types(dtype, torch.float32)
        if self.secure_mode:
            stream = np.random.Generator(np.random.PCG64DXSM(secrets.randbits(128)))
            pair = torch.from_numpy(stream.standard_normal((2, *shape)))
            return (pair.sum(dim=0) * (std / math.sqrt(2.0))).to(device=device, dtype=dtype)
        generator = self._generator(device)
        out = torch.empty(shape, device=device, dtype=work)
        if out.numel() < _CHUNKED_ABOVE or device.type != "cpu":
            out.normal_(generator=generator)
        else:
            seeds = torch.randint(0, 2**62, (_CHUNKS,), generator=generator, device=device).tolist()
            chunk_generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
            list(_POOL.map(_fill_normal, out.view(-1).chunk(_CHUNKS), chunk_generators))
        return out.mul_(std).to(dtype)

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "generators": {str(d): g.get_state() for d, g in self._generators.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self._generators = {}
        for device_name, rng_state in state["generators"].items():
            device = torch.device(device_name)
            generator = torch.Generator(device=device)
            generator.set_state(
                rng_state.cpu() if isinstance(rng_state, torch.Tensor) else torch.as_tensor(rng_state)
            )
            self._generators[device] = generator
