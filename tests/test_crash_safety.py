"""Crash-safe checkpoints (docs/privacy.md, "Resuming"): atomic private files, the completion marker written
last, resume from the newest COMPLETE checkpoint, a torn one refused, a full disk, rotation; and the real thing:
a training process killed with SIGKILL at seeded random moments and restarted until it completes ends exactly
where the uninterrupted run ends (steps, ε, ledger, weights).

Run as a script this file is the kill tests' training process: ``--zygote`` imports torch and hf_dp once, then
forks one training process per line it reads (a restart does not pay the imports again); ``--worker JOB`` is
one process of a torchrun launch (the 2-process test).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import random
import selectors
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from hf_dp import checkpoint, checkpoint_files
from hf_dp.checkpoint import CheckpointWriteError
from hf_dp.checkpoint_files import (
    COMPLETE_FILE,
    PRIVACY_STATE_FILE,
    atomic_write,
    is_private_file,
    mark_complete,
    missing_part,
    newest_complete,
    noise_state_file,
    resume_point,
    rotate,
)
from tests import models
from tests.ports import free_port
from tests.trainer_utils import TokenRows, make_trainer, snapshot

# 32 examples, B̄ = 8: 4 steps per epoch, so 6 and 14 steps end inside an epoch (where the Trainer's resume
# from the last checkpoint used to take one step more than planned)
RUN = dict(
    noise_multiplier=1.0, dp_optimizer="adamw", learning_rate=1e-2, save_strategy="steps", save_steps=1
)


def _trainer(tmp_path, max_steps: int, **overrides):
    torch.manual_seed(5)
    settings = {**RUN, "insecure_dp_seed": 11, **overrides}
    return make_trainer(tmp_path, model=models.gpt2(), dataset=TokenRows(32), max_steps=max_steps, **settings)


def _ledger_of(folder: Path) -> dict:
    state = json.loads((folder / "trainer_state.json").read_text())
    return state["stateful_callbacks"][checkpoint.LEDGER_KEY]["attributes"]


@pytest.fixture(autouse=True)
def _quiet_seed_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*insecure_dp_seed.*")
        yield


# ---- (a) the parts ------------------------------------------------------------------------------------


def test_atomic_write_leaves_the_old_file_or_the_whole_new_one(tmp_path):
    path = tmp_path / PRIVACY_STATE_FILE
    atomic_write(str(path), lambda f: f.write(b"old"))

    def interrupted(f):
        f.write(b"half of the new")
        raise KeyboardInterrupt  # a kill between the write and the rename

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(path), interrupted)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == [PRIVACY_STATE_FILE]
    atomic_write(str(path), lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == [PRIVACY_STATE_FILE]
    # what a SIGKILL before the rename leaves behind is as private as the file it was to become
    assert is_private_file(f".{PRIVACY_STATE_FILE}.x1y2.tmp") and is_private_file(
        ".hf_dp_noise_state_process0.pt.a.tmp"
    )
    assert not is_private_file(COMPLETE_FILE) and not is_private_file("trainer_state.json")


def test_the_marker_is_written_last_and_lists_every_part(tmp_path):
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.train()
    folder = tmp_path / "out" / "checkpoint-2"
    listed = json.loads((folder / COMPLETE_FILE).read_text())["files"]
    for part in (
        "trainer_state.json",
        PRIVACY_STATE_FILE,
        noise_state_file(0),
        "optimizer.pt",
        "model.safetensors",
    ):
        assert part in listed
    assert sorted(listed) == sorted(p.name for p in folder.iterdir() if p.name != COMPLETE_FILE)
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert written[COMPLETE_FILE] == max(written.values())
    assert "key" not in (folder / COMPLETE_FILE).read_text()  # no secret in it
    assert missing_part(str(folder)) is None
    (folder / noise_state_file(0)).unlink()
    assert missing_part(str(folder)) == f"{noise_state_file(0)} is missing (the completion marker lists it)"
    (folder / COMPLETE_FILE).unlink()
    assert missing_part(str(folder)) == f"{COMPLETE_FILE}, the marker written last, is missing"
    (folder / "trainer_state.json").unlink()
    assert missing_part(str(folder)) == "trainer_state.json is missing"


def _torn_at_3(tmp_path) -> Path:
    """Three checkpoints; the save of the third killed after the Trainer's model and optimizer files (the
    user's case: no trainer_state.json, no privacy state, no marker)."""
    _trainer(tmp_path, max_steps=3).train()
    out = tmp_path / "out"
    for name in ("trainer_state.json", PRIVACY_STATE_FILE, noise_state_file(0), COMPLETE_FILE):
        (out / "checkpoint-3" / name).unlink()
    return out


@pytest.mark.parametrize("weights", ["model.safetensors", "adapter_model.safetensors", "global_step3/x.pt"])
def test_a_folder_without_model_weights_is_never_marked_complete(tmp_path, weights):
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    (folder / PRIVACY_STATE_FILE).write_text("{}")
    with pytest.raises(RuntimeError, match="holds no model weights"):
        mark_complete(str(folder), None)
    assert missing_part(str(folder)) is not None
    (folder / weights).parent.mkdir(exist_ok=True)
    (folder / weights).write_bytes(b"weights")
    mark_complete(str(folder), None)
    assert missing_part(str(folder)) is None


@pytest.mark.parametrize("how", ["train(resume_from_checkpoint=True)", "the argument, 'true'"])
def test_resume_true_continues_from_the_newest_complete_checkpoint(tmp_path, caplog, how):
    reference = _trainer(tmp_path / "reference", max_steps=4)
    reference.train()
    out = _torn_at_3(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hf_dp.checkpoint_files"):
        assert resume_point(True, str(out)) == str(out / "checkpoint-2")
    (line,) = [r.getMessage() for r in caplog.records]
    assert "checkpoint-3 (trainer_state.json is missing)" in line and "checkpoint-2" in line
    if how.startswith("train"):
        resumed = _trainer(tmp_path, max_steps=4)
        resumed.train(resume_from_checkpoint=True)
    else:  # what a script's --resume_from_checkpoint true gives, with train() called bare
        resumed = _trainer(tmp_path, max_steps=4, resume_from_checkpoint="true")
        resumed.train()
    assert resumed.state.global_step == 4 and resumed.accountant.steps == 4
    assert resumed.accountant.state_dict() == reference.accountant.state_dict()
    assert resumed.get_epsilon() == reference.get_epsilon()
    for name, p in snapshot(reference.model).items():
        torch.testing.assert_close(snapshot(resumed.model)[name], p, rtol=0, atol=1e-6, msg=name)
    assert missing_part(str(out / "checkpoint-3")) is None  # written again, whole


def test_an_explicit_torn_checkpoint_is_refused_before_training(tmp_path):
    out = _torn_at_3(tmp_path)
    trainer = _trainer(tmp_path, max_steps=4)
    with pytest.raises(ValueError, match="trainer_state.json is missing") as info:
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    message = str(info.value)
    assert "\n" not in message and f"resume from {out / 'checkpoint-2'} instead" in message
    assert trainer.state.global_step == 0 and trainer.accountant.steps == 0
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))  # the same trainer can still train
    assert trainer.state.global_step == 4


def test_only_torn_checkpoints_is_one_line(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "model.safetensors").write_bytes(b"half")
    with pytest.raises(ValueError, match="no complete checkpoint in .*only torn ones, checkpoint-1") as info:
        resume_point(True, str(out))
    assert "\n" not in str(info.value)


def test_resuming_from_the_last_checkpoint_takes_no_step_past_the_plan(tmp_path):
    """The "step 15 of 14" bug: resumed at max_steps inside an epoch, the Trainer's loop stepped once more."""
    full = _trainer(tmp_path, max_steps=6)
    full.train()
    final = snapshot(full.model)
    again = _trainer(tmp_path, max_steps=6)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 6 and again.accountant.steps == 6
    assert again.get_epsilon() == full.get_epsilon()
    assert all(torch.equal(final[n], p) for n, p in snapshot(again.model).items())
    assert not (tmp_path / "out" / "checkpoint-7").exists()


def _fill_disk_at(monkeypatch, name: str, step: int) -> None:
    real = checkpoint_files.atomic_write

    def write(path, content):
        if os.path.basename(path) == name and os.path.basename(os.path.dirname(path)) == f"checkpoint-{step}":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(path, content)

    monkeypatch.setattr(checkpoint, "atomic_write", write)  # the private files
    monkeypatch.setattr(checkpoint_files, "atomic_write", write)  # the completion marker


@pytest.mark.parametrize("name", [noise_state_file(0), PRIVACY_STATE_FILE, COMPLETE_FILE])
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(tmp_path, monkeypatch, name):
    _fill_disk_at(monkeypatch, name, step=3)
    trainer = _trainer(tmp_path, max_steps=4, save_total_limit=1)
    with pytest.raises(CheckpointWriteError, match="the disk is full") as info:
        trainer.train()
    message, out = str(info.value), tmp_path / "out"
    assert "\n" not in message and "No space left on device" in message
    assert f"intact: {out / 'checkpoint-2'}" in message
    assert missing_part(str(out / "checkpoint-2")) is None  # neither rotated away nor touched
    assert missing_part(str(out / "checkpoint-3")) is not None
    assert not [p for p in (out / "checkpoint-3").iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    resumed = _trainer(tmp_path, max_steps=4, save_total_limit=1)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4 and resumed.accountant.steps == 4
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4"]


def test_a_full_disk_in_the_trainers_own_files_is_the_same_line(tmp_path, monkeypatch):
    from transformers import Trainer

    real = Trainer._save_rng_state

    def full(self, output_dir):
        if output_dir.endswith("checkpoint-2"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", full)
    with pytest.raises(
        CheckpointWriteError, match=r"checkpoint-2 could not be written.*intact: .*checkpoint-1"
    ):
        _trainer(tmp_path, max_steps=3, save_total_limit=1).train()
    assert missing_part(str(tmp_path / "out" / "checkpoint-1")) is None


def test_a_write_failure_without_errno_on_a_full_disk_counts_as_disk_full(tmp_path, monkeypatch):
    """torch.save's C++ writer reports ENOSPC as "file write failed", without an errno."""
    error = RuntimeError(
        "[enforce fail at inline_container.cc:664] PytorchStreamWriter failed writing file data/0: file write failed"
    )
    folder = str(tmp_path / "checkpoint-3")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: _Usage(0))
    assert checkpoint._disk_full(error, folder)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: _Usage(10 * 2**30))
    assert not checkpoint._disk_full(error, folder)
    assert not checkpoint._disk_full(RuntimeError("CUDA out of memory"), folder)


class _Usage:
    def __init__(self, free: int) -> None:
        self.free = free


def _fake_checkpoint(out: Path, step: int, complete: bool, age: float) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "trainer_state.json", PRIVACY_STATE_FILE):
        (folder / name).write_text("x")
    if complete:
        (folder / COMPLETE_FILE).write_text(json.dumps({"format": 1, "files": ["model.safetensors"]}))
        os.utime(folder / COMPLETE_FILE, (age, age))
    return folder


def test_rotation_keeps_the_newest_complete_checkpoint_and_never_counts_torn_ones(tmp_path):
    out, now = tmp_path / "out", time.time()
    _fake_checkpoint(out, 1, complete=False, age=0)  # torn and older than a complete one: never resumable
    for step in (2, 3, 4):
        _fake_checkpoint(out, step, complete=True, age=now - 100 + step)
    _fake_checkpoint(
        out, 5, complete=False, age=0
    )  # torn, the newest folder (what the Trainer's mtime sort keeps)
    rotate(str(out), 1, [None])
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-5"]
    assert newest_complete(str(out)) == str(out / "checkpoint-4")


def test_rotation_waits_for_the_marker(tmp_path, monkeypatch):
    """save_total_limit=1: a save interrupted before its marker leaves the previous checkpoint in place (the
    Trainer rotates inside its own save, before the privacy state exists)."""
    calls = []

    def killed(folder, processes):
        calls.append(folder)
        if folder.endswith("checkpoint-3"):
            raise KeyboardInterrupt  # a kill just before the marker

    real = checkpoint.mark_complete
    monkeypatch.setattr(checkpoint, "mark_complete", lambda f, p: killed(f, p) or real(f, p))
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, max_steps=3, save_total_limit=1).train()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert (
        missing_part(str(out / "checkpoint-2")) is None
        and missing_part(str(out / "checkpoint-3")) is not None
    )
    assert resume_point(True, str(out)) == str(out / "checkpoint-2")


# ---- (b) the real thing: SIGKILL at random moments, restart until done ------------------------------------

KILL_STEPS = 14
KILL_SEED = 20261126
KILLS = 5
SLOW_DISK_S = 0.03  # the fsync before the marker takes this long in the child: a wider window to land in


class _Events(TrainerCallback):
    """What the kill test times its kills by, one line each on stdout."""

    def on_step_begin(self, args, state, control, **kwargs):
        _say(f"event step-begin {state.global_step + 1}")

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            _say(f"event save-begin {state.global_step}")

    def on_save(self, args, state, control, **kwargs):
        _say(f"event save-end {state.global_step}")


# the events pipe; the zygote sends the Trainer's prints (its log lines) to stderr
_OUT = sys.stdout
_TAG = "@crash-test "  # our lines on the pipe, among a launcher's and the Trainer's


def _say(line: str) -> None:
    _OUT.write(f"{_TAG}{line} {time.monotonic():.6f}\n")
    _OUT.flush()


def _train_once(job: dict) -> None:
    """One start of the run (a fresh process): resume when told, train to the end, report."""
    torch.set_num_threads(1)
    mark, private = checkpoint.mark_complete, checkpoint.RunPrivacyState.save

    def slow_disk(folder, processes):
        time.sleep(SLOW_DISK_S)
        mark(folder, processes)

    def announced(self, folder, *args, **kwargs):  # the Trainer's files are written: the private ones now
        _say(f"event private-begin {folder.rsplit('-', 1)[1]}")
        return private(self, folder, *args, **kwargs)

    checkpoint.mark_complete = slow_disk
    directory, rank = Path(job["dir"]), int(os.environ.get("RANK", "0"))
    _say(f"pid {rank} {os.getpid()}")
    if rank == 0:
        checkpoint.RunPrivacyState.save = announced
    # no ε computed on a log line every step
    trainer = _trainer(directory, max_steps=job["steps"], logging_steps=1000, **job.get("args", {}))
    if rank == 0:
        trainer.add_callback(_Events())
    trainer.train(resume_from_checkpoint=job["resume"])
    if rank != 0:
        return
    torch.save(snapshot(trainer.model), directory / "final.pt")
    result = {
        "global_step": trainer.state.global_step,
        "epsilon": trainer.get_epsilon(),
        "ledger": trainer.accountant.state_dict(),
        "world_size": trainer.args.world_size,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
    }
    _say("done " + json.dumps(result))


def _zygote() -> None:
    global _OUT
    _OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _train_once(job)
            except BaseException as error:  # noqa: BLE001  (reported to the test, which fails on it)
                _say("crash " + json.dumps(f"{type(error).__name__}: {error}"))
                code = 3
            finally:
                _OUT.flush()
                sys.stderr.flush()
                os._exit(code)
        _say(f"forked {pid}")
        _, status = os.waitpid(pid, 0)
        _say(f"exit {os.waitstatus_to_exitcode(status)}")


ENV = {
    "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
}


class _Lines:
    """A process whose stdout carries ``_say``'s stamped lines."""

    def __init__(self, command: list[str], log: Path, **kwargs) -> None:
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=log.open("a"), env={**os.environ, **ENV}, **kwargs
        )
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.process.stdout, selectors.EVENT_READ)
        self.buffer = b""

    def line(self, deadline: float) -> tuple[str, float]:
        """The next line and when it was written (the child's monotonic clock, the same as ours)."""
        while b"\n" not in self.buffer:
            if time.monotonic() > deadline or not self.selector.select(max(0.0, deadline - time.monotonic())):
                raise TimeoutError("the training process said nothing in time")
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise EOFError("the zygote died")
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\n", 1)
        line = raw.decode(errors="replace")
        if not line.startswith(_TAG):  # someone else's line (the Trainer's, a launcher's)
            return self.line(deadline)
        text, _, stamp = line.removeprefix(_TAG).rpartition(" ")
        return text, float(stamp)


class _Zygote(_Lines):
    def __init__(self, log: Path) -> None:
        super().__init__([sys.executable, __file__, "--zygote"], log, stdin=subprocess.PIPE)

    def run(self, directory: Path, resume: bool | None, kill_at=None, deadline: float = 120.0):
        """One start; ``kill_at``: (event line, delay) after which it is SIGKILLed. Returns (exit code, events,
        the event last written before the kill, the result line)."""
        job = {"dir": str(directory), "resume": resume, "steps": KILL_STEPS}
        self.process.stdin.write((json.dumps(job) + "\n").encode())
        self.process.stdin.flush()
        end = time.monotonic() + deadline
        events, result, killed_after, pid = [], None, None, None
        while True:
            text, stamp = self.line(end)
            if text.startswith("forked "):
                pid = int(text.split()[1])
                continue
            if text.startswith("pid "):
                continue
            if text.startswith("exit "):
                return int(text.split()[1]), events, killed_after, result
            if text.startswith(("done ", "crash ")):
                result = text
                continue
            events.append((text.removeprefix("event "), stamp))
            if kill_at is not None and text == f"event {kill_at[0]}":
                time.sleep(max(0.0, stamp + kill_at[1] - time.monotonic()))
                os.kill(pid, signal.SIGKILL)
                kill_time = time.monotonic()
                kill_at = None
                killed_after = kill_time
        # unreachable

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _where(events: list[tuple[str, float]], killed_at: float, steps: int = KILL_STEPS) -> str:
    """Where a kill landed: the last event the process wrote before it."""
    before = [name for name, stamp in events if stamp <= killed_at]
    last = before[-1] if before else "start"
    if last.startswith("save-begin"):
        return f"during the save of checkpoint-{last.split()[1]} (the Trainer's files)"
    if last.startswith("private-begin"):
        return f"during the save of checkpoint-{last.split()[1]} (the private files or the marker)"
    if last.startswith("step-begin"):
        return f"during step {last.split()[1]}"
    if last == f"save-end {steps}":
        return "after the last checkpoint"
    return f"after {last}"


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_ends_like_the_uninterrupted_run(tmp_path):
    rng = random.Random(KILL_SEED)
    zygote = _Zygote(tmp_path / "zygote.log")
    try:
        code, events, _, result = zygote.run(tmp_path / "reference", None)
        assert code == 0 and result.startswith("done "), (
            result,
            (tmp_path / "zygote.log").read_text()[-3000:],
        )
        reference = json.loads(result.removeprefix("done "))
        stamps = {name: stamp for name, stamp in events}
        save_time = {t: stamps[f"save-end {t}"] - stamps[f"save-begin {t}"] for t in range(1, KILL_STEPS + 1)}

        directory, landed, resumed_at, step = tmp_path / "killed", [], [], 0
        out = directory / "out"
        plan = [rng.choice(["step", "save", "private"]) for _ in range(KILLS - 1)] + ["final"]
        for kind in plan + [None]:
            target = min(step + rng.randint(1, 4), KILL_STEPS)
            if kind is None:
                kill_at = None
            elif kind == "final":  # the process ends after its last checkpoint: the 15-of-14 case
                kill_at = (f"save-end {KILL_STEPS}", 0.0)
            elif kind == "step":
                kill_at = (f"step-begin {target}", rng.uniform(0, 0.05))
            elif kind == "save":
                kill_at = (f"save-begin {target}", rng.uniform(0, save_time[target]))
            else:
                kill_at = (f"private-begin {target}", rng.uniform(0, SLOW_DISK_S + 0.01))
            resume = True if newest_complete(str(out)) else None
            code, events, killed_at, result = zygote.run(directory, resume, kill_at)
            resumed_at.append(step if resume else "start")
            if killed_at is None or code == 0:  # done (a kill after its last line comes too late)
                assert code == 0 and result and result.startswith("done "), (
                    kind,
                    result,
                    (tmp_path / "zygote.log").read_text()[-3000:],
                )
                break
            assert code == -signal.SIGKILL, (kind, code, result)
            where = _where(events, killed_at)
            saved = out / f"checkpoint-{kill_at[0].split()[1]}"
            state = "absent" if not saved.exists() else (missing_part(str(saved)) or "complete")
            newest = newest_complete(str(out))
            step = int(newest.rsplit("-", 1)[1]) if newest else 0
            landed.append(f"{kill_at[0]} +{kill_at[1] * 1000:.0f} ms -> {where}; {saved.name}: {state}")
        print("\nkills:\n  " + "\n  ".join(landed) + f"\nstarts resumed at: {resumed_at}")
        final = json.loads(result.removeprefix("done "))
        assert len(landed) >= KILLS - 1 and final["global_step"] == KILL_STEPS
        assert final["ledger"] == reference["ledger"]
        assert sum(n for _, _, n in final["ledger"]["history"]) == KILL_STEPS
        assert final["epsilon"] == reference["epsilon"]
        last = f"checkpoint-{KILL_STEPS}"
        assert _ledger_of(directory / "out" / last) == _ledger_of(tmp_path / "reference" / "out" / last)
        assert not (directory / "out" / f"checkpoint-{KILL_STEPS + 1}").exists()
        expected, got = torch.load(tmp_path / "reference" / "final.pt"), torch.load(directory / "final.pt")
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    finally:
        zygote.close()


# ---- the same on 2 nodes of one process each (DDP on CPU, gloo), each start two torchrun launches --------------
#
# Each node has its own launcher (torchrun --nnodes 2, static rendezvous on one host), as on two machines: when
# a process dies or hangs, nothing kills the other node's process, which must stop by itself, with one line
# (``ProcessLostError``), within ddp_timeout (ISSUE 31, item 2).

DDP_STEPS = 7  # B̄ = 2 processes × 4 × 2 accumulation = 16 of 32: 2 steps per epoch, 7 ends inside one
DDP_TIMEOUT_S = 15  # how long a process that stops answering is waited for
STOPPED_WITHIN_S = {"dies": 30.0, "hangs": DDP_TIMEOUT_S + 30.0}  # the survivor's own error, from the kill


def _worker(job: dict) -> None:
    """One process of a torchrun launch: a crash is a line for the test and a failed launch."""
    try:
        _train_once(job)
    except BaseException as error:
        _say("crash " + json.dumps(f"{type(error).__name__}: {error}"))
        raise


def _two_nodes(
    directory: Path, resume: bool | None, port: int, log: Path, kill=None, deadline: float = 300.0
):
    """One start of the run; ``kill``: (how, event, delay). "machine": every launcher and process is SIGKILLed
    at once; "dies": node 1's process is SIGKILLed; "hangs": it is SIGSTOPped (and SIGKILLed once node 0 has
    stopped). Returns (node 0's exit code, events, kill time, node 0's result line, seconds from the kill to
    node 0's last line)."""
    job = {
        "dir": str(directory),
        "resume": resume,
        "steps": DDP_STEPS,
        "args": {"ddp_timeout": DDP_TIMEOUT_S},
    }
    launcher = str(Path(sys.executable).parent / "torchrun")
    nodes = [
        _Lines(
            [
                launcher,
                *("--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1"),
                *("--master_addr", "127.0.0.1", "--master_port", str(port)),
                *(__file__, "--worker", json.dumps(job)),
            ],
            log,
        )
        for rank in (0, 1)
    ]
    end = time.monotonic() + deadline
    pids = {node.process.pid for node in nodes}
    node1 = int(nodes[1].line(end)[0].split()[2])  # its process's "pid 1 <pid>"
    pids.add(node1)
    events, result, killed_at, last_line = [], None, None, None
    try:
        while True:
            try:
                text, stamp = nodes[0].line(end)
            except EOFError:
                break
            last_line = time.monotonic()
            if text.startswith("pid "):
                pids.add(int(text.split()[2]))
            elif text.startswith(("done ", "crash ")):
                result = text
            else:
                events.append((text.removeprefix("event "), stamp))
                if kill is not None and text == f"event {kill[1]}":
                    time.sleep(max(0.0, stamp + kill[2] - time.monotonic()))
                    if kill[0] == "machine":
                        for pid in pids:
                            os.kill(pid, signal.SIGKILL)
                    else:
                        os.kill(node1, signal.SIGKILL if kill[0] == "dies" else signal.SIGSTOP)
                    killed_at, kill = time.monotonic(), None
    finally:
        if killed_at is not None or time.monotonic() > end:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    codes = [node.process.wait(timeout=60) for node in nodes]
    stopped = None if killed_at is None else last_line - killed_at
    return codes[0], events, killed_at, result, stopped


@pytest.mark.slow
def test_two_nodes_killed_or_hung_at_random_moments_resume_like_the_uninterrupted_run(tmp_path):
    rng, port, log = random.Random(KILL_SEED + 2), free_port(), tmp_path / "torchrun.log"
    code, events, _, result, _ = _two_nodes(tmp_path / "reference", None, port, log)
    assert code == 0 and result and result.startswith("done "), (result, log.read_text()[-3000:])
    reference = json.loads(result.removeprefix("done "))
    assert reference["world_size"] == 2 and reference["backend"] == "gloo"
    stamps = {name: stamp for name, stamp in events}
    save_time = {t: stamps[f"save-end {t}"] - stamps[f"save-begin {t}"] for t in range(1, DDP_STEPS + 1)}
    directory, out, landed, step = tmp_path / "killed", tmp_path / "killed" / "out", [], 0
    plan = ["dies", "hangs", "final"]  # random kills of every process: the one-process test above
    for kind in plan + [None]:
        target = min(step + rng.randint(1, 3), DDP_STEPS)
        kill = {
            None: None,
            "dies": ("dies", f"step-begin {target}", rng.uniform(0, 0.05)),
            "hangs": ("hangs", f"save-begin {target}", rng.uniform(0, save_time[target])),
            "final": ("machine", f"save-end {DDP_STEPS}", 0.0),
        }[kind]
        resume = True if newest_complete(str(out)) else None
        port = free_port()
        code, events, killed_at, result, stopped = _two_nodes(directory, resume, port, log, kill)
        if killed_at is None or code == 0:
            assert code == 0 and result and result.startswith("done "), (
                kind,
                result,
                log.read_text()[-3000:],
            )
            break
        newest = newest_complete(str(out))
        if kill[0] == "machine":
            assert result is None or not result.startswith("crash "), result
        else:  # node 0's process stopped by itself, in one line naming where to resume from, in bounded time
            assert result and result.startswith('crash "ProcessLostError: '), (
                kind,
                result,
                log.read_text()[-3000:],
            )
            assert "resume_from_checkpoint=True" in result and (newest is None or newest in result), result
            assert stopped < STOPPED_WITHIN_S[kill[0]], (kind, stopped)
        saved = out / f"checkpoint-{kill[1].split()[1]}"
        state = "absent" if not saved.exists() else (missing_part(str(saved)) or "complete")
        after = "" if kill[0] == "machine" else f"; node 0 stopped {stopped:.1f} s later"
        landed.append(
            f"{kill[0]}: {kill[1]} +{kill[2] * 1000:.0f} ms -> {_where(events, killed_at, DDP_STEPS)}; "
            f"{saved.name}: {state}{after}"
        )
        step = int(newest.rsplit("-", 1)[1]) if newest else 0
    print("\nkills (2 nodes):\n  " + "\n  ".join(landed))
    final = json.loads(result.removeprefix("done "))
    assert len(landed) >= len(plan) - 1 and final["world_size"] == 2 and final["backend"] == "gloo"
    assert final["global_step"] == DDP_STEPS and final["ledger"] == reference["ledger"]
    assert final["epsilon"] == reference["epsilon"]
    last = f"checkpoint-{DDP_STEPS}"
    assert _ledger_of(out / last) == _ledger_of(tmp_path / "reference" / "out" / last)
    listed = json.loads((out / last / COMPLETE_FILE).read_text())["files"]
    assert noise_state_file(0) in listed and noise_state_file(1) in listed
    expected, got = torch.load(tmp_path / "reference" / "final.pt"), torch.load(directory / "final.pt")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    gc.freeze()  # the imports live as long as the process: no collection walks them (conftest.py)
    _zygote()
elif __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    gc.freeze()
    _worker(json.loads(sys.argv[2]))
