"""First-step checks that the clipped step is exact for this model, each raising one actionable line."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hf_dp.clipping.evaluate import replay_rng, rng_state
from hf_dp.clipping.units import PrivacyUnits

LossFn = Callable[[nn.Module], torch.Tensor]

# relative change of a record's loss that counts as "moved" when another record's embeddings are perturbed
RECORDS_APART_TOLERANCE = 1e-5


def check_records_apart(
    embeddings: nn.Module, module: nn.Module, losses_of: LossFn, units: PrivacyUnits
) -> None:
    """Per-record clipping of a packed row is exact only if no record's loss reads another record (attention
    kept within records). Checked once, forward only: each record's loss must not move when the input
    embeddings of the records of the other parity are perturbed (same dropout masks; RNG left as it was)."""
    parity = units.unit_of_token % 2
    state = rng_state()
    generator = torch.Generator(device=units.unit_of_token.device).manual_seed(0)

    def losses_with(perturbed: int | None) -> torch.Tensor:
        def perturb(_module, _args, output):
            where = (units.unit_of_token >= 0) & (parity == perturbed)
            noise = torch.randn(output.shape, generator=generator, dtype=output.dtype, device=output.device)
            return output + noise * where[..., None].to(output.dtype)

        handle = None if perturbed is None else embeddings.register_forward_hook(perturb)
        replay_rng(state)
        try:
            with torch.no_grad():
                return losses_of(module).double()
        finally:
            if handle is not None:
                handle.remove()

    plain = losses_with(None)
    record_parity = torch.arange(units.count, device=plain.device) % 2
    for perturbed in (0, 1):
        moved = (losses_with(perturbed) - plain).abs() > RECORDS_APART_TOLERANCE * (1 + plain.abs())
        crossing = moved & (record_parity != perturbed)
        if crossing.any():
            raise ValueError(
                f"packed record {int(crossing.nonzero()[0])} of a row reads the tokens of other records (attention "
                "crosses records), so clipping per record would not bound its influence: pass position_ids and "
                "no attention_mask with an attention that keeps packed sequences apart (sdpa, eager, flash), and "
                "use_cache=False"
            )
    replay_rng(state)
