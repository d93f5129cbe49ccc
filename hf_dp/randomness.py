"""The run's secret: the key from which the privacy noise and the Poisson batches are drawn.

Whoever knows the noise can subtract it from the released weights, and whoever knows the batches loses
nothing to amplification by sampling, so the key is drawn from OS entropy at the start of a run (not from
``args.seed``, which the Trainer publishes in ``training_args.bin`` and the model card), shared by the main
process with the others, and stored only in checkpoints' privacy state, which hf_dp never uploads. An
explicit ``insecure_dp_seed`` replaces it for reproducible experiments. See docs/privacy.md.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

KEY_BITS = 128
Source = Literal["os_entropy", "insecure_dp_seed"]


@dataclass(frozen=True)
class RunSecret:
    key: int
    source: Source

    @classmethod
    def draw(cls, insecure_seed: int | None = None) -> RunSecret:
        """A fresh 128-bit key from the OS CSPRNG, or one derived from the user's insecure seed."""
        if insecure_seed is None:
            return cls(secrets.randbits(KEY_BITS), "os_entropy")
        return cls(_hash("insecure_dp_seed", insecure_seed), "insecure_dp_seed")

    def derive(self, purpose: str, index: int = 0) -> int:
        """An independent 128-bit key for one use (SHA-256 of the key, the purpose and the index)."""
        return _hash(purpose, self.key, index)

    @property
    def sampling_key(self) -> int:
        return self.derive("poisson_sampling")

    @property
    def partition_key(self) -> int:
        """The key of cyclic Poisson sampling's secret partition of the units into b groups."""
        return self.derive("cyclic_partition")

    def noise_key(self, process_index: int | None) -> int:
        """One key shared by all processes (replicated gradients), or one per process (partitioned ones)."""
        return self.derive("gaussian_noise", 0 if process_index is None else 1 + process_index)

    def to_dict(self) -> dict[str, str]:
        return {"key": f"{self.key:032x}", "source": self.source}

    @classmethod
    def from_dict(cls, state: dict) -> RunSecret:
        source = state["source"]
        if source not in ("os_entropy", "insecure_dp_seed"):
            raise ValueError(f"unknown secret source {source!r}")
        return cls(int(state["key"], 16), source)


def _hash(*parts: object) -> int:
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[: KEY_BITS // 8], "little")


def shared_secret(insecure_seed: int | None) -> RunSecret:
    """The main process's secret on every process (so all draw the same global batch and replicated noise)."""
    secret = RunSecret.draw(insecure_seed)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [secret]
        dist.broadcast_object_list(box, src=0)
        secret = box[0]
    return secret
