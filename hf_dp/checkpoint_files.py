"""Checkpoint folders on disk: the files a checkpoint holds, written atomically, complete or torn, which one a run
resumes from, their rotation, and a copy without the private files for the Hub.

Crash safety: the private files are written atomically (a temporary file in the same folder, fsync'd, then
``os.replace``), and a checkpoint is complete only once ``COMPLETE_FILE`` exists: the main process writes it
last, after the Trainer's files and every process's noise state (a barrier), with every file fsync'd first.
``resume_point`` resumes only from complete checkpoints; a torn one (killed mid-save) is skipped or refused,
and ``save_total_limit`` rotates complete checkpoints only once the new one is complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import IO, Any

import torch

logger = logging.getLogger(__name__)

PRIVACY_STATE_FILE = "hf_dp_privacy_state.json"
COMPLETE_FILE = "hf_dp_checkpoint_complete.json"  # written last; no secret: the files the checkpoint holds
TRAINER_STATE_FILE = "trainer_state.json"
FORMAT = 3  # 3: the noise state is safetensors + JSON (2, before: a torch.save pickle, never loaded now)
_TEMPORARY = re.compile(r"^\..+\.tmp$")  # atomic_write's temporary files: ".<name>.<random>.tmp"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR


def noise_state_file(process_index: int) -> str:
    return f"hf_dp_noise_state_process{process_index}.safetensors"


def is_private_file(name: str) -> bool:
    """Files that must never leave the machine (the secret and the noise streams), and their temporary
    copies (a save killed before its ``os.replace`` leaves one)."""
    base = name.lstrip(".")
    return base.startswith(PRIVACY_STATE_FILE) or base.startswith("hf_dp_noise_state_process")


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
