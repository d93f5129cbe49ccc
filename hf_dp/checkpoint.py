"""The privacy state in checkpoints: saved with every checkpoint, checked before a run resumes from one.

Two kinds of files, both private (hf_dp never uploads them, docs/privacy.md):
- ``hf_dp_privacy_state.json`` (main process): the run's secret, the sampler's epoch, the accountant's
  ledger and the plan it was spent under (N, B̄, q, δ, σ, C, sampling, unit);
- ``hf_dp_noise_state_process{i}.safetensors`` (every process): its noise stream, and with correlated noise the
  b − 1 previous noise outputs of the parameters it owns (as secret as the key). The mechanism's
  ``state_dict`` is split: its tensors are the file's tensors, the rest (the stream's state, the step, the
  coefficients) is JSON in the file's metadata, tensors referred to by name (``state_files``). Nothing in a
  checkpoint is ever unpickled: a checkpoint from an untrusted source runs no code on resume.
The public copy of the ledger goes into ``trainer_state.json`` under ``LEDGER_KEY``; on resume the two must
agree with each other and with the Trainer's step count, and the run must draw from the same population with
the same sampling, or training refuses with one line. A changed δ is honoured: ε is re-reported at the new δ
over the whole history.

The folders themselves (atomic files, the completion marker, resume points, rotation) are checkpoint_files.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hf_dp.checkpoint_files import (
    FORMAT,
    PRIVACY_STATE_FILE,
    atomic_write,
    deepspeed_tag_on_each_node,
    mark_complete,
    newest_complete,
    noise_state_file,
    rotate,
    unmark,
)
from hf_dp.randomness import RunSecret
from hf_dp.state_files import read_state, write_state

logger = logging.getLogger(__name__)

LEDGER_KEY = "hf_dp_privacy_ledger"
OLD_PICKLE_FORMAT = 2


def _pickled_noise_state_file(process_index: int) -> str:
    """Where format 2 (earlier hf_dp versions) kept the noise state, as a pickle: never opened."""
    return f"hf_dp_noise_state_process{process_index}.pt"


_OLD_FORMAT_ADVICE = (
    "written by an earlier hf_dp version whose noise state was a pickle (torch.save), which this version never "
    "loads (unpickling a file can run code); resume it with the hf_dp version that wrote it, or start a new run "
    "(train without resume_from_checkpoint)"
)


def _disk_full(error: BaseException | None, folder: str) -> bool:
    """ENOSPC/EDQUOT anywhere in the chain, or a write that failed without an errno (torch.save's C++ writer
    says "file write failed") on a nearly full disk."""
    while error is not None:
        if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(error):
            return True
        if "write failed" in str(error):
            with contextlib.suppress(OSError):
                return shutil.disk_usage(os.path.dirname(os.path.abspath(folder))).free < 64 * 2**20
        error = error.__cause__ or error.__context__
    return False


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the disk is full); the previous complete checkpoints are intact."""


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
    """Each file written atomically: a kill leaves the old file or the new one, never a part."""
    os.makedirs(folder, exist_ok=True)
    if noise_state is not None:
        atomic_write(
            os.path.join(folder, noise_state_file(process_index)),
            lambda f: write_state(f, noise_state, str(FORMAT)),
        )
    if main:
        content = {
            "format": FORMAT,
            "secret": state.secret.to_dict(),
            "sampler_epoch": state.sampler_epoch,
            "ledger": state.ledger,
            "plan": state.plan,
        }
        atomic_write(
            os.path.join(folder, PRIVACY_STATE_FILE), lambda f: f.write(json.dumps(content).encode())
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
        if raw["format"] == OLD_PICKLE_FORMAT:
            raise _fail(path, f"format {OLD_PICKLE_FORMAT}: {_OLD_FORMAT_ADVICE}")
        if raw["format"] != FORMAT:
            raise _fail(
                path,
                f"format {raw['format']!r} is not {FORMAT}: written by another hf_dp version; resume it with that "
                "version, or start a new run (train without resume_from_checkpoint)",
            )
    except CheckpointMismatch:
        raise
    except (ValueError, KeyError, TypeError) as error:
        raise _fail(
            path,
            f"corrupt or truncated privacy state ({type(error).__name__}: {error}); resume from an intact checkpoint",
        ) from None
    if state.plan.get("save_only_model"):
        raise _fail(
            path,
            "saved with save_only_model=True, without the optimizer's state, so the run cannot go on as it was (the "
            "update rule's moments would restart); resume from a checkpoint saved with save_only_model=False",
        )
    bands = len(state.plan.get("strategy_coefs") or ())
    if state.plan.get("private") and bands != len(expected_plan["strategy_coefs"]):
        raise _fail(
            path,
            f"the checkpoint's noise has {bands} band(s) and this run's {len(expected_plan['strategy_coefs'])}: "
            f"the correlated noise only continues with the same bands; set num_bands={bands}",
        )
    for key in (
        "private",
        "num_examples",
        "expected_batch_size",
        "sampling",
        "unit",
        "privacy_unit_column",
        "accountant",
        "noise_mechanism",
        "strategy_coefs",
        "secure_mode",
        "dp_optimizer",
    ):
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
    bands = len(expected_plan["strategy_coefs"])
    if expected_plan["private"] and dp_steps != -(-global_step // bands):
        raise _fail(
            path,
            f"the privacy ledger has {dp_steps} steps but trainer_state.json's {global_step} steps account as "
            f"{-(-global_step // bands)}: the privacy state was edited or mixed in from another run",
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
    """This process's noise state, as the mechanism's ``state_dict`` gave it: tensors from safetensors, the
    rest from JSON; nothing is unpickled."""
    path = os.path.join(folder, noise_state_file(process_index))
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(folder, _pickled_noise_state_file(process_index))):
            raise _fail(
                path, f"missing, a {_pickled_noise_state_file(process_index)} instead: {_OLD_FORMAT_ADVICE}"
            )
        raise _fail(path, "missing: resume with the same number of processes the checkpoint was written with")
    try:
        return read_state(path, str(FORMAT))
    # safetensors raises its own error for a file that is not one (a pickle, a truncated file)
    except Exception as error:
        raise _fail(
            path,
            f"corrupt noise state, not a safetensors file of this hf_dp version ({type(error).__name__}); hf_dp never "
            "unpickles a checkpoint; resume from an intact checkpoint",
        ) from None


class RunPrivacyState:
    """What a checkpoint must carry for a run's guarantee to continue: the secret, the sampler's position,
    the ledger and each process's noise stream. The trainer hands it the sampler and the mechanism once
    they exist."""

    def __init__(self, secret: RunSecret, accountant, record: dict[str, Any]) -> None:
        self.secret, self.accountant, self.record = secret, accountant, record
        self.sampler = None
        self.mechanism = None

    def save(self, folder: str, process_index: int, main: bool) -> bool:
        """This process's private files; True when it wrote a noise state."""
        state = PrivacyCheckpoint(
            self.secret, self.sampler.epoch if self.sampler else 0, self.accountant.state_dict(), self.record
        )
        private = self.mechanism is not None and self.mechanism.private
        noise = self.mechanism.state_dict() if private else None
        save(folder, state, noise, process_index, main)
        return noise is not None

    @contextlib.contextmanager
    def saving(self, folder: str, args, trainer_state) -> Iterator[None]:
        """Around the Trainer's ``_save_checkpoint`` (every process): ``folder`` is torn from the start, the
        Trainer writes its files (its rotation held back), then the private files, a barrier, and the main
        process's marker; then ``save_total_limit`` rotates. A full disk is one line, the older checkpoints intact."""
        main = args.should_save
        if main:
            unmark(folder)
        limit, args.save_total_limit = args.save_total_limit, None
        try:
            yield
            deepspeed_tag_on_each_node(folder, args)
            noise = self.save(folder, args.process_index, main)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()  # every process's noise state is on the disk
            if main:
                mark_complete(folder, args.world_size if noise and not args.save_on_each_node else None)
        except Exception as error:
            if not _disk_full(error, folder):
                raise
            previous = newest_complete(os.path.dirname(folder)) or "none"
            raise CheckpointWriteError(
                f"hf_dp: the disk is full, {folder} could not be written ({' '.join(str(error).split())}); it is "
                f"incomplete and resume skips it. The newest complete checkpoint, intact: {previous}. Free space and "
                "resume with resume_from_checkpoint=True"
            ) from None
        finally:
            args.save_total_limit = limit
        if main:
            rotate(os.path.dirname(folder), limit, [folder, trainer_state.best_model_checkpoint])

    def restore(self, folder: str, global_step: int, process_index: int) -> None:
        """Continue the checkpoint's secret, sampling stream, ledger (at this run's δ) and noise streams."""
        saved = load(folder, self.record, global_step)
        self.secret = saved.secret
        if self.sampler is not None:
            self.sampler.load_state_dict({"seed": saved.secret.sampling_key, "epoch": saved.sampler_epoch})
            if (
                getattr(self.sampler, "cycle", None) is not None
            ):  # the groups of cyclic Poisson sampling, from the same secret
                self.sampler.cycle = dataclasses.replace(self.sampler.cycle, key=saved.secret.partition_key)
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
        if self.mechanism is not None and self.mechanism.private:  # the noise continues exactly
            self.mechanism.load_state_dict(load_noise_state(folder, process_index))
