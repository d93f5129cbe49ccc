"""The DPO losses of one preference pair (TRL 1.16's formulas, one value per pair): ``PairTerms``, the registry
``PAIR_LOSSES`` of the per-pair loss types, the loss types refused because they read other pairs
(``BATCH_LOSS_TYPES``), and the f-DPO divergences' scores ``F_SCORES`` (docs/trl.md)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class PairTerms:
    """What a per-pair DPO loss reads, (B,) each: log-ratios r = log π/π_ref, their f-scores f'(π/π_ref),
    Δ = f_chosen − f_rejected, the completion lengths, and the config's β, label smoothing ε and DiscoPOP τ."""

    beta: float
    label_smoothing: float
    discopop_tau: float
    chosen_logratios: torch.Tensor
    rejected_logratios: torch.Tensor
    chosen_scores: torch.Tensor
    rejected_scores: torch.Tensor
    delta: torch.Tensor
    chosen_len: torch.Tensor
    rejected_len: torch.Tensor


def _sigmoid_loss(t: PairTerms) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): −log σ(βΔ)."""
    return -F.logsigmoid(t.beta * t.delta)


def _hinge_loss(t: PairTerms) -> torch.Tensor:
    """SLiC (Zhao et al. 2023): max(0, 1 − βΔ)."""
    return torch.relu(1 - t.beta * t.delta)


def _ipo_loss(t: PairTerms) -> torch.Tensor:
    """IPO (Azar et al. 2023), length-averaged scores: (f_c/|c| − f_r/|r| − 1/(2β))²."""
    return (t.chosen_scores / t.chosen_len - t.rejected_scores / t.rejected_len - 1 / (2 * t.beta)) ** 2


def _exo_pair_loss(t: PairTerms) -> torch.Tensor:
    """EXO (Ji et al. 2024): σ(βΔ)(log σ(βΔ) − log(1−ε)) + σ(−βΔ)(log σ(−βΔ) − log ε)."""
    x = t.beta * t.delta
    epsilon = torch.tensor(t.label_smoothing, dtype=t.delta.dtype, device=t.delta.device)
    return torch.sigmoid(x) * (F.logsigmoid(x) - torch.log1p(-epsilon)) + (
        torch.sigmoid(-x) * (F.logsigmoid(-x) - torch.log(epsilon))
    )


def _nca_pair_loss(t: PairTerms) -> torch.Tensor:
    """NCA (Chen et al. 2024): −log σ(βr_c) − ½ log σ(−βr_c) − ½ log σ(−βr_r)."""
    chosen_rewards, rejected_rewards = t.beta * t.chosen_logratios, t.beta * t.rejected_logratios
    return (
        -F.logsigmoid(chosen_rewards)
        - 0.5 * F.logsigmoid(-chosen_rewards)
        - 0.5 * F.logsigmoid(-rejected_rewards)
    )


def _robust_loss(t: PairTerms) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024): (−(1−ε) log σ(βΔ) + ε log σ(−βΔ))/(1 − 2ε)."""
    x, smoothing = t.beta * t.delta, t.label_smoothing
    return (-(1 - smoothing) * F.logsigmoid(x) + smoothing * F.logsigmoid(-x)) / (1 - 2 * smoothing)


def _bco_pair_loss(t: PairTerms) -> torch.Tensor:
    """BCO on pairs (Jung et al. 2024): −log σ(βr_c) − log σ(−βr_r)."""
    return -F.logsigmoid(t.beta * t.chosen_logratios) - F.logsigmoid(-t.beta * t.rejected_logratios)


def _sppo_hard_loss(t: PairTerms) -> torch.Tensor:
    """SPPO, hard labels (Wu et al. 2024): (r_c − 1/(2β))² + (r_r + 1/(2β))²."""
    return (t.chosen_logratios - 0.5 / t.beta) ** 2 + (t.rejected_logratios + 0.5 / t.beta) ** 2


def _apo_zero_loss(t: PairTerms) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024): 1 − σ(βr_c) + σ(βr_r)."""
    return 1 - torch.sigmoid(t.beta * t.chosen_logratios) + torch.sigmoid(t.beta * t.rejected_logratios)


def _apo_down_loss(t: PairTerms) -> torch.Tensor:
    """APO-down (D'Oosterlinck et al. 2024): σ(βr_c) + 1 − σ(β(r_c − r_r))."""
    return (
        torch.sigmoid(t.beta * t.chosen_logratios)
        + 1
        - torch.sigmoid(t.beta * (t.chosen_logratios - t.rejected_logratios))
    )


def _discopop_loss(t: PairTerms) -> torch.Tensor:
    """DiscoPOP (Chan et al. 2024), x = βΔ, m = σ(x/τ): −log σ(x)(1 − m) + e^{−x} m."""
    logits = t.beta * t.delta
    modulation = torch.sigmoid(logits / t.discopop_tau)
    return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation


def _sigmoid_norm_loss(t: PairTerms) -> torch.Tensor:
    """Length-normalised DPO: −log σ(β(f_c/|c| − f_r/|r|))."""
    return -F.logsigmoid(t.beta * (t.chosen_scores / t.chosen_len - t.rejected_scores / t.rejected_len))


# DPO loss types whose loss is a function of each pair alone, to that loss
PAIR_LOSSES: dict[str, Callable[[PairTerms], torch.Tensor]] = {
    "sigmoid": _sigmoid_loss,
    "hinge": _hinge_loss,
    "ipo": _ipo_loss,
    "exo_pair": _exo_pair_loss,
    "nca_pair": _nca_pair_loss,
    "robust": _robust_loss,
    "bco_pair": _bco_pair_loss,
    "sppo_hard": _sppo_hard_loss,
    "apo_zero": _apo_zero_loss,
    "apo_down": _apo_down_loss,
    "discopop": _discopop_loss,
    "sigmoid_norm": _sigmoid_norm_loss,
}
PER_PAIR_LOSS_TYPES = tuple(PAIR_LOSSES)
# ... and those whose loss reads the other pairs of the batch
BATCH_LOSS_TYPES = {
    "aot": "sorts the log-ratios of the whole batch, so each pair's loss pairs it with another pair's",
    "aot_unpaired": "sorts the log-ratios of the whole batch, so each pair's loss pairs it with another pair's",
    "sft": "averages the chosen tokens of the whole batch, so each pair's weight depends on the others' lengths",
}

# The α-divergence's exp((α−1)r) is clamped so that it stays finite after the cast back to the input dtype:
# e^11 ≈ 6.0e4 < 65504 (fp16's max), e^80 ≈ 5.5e34 < 3.4e38 (fp32's and bf16's max).
FP16_EXP_CLAMP = 11.0
EXP_CLAMP = 80.0


def _alpha_divergence_scores(logratios: torch.Tensor, alpha: float) -> torch.Tensor:
    """(e^{(α−1)r} − 1)/(α − 1), computed in at least fp32; the limit α → 1 is the reverse KL's r."""
    if abs(alpha - 1.0) < 1e-6:
        return logratios
    t = (alpha - 1.0) * logratios
    work = t if t.dtype == torch.float64 else t.float()
    clamp = FP16_EXP_CLAMP if t.dtype == torch.float16 else EXP_CLAMP
    return (torch.exp(work.clamp(max=clamp)) - 1.0).to(t.dtype) * (1.0 / (alpha - 1.0))


# f'(π/π_ref) of each f-DPO divergence (Wang et al. 2023) as a function of r = log π/π_ref and α, as TRL has it
F_SCORES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda logratios, alpha: logratios,
    "forward_kl": lambda logratios, alpha: 1 - torch.exp(-logratios),
    "js_divergence": lambda logratios, alpha: math.log(2) + F.logsigmoid(logratios),
    "alpha_divergence": _alpha_divergence_scores,
}


__all__ = ["BATCH_LOSS_TYPES", "F_SCORES", "PAIR_LOSSES", "PER_PAIR_LOSS_TYPES", "PairTerms"]
