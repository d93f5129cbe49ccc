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

Crash safety: the private files are written atomically (a temporary file in the same folder, fsync'd, then
``os.replace``), and a checkpoint is complete only once ``COMPLETE_FILE`` exists: the main process writes it
last, after the Trainer's files and every process's noise state (a barrier), with every file fsync'd first.
``resume_point`` resumes only from complete checkpoints; a torn one (killed mid-save) is skipped or refused,
and ``save_total_limit`` rotates complete checkpoints only once the new one is complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch

from hf_dp.randomness import RunSecret
from hf_dp.state_files import read_state, write_state

logger = logging.getLogger(__name__)

PRIVACY_STATE_FILE = "hf_dp_privacy_state.json"
COMPLETE_FILE = "hf_dp_checkpoint_complete.json"  # written last; no secret: the files the checkpoint holds
TRAINER_STATE_FILE = "trainer_state.json"
LEDGER_KEY = "hf_dp_privacy_ledger"
FORMAT = 3  # 3: the noise state is safetensors + JSON (2, before: a torch.save pickle, never loaded now)
OLD_PICKLE_FORMAT = 2
_TEMPORARY = re.compile(r"^\..+\.tmp$")  # atomic_write's temporary files: ".<name>.<random>.tmp"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR


def noise_state_file(process_index: int) -> str:
    return f"hf_dp_noise_state_process{process_index}.safetensors"


def _pickled_noise_state_file(process_index: int) -> str:
    """Where format 2 (earlier hf_dp versions) kept the noise state, as a pickle: never opened."""
    return f"hf_dp_noise_state_process{process_index}.pt"


_OLD_FORMAT_ADVICE = (
    "written by an earlier hf_dp version whose noise state was a pickle (torch.save), which this version never "
    "loads (unpickling a file can run code); resume it with the hf_dp version that wrote it, or start a new run "
    "(train without resume_from_checkpoint)"
)


def is_private_file(name: str) -> bool:
    """Files that must never leave the machine (the secret and the noise streams), and their temporary
    copies (a save killed before its ``os.replace`` leaves one)."""
    base = name.lstrip(".")
    return base.startswith(PRIVACY_STATE_FILE) or base.startswith("hf_dp_noise_state_process")


# ---- crash safety: atomic files, the completion marker -------------------------------------------------


def atomic_write(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """``write`` into a temporary file next to ``path``, flush and fsync it, then ``os.replace`` it onto
    ``path`` and fsync the folder: ``path`` is the old file or the whole new one, never a part."""
    folder, name = os.path.split(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync(folder or ".")


def _fsync(path: str) -> None:
    """Flush a file's or a folder's (its entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:  # some filesystems cannot fsync a folder
        if error.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _files(folder: str) -> list[str]:
    """The checkpoint's files, relative to it, without temporary ones."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            if name != COMPLETE_FILE and not _TEMPORARY.match(name):
                found.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(found)


# The model's weights as the Trainer writes them: whole or sharded, a peft adapter, FSDP's or DeepSpeed's folder.
_WEIGHTS = re.compile(
    r"^((model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?"
    r"|pytorch_model_fsdp_\d+|global_step\d+)$"
)


def mark_complete(folder: str, processes: int | None) -> None:
    """The main process, once every process has written its part: fsync every file, then write the marker.
    ``processes``: the number of noise states the folder must hold (None: not checked, e.g. when each node
    saves its own processes' files). A folder without the model's weights is never marked."""
    files = _files(folder)
    if not any(_WEIGHTS.match(part) for name in files for part in name.split(os.sep)[:1]):
        raise RuntimeError(
            f"hf_dp: {folder} holds no model weights after the Trainer's save, so it is left incomplete (resume "
            "skips it); a custom _save must write the model as save_pretrained does"
        )
    if processes is not None:
        absent = [noise_state_file(i) for i in range(processes) if noise_state_file(i) not in files]
        if absent:
            raise RuntimeError(
                f"hf_dp: {folder} lacks {', '.join(absent)} after every process saved: output_dir must be one folder "
                "shared by all processes (or set save_on_each_node)"
            )
    for name in files:
        _fsync(os.path.join(folder, name))
    for root, _, _ in os.walk(folder):
        _fsync(root)
    content = json.dumps({"format": FORMAT, "files": files}).encode()
    atomic_write(os.path.join(folder, COMPLETE_FILE), lambda f: f.write(content))


def unmark(folder: str) -> None:
    """Before a save into ``folder``: it is torn until its new marker (a re-save after resuming from an older
    checkpoint overwrites its files one by one). Leftover temporary files go too."""
    if not os.path.isdir(folder):
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, COMPLETE_FILE))
    for name in os.listdir(folder):
        if _TEMPORARY.match(name):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
    _fsync(folder)


def missing_part(folder: str) -> str | None:
    """None for a complete checkpoint, else which part is missing (one phrase)."""
    if not os.path.isdir(folder):
        return "the folder does not exist"
    marker = os.path.join(folder, COMPLETE_FILE)
    if not os.path.isfile(marker):
        for part in (TRAINER_STATE_FILE, PRIVACY_STATE_FILE):
            if not os.path.isfile(os.path.join(folder, part)):
                return f"{part} is missing"
        return f"{COMPLETE_FILE}, the marker written last, is missing"
    try:
        with open(marker) as f:
            files = json.load(f)["files"]
        listed = [str(name) for name in files]
    except (ValueError, KeyError, TypeError, OSError) as error:
        return f"{COMPLETE_FILE} is unreadable ({type(error).__name__})"
    for name in listed:
        if not os.path.isfile(os.path.join(folder, name)):
            return f"{name} is missing (the completion marker lists it)"
    return None


def checkpoint_folders(output_dir: str) -> list[str]:
    """``output_dir``'s checkpoint folders, oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    steps = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    return [
        os.path.join(output_dir, name)
        for _, name in sorted(steps)
        if os.path.isdir(os.path.join(output_dir, name))
    ]


def newest_complete(output_dir: str) -> str | None:
    """The complete checkpoint with the highest step in ``output_dir`` (None if there is none)."""
    return next((f for f in reversed(checkpoint_folders(output_dir)) if missing_part(f) is None), None)


def _every_process(value: Any) -> list[Any]:
    """``value`` from every process, in rank order (just ``[value]`` in a one-process run)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [value]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def _step(folder: str) -> int:
    return int(_CHECKPOINT.match(os.path.basename(folder)).group(1))


def deepspeed_tag_on_each_node(folder: str, args) -> None:
    """DeepSpeed finds the checkpoint to load through a ``latest`` file that only global rank 0 writes: with
    ``save_on_each_node`` every other machine's main process writes its own (the one ``global_step*`` folder)."""
    if not (args.save_on_each_node and args.should_save and args.process_index != 0):
        return
    tags = [
        n
        for n in os.listdir(folder)
        if n.startswith("global_step") and os.path.isdir(os.path.join(folder, n))
    ]
    latest = os.path.join(folder, "latest")
    if len(tags) == 1 and not os.path.exists(latest):
        with open(latest, "w") as f:
            f.write(tags[0])


def resume_argument(value: str | bool | None) -> str | bool | None:
    """``TrainingArguments.resume_from_checkpoint`` as ``train()`` takes it: "true" is True, "false" or "" None."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false", ""):
        return True if value.strip().lower() == "true" else None
    return value


def resume_point(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """What ``Trainer.train`` resumes from: ``True`` is the newest checkpoint COMPLETE in every process's
    ``output_dir`` (one folder shared by all, or one per node with ``save_on_each_node``); one log line names the
    torn ones skipped. An explicit checkpoint torn for any process is refused in one line, naming the part it
    misses and the complete checkpoint to use instead. Every process gets the same answer."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        problems = {_step(f): missing_part(f) for f in checkpoint_folders(output_dir)}
        complete = _every_process({step for step, problem in problems.items() if problem is None})
        common = set.intersection(*complete)
        if common:
            newest = max(common)
            skipped = [
                f"checkpoint-{step} ({problem or 'torn for another process'})"
                for step, problem in problems.items()
                if step > newest
            ]
            if skipped:
                logger.warning(
                    f"hf_dp: resuming from checkpoint-{newest}, the newest complete checkpoint; skipped the torn "
                    f"{', '.join(skipped)} (their save was interrupted)"
                )
            return os.path.join(output_dir, f"checkpoint-{newest}")
        torn = [f"checkpoint-{step} ({problem})" for step, problem in problems.items() if problem]
        found = f": only torn ones, {', '.join(torn)}" if torn else ""
        if any(complete):
            found = f": none is complete for every process (complete, by process: {[sorted(c) for c in complete]})"
        raise ValueError(
            f"hf_dp: no complete checkpoint in {output_dir} to resume from{found}; train without "
            "resume_from_checkpoint to start over"
        )
    folder = os.fspath(resume_from_checkpoint)
    problem = next((p for p in _every_process(missing_part(folder)) if p is not None), None)
    if problem is None:
        return folder
    instead = newest_complete(os.path.dirname(os.path.abspath(folder)))
    advice = f"resume from {instead} instead" if instead else "there is no complete checkpoint next to it"
    raise ValueError(
        f"hf_dp: {folder} is not a complete checkpoint ({problem}: its save was interrupted); {advice}"
    )


def rotate(output_dir: str, limit: int | None, keep: list[str | None]) -> None:
    """``save_total_limit`` over COMPLETE checkpoints, once the newest one is complete: the ``limit`` most
    recently completed (and ``keep``: the one just saved, the best) stay; torn folders older than the newest
    complete one can never be resumed from and go; newer torn ones are left alone."""
    if limit is None or limit <= 0:
        return
    folders = checkpoint_folders(output_dir)
    complete = [f for f in folders if missing_part(f) is None]
    if not complete:
        return
    newest = complete[-1]
    protected = {os.path.abspath(f) for f in [*keep, newest] if f is not None}
    by_completion = sorted(complete, key=lambda f: os.path.getmtime(os.path.join(f, COMPLETE_FILE)))
    protected |= {os.path.abspath(f) for f in by_completion[-limit:]}
    for folder in folders:
        if os.path.abspath(folder) in protected:
            continue
        if folder in complete or folders.index(folder) < folders.index(newest):
            logger.info(f"hf_dp: deleting {folder} (save_total_limit={limit})")
            shutil.rmtree(folder, ignore_errors=True)


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
    for key in (
        "num_examples",
        "expected_batch_size",
        "sampling",
        "unit",
        "accountant",
        "noise_mechanism",
        "strategy_coefs",
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


STAGING_FOLDER = "_hf_dp_hub_staging"  # "_*": the Trainer's upload of the output folder skips it


def stage_without_privacy_state(checkpoint_folder: str, output_dir: str, clear_old: bool) -> str:
    """A hard-linked copy of ``checkpoint_folder`` without the private files, for the Trainer to upload."""
    staging = os.path.join(output_dir, STAGING_FOLDER)
    if clear_old:
        shutil.rmtree(staging, ignore_errors=True)
    staged = os.path.join(staging, os.path.basename(checkpoint_folder))
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(  # without the marker too: without its private files the copy is no resumable checkpoint
        checkpoint_folder,
        staged,
        ignore=lambda _, names: [n for n in names if is_private_file(n) or n == COMPLETE_FILE],
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
