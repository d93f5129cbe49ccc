"""The privacy guarantee in the model card: YAML metadata for machines and a prose section for people.

``DPTrainer.create_model_card`` (which ``push_to_hub`` calls before uploading) writes the Trainer's card and
then calls ``add_privacy_to_model_card`` on it, so every card hf_dp writes or uploads states (ε, δ) and how
they were obtained, or says plainly that the model has no privacy guarantee.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from typing import Any

from huggingface_hub import ModelCard

from hf_dp.privacy import UNITS

METADATA_KEY = "differential_privacy"
SECTION_TITLE = "## Differential privacy"
DP_TAG = "differential-privacy"

_OPTIMIZER_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
_RANDOMNESS_WORDS = {
    "os_entropy": "drawn from a secret key taken from OS entropy for this run and never published",
    "secure_mode": "a fresh OS-entropy draw for every noise tensor and every batch (secure_mode)",
    "insecure_dp_seed": "**derived from a user-given seed (`insecure_dp_seed`): anyone who knows that seed can "
    "regenerate the noise and remove it, so this guarantee holds only while the seed stays secret**",
}
_ACCOUNTANT_NAMES = {"prv": "PRV accountant (Gopi et al. 2021)", "rdp": "RDP accountant (Mironov 2017)"}


def _plain(value: Any) -> Any:
    """Python scalars, lists and dicts only, so the YAML holds no numpy or torch tags."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def is_private(report: dict[str, Any]) -> bool:
    """True when the run carries a finite (ε, δ) guarantee: DP on and noise added."""
    return not report["disable_dp"] and report["noise_multiplier"] > 0 and math.isfinite(report["epsilon"])


def privacy_metadata(report: dict[str, Any], dataset: str | list[str] | None = None) -> dict[str, Any]:
    """The ``differential_privacy:`` mapping of the card's YAML front matter, from ``privacy_report()``."""
    private = is_private(report)
    return _plain(
        {
            "guarantee": "(epsilon, delta)-DP" if private else "none",
            "unit": report["unit"],
            "max_examples_per_unit": report.get("max_examples_per_unit"),
            "noise_randomness": report["noise_randomness"],
            "allow_large_delta": report["allow_large_delta"],
            "library": "hf_dp",
            "epsilon": report["epsilon"] if private else math.inf,
            "delta": report["delta"],
            "target_epsilon": report["target_epsilon"],
            "accountant": report["accountant"],
            "noise_multiplier": report["noise_multiplier"],
            "noise_phases": report["noise_phases"],
            "max_grad_norm": report["max_grad_norm"],
            "sample_rate": report["sample_rate"],
            "sampling": report["sampling"],
            "noise_mechanism": report["noise_mechanism"],
            "num_bands": report["num_bands"],
            "strategy_coefs": report["strategy_coefs"],
            "accounting": report["accounting"],
            "steps": report["steps"],
            "expected_batch_size": report["expected_batch_size"],
            "num_train_examples": report["num_train_examples"],
            "dataset": dataset,
            "optimizer": report["optimizer"],
            "optimizer_kwargs": report["optimizer_kwargs"],
            "clipping_mode": report["clipping_mode"],
            "clipping_fn": report["clipping_fn"],
            "clipping_groups": report.get("clipping_groups"),
            "disable_dp": report["disable_dp"],
        }
    )


def _groups(report: dict[str, Any]) -> str:
    """Group-wise clipping as the card states it (nothing for flat clipping)."""
    groups = report.get("clipping_groups", "")
    return f"; {groups}" if groups.startswith("group-wise") else ""


def _dataset_words(dataset: str | list[str] | None) -> str:
    if not dataset:
        return "the training set"
    names = [dataset] if isinstance(dataset, str) else list(dataset)
    return " + ".join(names)


def _optimizer_name(report: dict[str, Any]) -> str:
    name = _OPTIMIZER_NAMES.get(report["optimizer"], report["optimizer"])
    return f"DP-{name}" if is_private(report) else name


def privacy_section(report: dict[str, Any], dataset: str | list[str] | None = None) -> str:
    """The "## Differential privacy" prose: the guarantee in words, or that there is none."""
    data = _dataset_words(dataset)
    if not is_private(report):
        why = (
            "`disable_dp=True`: no per-example clipping and no noise"
            if report["disable_dp"]
            else "noise multiplier σ = 0: clipping without noise"
        )
        return (
            f"{SECTION_TITLE}\n\n"
            f"**This model has NO differential privacy guarantee** (ε = ∞). hf_dp trained it with {why}, "
            f"as a non-private baseline on {data} "
            f"(N = {report['num_train_examples']} {UNITS[report['unit']][1]}). Do not treat it or its outputs as "
            "private.\n"
        )
    rate, batch = f"{report['sample_rate']:.4g}", report["expected_batch_size"]
    if report["sampling"] == "poisson":
        sampling = f"Poisson sampling (rate q = {rate}, expected batch {batch})"
    elif report["num_bands"] > 1:
        sampling = (
            f"cyclic Poisson sampling: the {UNITS[report['unit']][1]} split once into {report['num_bands']} secret "
            f"groups, step t drawing from group t mod {report['num_bands']} at rate p = {rate} (expected batch {batch})"
        )
    else:
        sampling = (
            f"{report['sampling']} of {batch} examples, accounted AS IF Poisson-sampled with rate "
            f"q = {rate}, which they were not"
        )
    phases = report["noise_phases"]
    sigma = (
        f"{report['noise_multiplier']:.4g}"
        if len({s for s, _ in phases}) < 2
        else ", then ".join(f"{s:.4g} for {n} accounted steps" for s, n in phases)
    )
    noise = (
        f"Gaussian noise multiplier σ = {sigma}, independent across steps"
        if report["num_bands"] == 1
        else f"Gaussian noise multiplier σ = {sigma}, correlated across steps by a "
        f"{report['num_bands']}-banded Toeplitz strategy (DP-BandMF, largest column norm 1)"
    )
    kwargs = f" ({report['optimizer_kwargs']})" if report["optimizer_kwargs"] else ""
    randomness = _RANDOMNESS_WORDS[report["noise_randomness"]]
    large_delta = (
        f"\n- **δ = {report['delta']:.3g} is not below 1/N** (allowed explicitly with `allow_large_delta`): the "
        "guarantee then permits publishing individual examples with probability up to δ"
        if report["delta"] >= 1 / report["num_train_examples"]
        else ""
    )
    guarantee = f"(ε, δ) = ({report['epsilon']:.4g}, {report['delta']:.3g})"
    accountant = _ACCOUNTANT_NAMES.get(report["accountant"], report["accountant"])
    target = "" if report["target_epsilon"] is None else f" (target ε {report['target_epsilon']:g})"
    return (
        f"{SECTION_TITLE}\n\n"
        f"This model was trained with hf_dp and is **{guarantee}-differentially private at the "
        f"{report['unit']} level**: adding or removing any one {UNITS[report['unit']][0]} of the "
        f"N = {report['num_train_examples']} {UNITS[report['unit']][1]} of {data} changes the probability of "
        f"any set of released weights by at most a factor e^ε, plus δ.{_unit_note(report)}\n\n"
        f"- accounting: {accountant} over {report['steps']} steps{target}; {report['accounting']}\n"
        f"- sampling: {sampling}\n"
        f"- per-example clip norm C = {report['max_grad_norm']:g} ({report['clipping_fn']} clipping, "
        f"{report['clipping_mode']} mode{_groups(report)}); {noise}\n"
        f"- optimizer: {_optimizer_name(report)}{kwargs}\n"
        f"- noise and batches: {randomness}{large_delta}\n\n"
        "The guarantee covers the released weights only for this fine-tuning data: not the data a base model "
        "was pretrained on, not data used to choose hyperparameters, and not the training loss or metrics "
        f"logged during training. {_person_note(report)}\n"
    )


def _unit_note(report: dict[str, Any]) -> str:
    if report["unit"] == "user":
        return (
            f" Users are Poisson-sampled; at most {report['max_examples_per_unit']} examples of a sampled user "
            "enter a step, and their summed gradient is clipped as one."
        )
    if report["unit"] == "block":
        return (
            " The rows are blocks of concatenated text, so a record spanning several blocks is several units."
        )
    return ""


def _person_note(report: dict[str, Any]) -> str:
    """Who the guarantee protects: a person is covered at level ε only if all their data is one unit."""
    if report["unit"] == "user":
        return "It protects each user as a whole, whatever number of examples they contributed."
    unit = UNITS[report["unit"]][0].split(" (")[0]
    return (
        f"It assumes each person contributes one {unit}; a person with k of them is protected at group level k "
        "(roughly k·ε): train with privacy_unit_column for user-level privacy."
    )


def _replace_section(text: str, section: str) -> str:
    """``text`` with its "## Differential privacy" section replaced by (or, if absent, inserted as)
    ``section``, placed before the first second-level heading so readers meet it early."""
    pattern = re.compile(rf"^{re.escape(SECTION_TITLE)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    text = pattern.sub("", text)
    heading = re.search(r"^## ", text, re.MULTILINE)
    at = heading.start() if heading else len(text)
    before = text[:at].rstrip("\n")
    return f"{before}\n\n{section}\n{text[at:]}" if before else f"{section}\n{text[at:]}"


def _correct_optimizer_line(text: str, report: dict[str, Any]) -> str:
    """The Trainer lists ``args.optim`` as the optimizer; under hf_dp the step is the DP optimizer's."""
    noise = "per-example clipping and Gaussian noise" if is_private(report) else "no noise: NOT private"
    kwargs = report["optimizer_kwargs"] or "{}"
    line = f"- optimizer: {_optimizer_name(report)} from hf_dp ({noise}), kwargs {kwargs}"
    return re.sub(r"^- optimizer: .*$", lambda _: line, text, flags=re.MULTILINE)


def add_privacy_to_model_card(
    readme_path: str, report: dict[str, Any], dataset: str | list[str] | None = None
) -> ModelCard:
    """Write the guarantee of ``report`` (``DPTrainer.privacy_report()``) into the card at ``readme_path``.

    Adds ``differential_privacy:`` to the YAML front matter (and the ``differential-privacy`` tag for a
    private run), the "## Differential privacy" section to the text, and names the DP optimizer in the
    Trainer's hyperparameter list. Calling it again replaces what an earlier call wrote. Returns the card.
    """
    card = ModelCard.load(readme_path) if os.path.isfile(readme_path) else ModelCard("---\n{}\n---\n")
    card.data[METADATA_KEY] = privacy_metadata(report, dataset)
    tags = [t for t in (card.data.tags or []) if t != DP_TAG]
    card.data.tags = [*tags, DP_TAG] if is_private(report) else tags or None
    text = _correct_optimizer_line(card.text, report)
    card.text = _replace_section(text, privacy_section(report, dataset))
    card.save(readme_path)
    return card


def add_privacy_to_trainer_card(
    output_dir: str, report: dict[str, Any], card_kwargs: dict[str, Any]
) -> ModelCard:
    """``add_privacy_to_model_card`` on the card ``Trainer.create_model_card`` wrote in ``output_dir``, naming the
    dataset it was given (``dataset``, ``dataset_tags`` or ``dataset_args``)."""
    dataset = card_kwargs.get("dataset") or card_kwargs.get("dataset_tags") or card_kwargs.get("dataset_args")
    return add_privacy_to_model_card(os.path.join(output_dir, "README.md"), report, dataset)
