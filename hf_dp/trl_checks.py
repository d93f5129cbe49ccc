"""What TRL's trainers would fail on deep inside, or train with examples mixed, refused in one line before training
(hf_dp.trl's DPSFTTrainer and DPDPOTrainer call these)."""

from __future__ import annotations

from typing import Any


def refuse_moe_model(model: Any, args: Any) -> None:
    """A Mixture-of-Experts model whose config adds its load-balancing loss (TRL's default takes the model's coef)."""
    if isinstance(model, str) or not hasattr(model, "config"):
        return
    text_config = model.config.get_text_config()
    coef = args.router_aux_loss_coef
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if hasattr(text_config, "output_router_logits") and coef:
        raise ValueError(
            f"{type(model).__name__} adds its MoE load-balancing loss (router_aux_loss_coef={coef}), computed over "
            "all tokens of the batch, so one example's loss depends on the others; set router_aux_loss_coef=0.0"
        )


def refuse_unknown_text_field(dataset: Any, args: Any, formatting_func: Any, dataset_name: str) -> None:
    """An SFT dataset TRL would read by ``dataset_text_field`` that has no such column (a KeyError in its map)."""
    names = getattr(dataset, "column_names", None)
    if (
        not names
        or formatting_func is not None
        or {"input_ids", "messages", "prompt", "completion"} & set(names)
    ):
        return
    if args.dataset_text_field not in names:
        raise ValueError(
            f"{dataset_name}_dataset has no column dataset_text_field={args.dataset_text_field!r} (it has {names}): "
            "name the text column, or give a formatting_func"
        )


def refuse_pairs_without_rejected(dataset: Any, dataset_name: str) -> None:
    """A preference dataset without its rejected answers (a KeyError in TRL's map)."""
    names = getattr(dataset, "column_names", None)
    if names and not any(name.startswith("rejected") for name in names):
        raise ValueError(
            f"{dataset_name}_dataset has no 'rejected' column (it has {names}): DPO trains on pairs of a chosen and "
            "a rejected answer"
        )


def refuse_unloadable_reference(model: Any, ref_model: Any, args: Any, peft_config: Any) -> None:
    """ref_model=None for a full fine-tune: TRL reloads the reference from the model's name, which an in-memory
    model does not have."""
    if (
        ref_model is not None
        or peft_config is not None
        or args.precompute_ref_log_probs
        or isinstance(model, str)
    ):
        return
    if hasattr(model, "peft_config") or not hasattr(model, "config"):
        return
    if not getattr(model.config, "_name_or_path", ""):
        raise ValueError(
            f"ref_model=None: TRL would reload the reference from the model's name, and this {type(model).__name__} "
            "was built in memory: pass ref_model=copy.deepcopy(model), a peft_config, or precompute_ref_log_probs=True"
        )


def require(args: Any, config: type, trainer: str) -> None:
    if not isinstance(args, config):
        raise TypeError(
            f"{trainer} needs a {config.__name__} (from hf_dp.trl: TRL's config with the DP fields), got "
            f"{type(args).__name__}"
        )
