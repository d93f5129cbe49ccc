"""Private SFT and DPO through TRL's own trainers: ``DPSFTTrainer`` / ``DPSFTConfig`` and ``DPDPOTrainer`` /
``DPDPOConfig`` (docs/trl.md).

    DPSFTTrainer = DPTrainerMixin + trl.SFTTrainer    one privacy unit per example (per record when packed)
    DPDPOTrainer = DPTrainerMixin + trl.DPOTrainer    one privacy unit per preference pair (its two rows)

TRL prepares the data, the chat templates, peft and the reference model exactly as it does without DP; the
mixin samples, clips, noises and accounts. What changes under DP:

- the loss is one value per privacy unit (``compute_per_example_loss``): SFT, the mean over each example's
  trained tokens (TRL's ``labels``, with its assistant / completion masks applied); DPO, each pair's own loss;
- ``packing=True`` (bfd) packs the Poisson-sampled records of each micro-batch padding-free, never the dataset;
- settings whose loss mixes units (or that split records, or clip the noisy aggregate) are refused in one line.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import TrainingArguments
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from hf_dp.arguments import DPTrainingArguments
from hf_dp.clipping.units import PrivacyUnits
from hf_dp.data import split_dp_keys
from hf_dp.dpo_losses import BATCH_LOSS_TYPES, F_SCORES, PAIR_LOSSES, PER_PAIR_LOSS_TYPES, PairTerms
from hf_dp.losses import IGNORE_INDEX, shifted_labels
from hf_dp.trainer import DPTrainerMixin
from hf_dp.trl_checks import (
    refuse_moe_model,
    refuse_pairs_without_rejected,
    refuse_unknown_text_field,
    refuse_unloadable_reference,
    require,
)

logger = logging.getLogger(__name__)

# TrainingArguments fields that DPTrainingArguments sets on purpose, whatever TRL's config says (the configs'
# tests compare every other field with TRL's own config).
DP_OVERRIDES = {
    "max_grad_norm": "0, not TRL's 1.0: the Trainer would clip the NOISY aggregate; the per-example clip is "
    "per_sample_max_grad_norm",
}

# ---- the configs --------------------------------------------------------------------------------------


def _refuse(config: Any, name: str, why: str) -> None:
    raise ValueError(f"{type(config).__name__}: {name}={getattr(config, name)!r} {why}")


def _copy_field(f: dataclasses.Field) -> dataclasses.Field:
    return dataclasses.field(
        default=f.default,
        default_factory=f.default_factory,
        init=f.init,
        repr=f.repr,
        hash=f.hash,
        compare=f.compare,
        metadata=f.metadata,
        kw_only=f.kw_only,
    )


def _keeping_trl_fields(trl_config: type) -> Any:
    """Re-declare in the decorated class every TrainingArguments field that ``trl_config`` re-declares (its own
    default, type and help), unless DPTrainingArguments re-declares it too (``DP_OVERRIDES``: DP's wins).

    Why: ``@dataclass class C(DPTrainingArguments, SFTConfig)`` collects fields along the reversed MRO, and
    DPTrainingArguments, itself a dataclass over TrainingArguments, carries ALL of TrainingArguments' fields with
    their defaults, so they land after SFTConfig's and silently revert TRL's (learning_rate, logging_steps,
    gradient_checkpointing, bf16). The other base order would revert ``max_grad_norm`` to 1.0 instead. Fields are
    found by identity (a field re-declared in a subclass is a new ``Field`` object), so a field TRL adds to or
    changes in a later release is kept without editing this module; the tests compare every default.
    """
    inherited = TrainingArguments.__dataclass_fields__
    dp_fields = DPTrainingArguments.__dataclass_fields__

    def decorate(cls: type) -> type:
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name, f in trl_config.__dataclass_fields__.items():
            if name not in inherited or f is inherited[name] or name in annotations:
                continue  # TRL's own field (no conflict), TrainingArguments' as is, or declared in the class
            if dp_fields[name] is not inherited[name]:
                continue  # DPTrainingArguments re-declares it on purpose
            annotations[name] = f.type
            setattr(cls, name, _copy_field(f))
        cls.__annotations__ = annotations
        return cls

    return decorate


def _refuse_router_aux_loss(config: Any) -> None:
    if config.router_aux_loss_coef:
        _refuse(
            config,
            "router_aux_loss_coef",
            "adds the MoE load-balancing loss, computed over all tokens of the batch, so one example's loss "
            "depends on the others; set it to 0.0",
        )


@dataclasses.dataclass
@_keeping_trl_fields(SFTConfig)
class DPSFTConfig(DPTrainingArguments, SFTConfig):
    """``trl.SFTConfig`` + ``DPTrainingArguments`` for ``DPSFTTrainer``: TRL's defaults (learning_rate 2e-5,
    logging_steps 10, gradient_checkpointing and bf16 on) and every DP field and check.

    ``packing=True`` (the default strategy ``"bfd"``) is honoured as padding-free collation of the Poisson-sampled
    records: each micro-batch's records are packed into one row (position ids restarting at 0, no attention
    across records) and each record stays its own privacy unit. The dataset itself is never packed: a pre-packed
    row holds several records, so sampling rows would make the packed row the unit, and best-fit packing depends
    on the whole dataset. Records longer than ``max_length`` are truncated, as bfd does.

    Refused in one line: ``packing_strategy`` ``"wrapped"`` / ``"bfd_split"`` (they cut records across rows),
    ``pad_to_multiple_of`` with packing or padding-free (the pad tokens would read as extra records),
    ``router_aux_loss_coef`` (a batch-level MoE loss), and, as for every DPTrainingArguments, ``max_grad_norm``
    other than 0 and the fields in docs/trainer-arguments.md.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.packing and self.packing_strategy != "bfd":
            _refuse(
                self,
                "packing_strategy",
                "cuts records across the rows of a pre-packed dataset, so a sampled row would hold parts of several "
                "examples and one example could sit in several rows; use packing_strategy='bfd' (under DP: the "
                "sampled records of each micro-batch packed padding-free, each its own privacy unit) or packing=False",
            )
        if self.pad_to_multiple_of is not None and (self.packing or self.padding_free):
            _refuse(
                self,
                "pad_to_multiple_of",
                "pads the packed row with position-0 tokens, which would read as extra records; leave it None "
                "with packing or padding_free",
            )
        _refuse_router_aux_loss(self)


@dataclasses.dataclass
@_keeping_trl_fields(DPOConfig)
class DPDPOConfig(DPTrainingArguments, DPOConfig):
    """``trl.DPOConfig`` + ``DPTrainingArguments`` for ``DPDPOTrainer``: TRL's defaults (learning_rate 1e-6,
    logging_steps 10, gradient_checkpointing and bf16 on) and every DP field and check.

    One dataset row is one preference pair, the privacy unit. Refused in one line: loss types whose loss reads
    other pairs (``BATCH_LOSS_TYPES``: ``aot``, ``aot_unpaired``, ``sft``) or that have no per-pair version
    here, ``router_aux_loss_coef`` (a batch-level MoE loss) and, as for every DPTrainingArguments,
    ``max_grad_norm`` other than 0 and the fields in docs/trainer-arguments.md.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        for loss_type in self.loss_type:
            if loss_type in BATCH_LOSS_TYPES:
                raise ValueError(
                    f"DPDPOConfig: loss_type {loss_type!r} {BATCH_LOSS_TYPES[loss_type]}, which per-pair clipping "
                    f"cannot bound; use per-pair loss types ({', '.join(PER_PAIR_LOSS_TYPES)})"
                )
            if loss_type not in PER_PAIR_LOSS_TYPES:
                raise ValueError(
                    f"DPDPOConfig: loss_type {loss_type!r} has no per-pair version in hf_dp; use one of "
                    f"{', '.join(PER_PAIR_LOSS_TYPES)}"
                )
        _refuse_router_aux_loss(self)


# ---- the trainers -------------------------------------------------------------------------------------


def _token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels_t) at each position, 0 where the label is -100; in float32 at least."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    flat = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return -flat.view(labels.shape)


# ---- SFT ----------------------------------------------------------------------------------------------


class DPSFTTrainer(DPTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` with differential privacy, configured by ``DPSFTConfig``; one unit per example.

    L_i is the mean token loss over example i's trained tokens: TRL's ``labels``, where its dataset preparation
    has already set -100 outside the assistant turns (``assistant_only_loss``) and on the prompt
    (``completion_only_loss``); masks that a custom collator hands over as ``assistant_masks`` /
    ``completion_mask`` are applied to the labels here, so labels and masks always agree. For padding-free packed
    rows (``packing=True`` or ``padding_free=True``) each packed record is its own unit with its own loss; a
    record's first label is -100 (TRL's collator), and no position predicts a token of the next record.

    The model runs its plain forward (logits through the LM head module, where the clipping hooks are), not
    TRL's fused LM head, which reads the head's weight outside its module. Evaluation keeps TRL's own loss.
    TRL's extra training metrics (entropy, token accuracy, tokens seen) are not logged under DP.
    """

    def __init__(self, model: Any, args: DPSFTConfig | None = None, *more: Any, **kwargs: Any) -> None:
        require(args, DPSFTConfig, type(self).__name__)
        refuse_moe_model(model, args)
        self._packing_logged = False
        super().__init__(model, args, *more, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL's preparation (tokenised, labelled, truncated to max_length), never packed for training: under DP the
        sampled records are packed per micro-batch by the padding-free collator."""
        refuse_unknown_text_field(dataset, args, formatting_func, dataset_name)
        if packing and dataset_name == "train":
            packing = False
            if not self._packing_logged:
                logger.warning(
                    "hf_dp: packing=True packs the Poisson-sampled records of each micro-batch into one row "
                    "(padding-free, each record its own privacy unit); the dataset itself is not pre-packed"
                )
                self._packing_logged = True
        return super()._prepare_dataset(
            dataset, processing_class, args, packing, formatting_func, dataset_name
        )

    def compute_per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """L_i per example (per packed record): the mean NLL (or DFT) over its trained tokens, shape (U,)."""
        inputs = dict(inputs)
        labels = inputs["labels"]
        assistant = inputs.pop("assistant_masks", None)
        if assistant is not None:
            labels = labels.masked_fill(assistant == 0, IGNORE_INDEX)
        completion = inputs.pop("completion_mask", None)
        if completion is not None and self.completion_only_loss:
            labels = labels.masked_fill(completion == 0, IGNORE_INDEX)
        inputs["labels"] = labels
        inputs["use_cache"] = False
        if self.args.loss_type == "dft":
            return self._dft_losses(model, inputs)
        return super().compute_per_example_loss(model, inputs)

    def _dft_losses(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """DFT (Wu et al. 2025, TRL's ``loss_type="dft"``): each token's NLL times its own detached probability,
        averaged over the example's (the packed record's) trained tokens."""
        micro = self._micro_batch
        units = None if micro is None else micro.units
        inputs = dict(inputs)
        labels = shifted_labels(inputs.pop("labels"), units)  # no position predicts the next record
        outputs = model(**inputs)
        nll = -_token_log_probs(outputs["logits"] if isinstance(outputs, dict) else outputs[0], labels)
        token_losses = nll * torch.exp(-nll).detach()
        labelled = labels != IGNORE_INDEX
        if units is not None and units.unit_of_token is not None:
            return units.mean_over_tokens(token_losses, labelled)
        return token_losses.sum(dim=1) / labelled.sum(dim=1).clamp(min=1)


# ---- DPO ----------------------------------------------------------------------------------------------


class DPDPOTrainer(DPTrainerMixin, DPOTrainer):
    """``trl.DPOTrainer`` with differential privacy, configured by ``DPDPOConfig``; one unit per preference pair.

    TRL's batch stacks the B pairs' chosen rows over their rejected rows (2B rows); ``privacy_units`` groups rows
    b and B + b into pair b, so each pair's gradient (both rows, cross terms included) is clipped as one.
    ``compute_per_example_loss`` is each pair's DPO loss, TRL's formulas for the per-pair loss types without the
    batch mean. The reference log-probabilities come from TRL's ``compute_ref_log_probs`` (the reference model, or
    the peft model with its adapter disabled) under ``torch.no_grad``, once per micro-batch and BEFORE the clipped
    forward, so the clipping hooks never see the reference and it gets no gradient and no noise; with
    ``precompute_ref_log_probs`` they come from the dataset, computed once by TRL before training.

    TRL's extra training metrics (rewards, log-probs, entropy) are not logged under DP.
    """

    privacy_unit = "pair"

    def __init__(self, model: Any, ref_model: Any = None, args: DPDPOConfig | None = None, *more, **kwargs):
        require(args, DPDPOConfig, type(self).__name__)
        refuse_moe_model(model, args)
        refuse_unloadable_reference(model, ref_model, args, kwargs.get("peft_config"))
        super().__init__(model, ref_model, args, *more, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        refuse_pairs_without_rejected(dataset, dataset_name)
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def privacy_units(self, inputs: dict[str, Any], unit_of_row: torch.Tensor | None) -> PrivacyUnits:
        """Pair b is rows b (chosen) and B + b (rejected) of the concatenated forward."""
        rows = inputs["input_ids"].shape[0]
        return PrivacyUnits.of_rows(torch.arange(rows // 2, device=inputs["input_ids"].device).repeat(2))

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        if "ref_chosen_logps" not in inputs:
            inputs = self._with_reference_log_probs(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def _with_reference_log_probs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The micro-batch with the frozen reference's log-probabilities, computed without gradients and outside
        the clipped forward (the clipping hooks record nothing outside it)."""
        inputs = self._prepare_inputs(inputs)
        batch, _, _ = split_dp_keys(inputs)
        reference = self.ref_model if self.ref_model is not None else self.model
        with torch.no_grad():
            chosen, rejected = self.compute_ref_log_probs(reference, batch)
        return {**inputs, "ref_chosen_logps": chosen.detach(), "ref_rejected_logps": rejected.detach()}

    def compute_per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Each pair's DPO loss, shape (B,), from one forward of the 2B rows (the plain forward: logits through
        the LM head module, where the clipping hooks are)."""
        completion_mask = inputs["completion_mask"]
        model_inputs = {
            k: v
            for k, v in inputs.items()
            if k not in ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")
        }
        model_inputs["use_cache"] = False
        outputs = model(**model_inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        seq_len = completion_mask.shape[1] - 1
        # prompt-learning peft prepends virtual tokens to the outputs: keep the real tokens' positions
        logits = logits[:, -(seq_len + 1) : -1]
        shift_mask = completion_mask[:, 1:]
        labels = inputs["input_ids"][:, 1:].masked_fill(shift_mask == 0, IGNORE_INDEX)
        per_token_logps = _token_log_probs(logits, labels)
        logps = self._sequence_log_probs(per_token_logps, shift_mask)
        chosen_logps, rejected_logps = logps.chunk(2, dim=0)
        weights = None
        if self.use_weighting:
            with torch.no_grad():
                log_sum_sq = torch.logsumexp(2 * torch.log_softmax(logits.to(per_token_logps.dtype), -1), -1)
                aligned = (per_token_logps - log_sum_sq) * shift_mask
                mean = aligned.sum(dim=1) / shift_mask.sum(dim=1).clamp_min(1)
                chosen_w, rejected_w = torch.exp(mean).chunk(2, dim=0)
                weights = chosen_w * rejected_w
        ref_chosen = inputs["ref_chosen_logps"].to(chosen_logps.dtype)
        ref_rejected = inputs["ref_rejected_logps"].to(chosen_logps.dtype)
        return self.pair_losses(
            chosen_logps, rejected_logps, ref_chosen, ref_rejected, completion_mask, weights
        )

    def _sequence_log_probs(self, per_token_logps: torch.Tensor, shift_mask: torch.Tensor) -> torch.Tensor:
        """Σ over each row's completion tokens (LD-DPO: the tokens past the shorter completion weighted by α)."""
        if self.ld_alpha is None:
            return per_token_logps.sum(dim=1)
        comp_pos = shift_mask.cumsum(dim=1)
        chosen_lens, rejected_lens = shift_mask.sum(dim=1).long().chunk(2, dim=0)
        shared_lens = torch.minimum(chosen_lens, rejected_lens).repeat(2)
        shared = (comp_pos > 0) & (comp_pos <= shared_lens[:, None])
        tail = comp_pos > shared_lens[:, None]
        return (per_token_logps * shared).sum(dim=1) + self.ld_alpha * (per_token_logps * tail).sum(dim=1)

    def pair_losses(
        self,
        chosen_logps: torch.Tensor,
        rejected_logps: torch.Tensor,
        ref_chosen_logps: torch.Tensor,
        ref_rejected_logps: torch.Tensor,
        completion_mask: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The DPO loss of each pair, (B,): TRL 1.16's per-pair formulas (``DPOTrainer._compute_loss``) for
        ``self.loss_types`` weighted by ``self.loss_weights``, the f-divergence scores and WPO ``weights``, without
        the mean over the batch (its mean is TRL's loss; tests/test_trl.py checks it against TRL)."""
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        chosen_scores, rejected_scores = self._f_scores(chosen_logratios), self._f_scores(rejected_logratios)
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        terms = PairTerms(
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            discopop_tau=self.args.discopop_tau,
            chosen_logratios=chosen_logratios,
            rejected_logratios=rejected_logratios,
            chosen_scores=chosen_scores,
            rejected_scores=rejected_scores,
            delta=chosen_scores - rejected_scores,
            chosen_len=chosen_mask.sum(dim=1).clamp(min=1.0),
            rejected_len=rejected_mask.sum(dim=1).clamp(min=1.0),
        )
        total = torch.zeros_like(chosen_logps)
        for loss_type, weight in zip(self.loss_types, self.loss_weights, strict=True):
            if loss_type not in PAIR_LOSSES:  # DPDPOConfig refuses the others
                raise ValueError(f"DPDPOTrainer: loss_type {loss_type!r} has no per-pair version")
            loss = PAIR_LOSSES[loss_type](terms)
            if weights is not None:
                loss = loss * weights
            total = total + weight * loss
        return total

    def _f_scores(self, logratios: torch.Tensor) -> torch.Tensor:
        """f'(π/π_ref) of the f-DPO divergence (reverse KL: the log-ratio itself), as TRL computes it."""
        kind = self.f_divergence_type
        if kind not in F_SCORES:
            raise ValueError(f"DPDPOTrainer: unknown f_divergence_type {kind!r}")
        return F_SCORES[kind](logratios, self.f_alpha_divergence_coef)


__all__ = [
    "DP_OVERRIDES",
    "DPDPOConfig",
    "DPDPOTrainer",
    "DPSFTConfig",
    "DPSFTTrainer",
]
