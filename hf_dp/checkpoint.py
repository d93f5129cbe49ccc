"""The privacy state in checkpoints: saved with every checkpoint, checked before a run resumes from one.

Two kinds of files, both private (hf_dp never uploads them, docs/privacy.md):
- ``hf_dp_privacy_state.json`` (main process): the run's secret, the sampler's epoch, the accountant's
  ledger and the plan it was spent under (N, B̄, q, δ, σ, C, sampling, unit);
- ``hf_dp_noise_state_process{i}.pt`` (every process): its noise stream.
The public copy of the ledger goes into ``trainer_state.json`` under ``LEDGER_KEY``; on resume the two must
agree with each other and with the Trainer's step count, and the run must draw from the same population with
the same sampling, or training refuses with one line. A changed δ is honoured: ε is re-reported at the new δ
over the whole history.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from hf_dp.randomness import RunSecret

logger = logging.getLogger(__name__)

PRIVACY_STATE_FILE = "hf_dp_privacy_state.json"
LEDGER_KEY = "hf_dp_privacy_ledger"
FORMAT = 1


def noise_state_file(process_index: int) -> str:
    return f"hf_dp_noise_state_process{process_index}.pt"


def is_private_file(name: str) -> bool:
    """Files that must never leave the machine (the secret and the noise streams)."""
    return name == PRIVACY_STATE_FILE or (
        name.startswith("hf_dp_noise_state_process") and name.endswith(".pt")
    )


class CheckpointMismatch(ValueError):
    """The checkpoint's privacy state cannot be continued by this run."""


@dataclass(frozen=True)
class PrivacyCheckpoint:
    secret: RunSecret
    sampler_epoch: int
    ledger: dict[str, Any]  # PrivacyAccountant.state_dict()
    plan: dict[str, Any]  # what the ledger was spent under


def public_ledger(ledger: dict[str, Any]) -> dict[str, Any]:
    """What trainer_state.json carries: the accountant's history and δ (no secret)."""
    return {"args": {}, "attributes": {"dp_steps": sum(n for _, _, n in ledger["history"]), **ledger}}


def save(
    folder: str, state: PrivacyCheckpoint, noise_state: dict | None, process_index: int, main: bool
) -> None:
    os.makedirs(folder, exist_ok=True)
    if noise_state is not None:
        torch.save(noise_state, os.path.join(folder, noise_state_file(process_index)))
    if main:
        with open(os.path.join(folder, PRIVACY_STATE_FILE), "w") as f:
            json.dump(
                {
                    "format": FORMAT,
                    "secret": state.secret.to_dict(),
                    "sampler_epoch": state.sampler_epoch,
                    "ledger": state.ledger,
                    "plan": state.plan,
                },
                f,
            )


def _fail(path: str, problem: str) -> CheckpointMismatch:
    return CheckpointMismatch(f"{path}: {problem}")


def load(folder: str, expected_plan: dict[str, Any], global_step: int) -> PrivacyCheckpoint:
    """The checkpoint's privacy state, checked against this run's plan and the Trainer's own state."""
    path = os.path.join(folder, PRIVACY_STATE_FILE)
    if not os.path.isfile(path):
        raise _fail(
            path,
            "missing: this checkpoint has no privacy state to resume from (was it written by DPTrainer?)",
        )
    try:
        with open(path) as f:
            raw = json.load(f)
        state = PrivacyCheckpoint(
            secret=RunSecret.from_dict(raw["secret"]),
            sampler_epoch=int(raw["sampler_epoch"]),
            ledger=dict(raw["ledger"]),
            plan=dict(raw["plan"]),
        )
        history = [(float(s), float(q), int(n)) for s, q, n in state.ledger["history"]]
        if raw["format"] != FORMAT:
            raise _fail(path, f"format {raw['format']!r} is not {FORMAT}: written by another hf_dp version")
    except CheckpointMismatch:
        raise
    except (ValueError, KeyError, TypeError) as error:
        raise _fail(
            path,
            f"corrupt or truncated privacy state ({type(error).__name__}: {error}); resume from an intact checkpoint",
        ) from None
    for key in ("num_examples", "expected_batch_size", "sampling", "unit", "accountant"):
        if state.plan.get(key) != expected_plan[key]:
            raise _fail(
                path,
                f"{key} was {state.plan.get(key)!r} in the checkpoint but is {expected_plan[key]!r} now: the ledger and the "
                f"sampling stream only continue with the same {key}; resume with the checkpoint's settings",
            )
    dp_steps = sum(n for _, _, n in history)
    trainer_state = _trainer_ledger(folder)
    if trainer_state is not None and (
        trainer_state.get("history") != state.ledger["history"]
        or trainer_state.get("delta") != state.ledger["delta"]
    ):
        raise _fail(
            path,
            "the privacy ledger disagrees with trainer_state.json: the privacy state was edited or mixed in from another run",
        )
    if expected_plan["private"] and dp_steps != global_step:
        raise _fail(
            path,
            f"the privacy ledger has {dp_steps} steps but trainer_state.json has {global_step}: the privacy state was "
            "edited or mixed in from another run",
        )
    if not math.isfinite(state.ledger.get("delta", math.nan)):
        raise _fail(path, "corrupt privacy state: delta is not a number")
    return state


def _trainer_ledger(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, "trainer_state.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f).get("stateful_callbacks", {}).get(LEDGER_KEY)
    except (ValueError, OSError) as error:
        raise _fail(path, f"unreadable ({type(error).__name__}: {error})") from None
    if entry is None:
        raise _fail(
            path, "has no privacy ledger: this checkpoint was not written by DPTrainer, or it was edited"
        )
    return entry.get("attributes", {})


def load_noise_state(folder: str, process_index: int) -> dict:
    path = os.path.join(folder, noise_state_file(process_index))
    if not os.path.isfile(path):
        raise _fail(path, "missing: resume with the same number of processes the checkpoint was written with")
    try:
        return torch.load(path, weights_only=False)
    except Exception as error:  # torch raises many types for a truncated file
        raise _fail(
            path, f"corrupt noise state ({type(error).__name__}); resume from an intact checkpoint"
        ) from None


STAGING_FOLDER = "_hf_dp_hub_staging"  # "_*": the Trainer's upload of the output folder skips it


def stage_without_privacy_state(checkpoint_folder: str, output_dir: str, clear_old: bool) -> str:
    """A hard-linked copy of ``checkpoint_folder`` without the private files, for the Trainer to upload."""
    staging = os.path.join(output_dir, STAGING_FOLDER)
    if clear_old:
        shutil.rmtree(staging, ignore_errors=True)
    staged = os.path.join(staging, os.path.basename(checkpoint_folder))
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(
        checkpoint_folder,
        staged,
        ignore=lambda _, names: [n for n in names if is_private_file(n)],
        copy_function=_link_or_copy,
    )
    return staged


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


class RunPrivacyState:
    """What a checkpoint must carry for a run's guarantee to continue: the secret, the sampler's position,
    the ledger and each process's noise stream. The trainer hands it the sampler and the mechanism once
    they exist."""

    def __init__(self, secret: RunSecret, accountant, record: dict[str, Any]) -> None:
        self.secret, self.accountant, self.record = secret, accountant, record
        self.sampler = None
        self.mechanism = None

    def save(self, folder: str, process_index: int, main: bool) -> None:
        state = PrivacyCheckpoint(
            self.secret, self.sampler.epoch if self.sampler else 0, self.accountant.state_dict(), self.record
        )
        noise = self.mechanism.state_dict()["noise"] if self.mechanism is not None else None
        save(folder, state, noise, process_index, main)

    def restore(self, folder: str, global_step: int, process_index: int) -> None:
        """Continue the checkpoint's secret, sampling stream, ledger (at this run's δ) and noise streams."""
        saved = load(folder, self.record, global_step)
        self.secret = saved.secret
        if self.sampler is not None:
            self.sampler.load_state_dict({"seed": saved.secret.sampling_key, "epoch": saved.sampler_epoch})
        delta = self.accountant.delta
        self.accountant.load_state_dict(saved.ledger)
        if saved.ledger["delta"] != delta:
            logger.warning(
                f"hf_dp: the checkpoint accounted at delta={saved.ledger['delta']:.3g}; epsilon is re-reported over the "
                f"whole history at this run's delta={delta:.3g}"
            )
            self.accountant.delta = delta
        if saved.plan["noise_multiplier"] != self.record["noise_multiplier"]:
            logger.warning(
                f"hf_dp: the checkpoint trained with sigma={saved.plan['noise_multiplier']:.4g}, this run uses "
                f"sigma={self.record['noise_multiplier']:.4g}; the accountant composes both"
            )
        if self.mechanism is not None and self.mechanism.noise is not None:  # the stream continues exactly
            self.mechanism.load_state_dict({"noise": load_noise_state(folder, process_index)})
