"""The global random state of a pass, replayed so that another pass over the same micro-batch draws the same
dropout masks (the weighted pass after the norm pass, DiSK's second evaluation, the first step's checks).

Not the run's secret (``hf_dp/randomness.py``), which never touches the global generators.
"""

from __future__ import annotations

import torch

RngState = tuple[torch.Tensor, list[torch.Tensor]]


def rng_state() -> RngState:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return torch.get_rng_state(), cuda


def replay_rng(state: RngState) -> None:
    """Restore the global generators, so the next pass draws the same dropout masks as the recorded one."""
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])
