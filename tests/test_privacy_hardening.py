"""The run's secret, the privacy state on resume, and misuse refused before step 1 (docs/privacy.md)."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import datasets
import pytest
import torch
from torch.utils.data import IterableDataset

from hf_dp import compute_epsilon
from hf_dp.checkpoint import load_noise_state
from hf_dp.checkpoint_files import (
    COMPLETE_FILE,
    PRIVACY_STATE_FILE,
    atomic_write,
    is_private_file,
    noise_state_file,
)
from hf_dp.hub import privacy_section
from hf_dp.state_files import decode_state, encode_state, write_safetensors
from tests import models
from tests.test_hub import fake_hub  # noqa: F401  (the local Hub endpoint fixture)
from tests.trainer_utils import TokenRows, make_trainer, sampled_logical_batches, snapshot


def _final(tmp_path, **overrides) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = models.gpt2()
    make_trainer(tmp_path, model=model, **overrides).train()
    return snapshot(model)


def test_identical_public_arguments_draw_different_noise_and_batches(tmp_path):
    first, second = make_trainer(tmp_path, noise_multiplier=1.0), make_trainer(tmp_path, noise_multiplier=1.0)
    assert first.args.seed == second.args.seed
    assert sampled_logical_batches(first, 3) != sampled_logical_batches(second, 3)
    a, b = _final(tmp_path, noise_multiplier=1.0), _final(tmp_path, noise_multiplier=1.0)
    assert any(not torch.equal(a[n], b[n]) for n in a)


def test_an_explicit_insecure_seed_reproduces_and_warns(tmp_path):
    with pytest.warns(UserWarning, match="anyone who knows it can remove the noise"):
        a = _final(tmp_path, noise_multiplier=1.0, insecure_dp_seed=5)
    b = _final(tmp_path, noise_multiplier=1.0, insecure_dp_seed=5)
    assert all(torch.equal(a[n], b[n]) for n in a)
    trainer = make_trainer(tmp_path, noise_multiplier=1.0, insecure_dp_seed=5, max_steps=1)
    assert trainer.privacy_report()["noise_randomness"] == "insecure_dp_seed"
    trainer.train()
    trainer.create_model_card()
    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert "noise_randomness: insecure_dp_seed" in card and "anyone who knows that seed can" in card


def _saved_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _assert_no_secret(files: dict[str, bytes], key_hex: str) -> None:
    assert not [name for name in files if is_private_file(os.path.basename(name))], sorted(files)
    assert not [
        name
        for name, data in files.items()
        if key_hex.encode() in data or str(int(key_hex, 16)).encode() in data
    ]


@pytest.mark.parametrize("strategy", ["end", "every_save", "checkpoint", "all_checkpoints"])
def test_no_upload_and_no_saved_model_carries_the_secret(tmp_path, fake_hub, strategy):  # noqa: F811
    trainer = make_trainer(
        tmp_path,
        noise_multiplier=1.0,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        push_to_hub=True,
        hub_strategy=strategy,
        hub_model_id="tester/dp-model",
        hub_token="hf_test_token",
        hub_always_push=True,
    )
    trainer.train()
    trainer.push_to_hub()
    key = trainer.dp.secret.to_dict()["key"]
    checkpoint = Path(trainer.args.output_dir) / "checkpoint-2"
    assert (checkpoint / PRIVACY_STATE_FILE).is_file() and key in (
        checkpoint / PRIVACY_STATE_FILE
    ).read_text()
    uploaded = {f"{c['path']}:{name}": data for c in fake_hub.commits for name, data in c["files"].items()}
    assert uploaded and fake_hub.unexpected == []
    if strategy in ("checkpoint", "all_checkpoints"):
        assert any(
            "trainer_state.json" in name for name in uploaded
        )  # checkpoints were uploaded, minus the secret
    _assert_no_secret(uploaded, key)
    trainer.save_model(str(tmp_path / "saved"))
    _assert_no_secret(_saved_files(tmp_path / "saved"), key)


# ---- resume -----------------------------------------------------------------------------------------


def _checkpointed(tmp_path, **overrides):
    settings = {**dict(noise_multiplier=1.0, max_steps=2, save_strategy="steps", save_steps=2), **overrides}
    make_trainer(tmp_path, **settings).train()
    return tmp_path / "out" / "checkpoint-2"


def _resume(tmp_path, folder, **overrides):
    settings = {**dict(noise_multiplier=1.0, max_steps=4), **overrides}
    trainer = make_trainer(tmp_path, **settings)
    trainer.train(resume_from_checkpoint=str(folder))
    return trainer


def test_a_changed_delta_is_reported_over_the_whole_history(tmp_path, caplog):
    folder = _checkpointed(tmp_path, target_delta=1e-2)
    trainer = _resume(tmp_path, folder, target_delta=1e-3)
    assert trainer.accountant.steps == 4
    assert trainer.get_epsilon() == pytest.approx(
        compute_epsilon(1.0, trainer.sample_rate, 4, 1e-3, "prv"), rel=1e-6
    )
    assert trainer.get_epsilon() > compute_epsilon(1.0, trainer.sample_rate, 4, 1e-2, "prv")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"per_device_train_batch_size": 2}, "expected_batch_size was 8 in the checkpoint but is 4 now"),
        ({"dataset": TokenRows(40)}, "num_examples was 32"),
        ({"poisson_sampling": False}, "sampling was 'poisson'"),
        ({"accountant": "rdp"}, "accountant was 'prv'"),
    ],
)
def test_resuming_with_another_population_or_sampling_is_refused(tmp_path, overrides, message):
    folder = _checkpointed(tmp_path)
    with pytest.raises(ValueError, match=message) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _resume(tmp_path, folder, **overrides)
    assert "\n" not in str(info.value)


def _two_user_columns() -> datasets.Dataset:
    """32 rows; user_id pairs rows 2k and 2k + 1, author_id pairs rows k and k + 16: 16 units either way."""
    return datasets.Dataset.from_dict(
        {
            "input_ids": TokenRows(32).rows,
            "user_id": [i // 2 for i in range(32)],
            "author_id": [i % 16 for i in range(32)],
        }
    )


@pytest.mark.parametrize(
    ("before", "after", "message"),
    [
        # each resumed, and reported one guarantee over two halves trained under different settings
        (
            {"insecure_dp_seed": 3},
            {"secure_mode": True},
            "secure_mode was False in the checkpoint but is True now",
        ),
        ({}, {"secure_mode": True}, "secure_mode was False in the checkpoint but is True now"),
        (
            {"privacy_unit_column": "user_id", "per_device_train_batch_size": 2},
            {"privacy_unit_column": "author_id", "per_device_train_batch_size": 2},
            "privacy_unit_column was 'user_id' in the checkpoint but is 'author_id' now",
        ),
        (
            {},
            {"dp_optimizer": "adamw"},
            "dp_optimizer was 'sgd' in the checkpoint but is 'adamw' now",
        ),  # KeyError
        (
            {"disable_dp": True, "noise_multiplier": None},
            {},
            "private was False in the checkpoint but is True now",
        ),
        ({"save_only_model": True}, {}, "saved with save_only_model=True, without the optimizer's state"),
        (
            {"noise_mechanism": "bandmf", "num_bands": "2"},
            {"noise_mechanism": "bandmf", "num_bands": "1"},
            r"noise has 2 band\(s\) and this run's 1: .* set num_bands=2",
        ),
    ],
    ids=[
        "insecure_then_secure",
        "secure_later",
        "another_unit_column",
        "another_optimizer",
        "private_later",
        "model_only",
        "bands",
    ],
)
def test_resuming_under_other_privacy_settings_is_refused(tmp_path, before, after, message):
    data = {"dataset": _two_user_columns()} if "privacy_unit_column" in before else {}
    folder = _checkpointed(tmp_path, **data, **before)
    with pytest.raises(ValueError, match=message) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _resume(tmp_path, folder, **data, **after)
    assert "\n" not in str(info.value)


def test_a_resume_at_another_sigma_states_both_in_the_card(tmp_path):
    folder = _checkpointed(tmp_path)  # σ = 1 for 2 steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _resume(tmp_path, folder, noise_multiplier=3.0)
    report = trainer.privacy_report()
    assert report["noise_phases"] == [[1.0, 2], [3.0, 2]]
    assert "σ = 1 for 2 accounted steps, then 3 for 2 accounted steps" in privacy_section(
        report
    )  # was "σ = 3"


def test_a_resumed_insecure_run_is_reported_insecure(tmp_path):
    folder = _checkpointed(tmp_path, insecure_dp_seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _resume(tmp_path, folder)  # the checkpoint's secret, derived from the seed, goes on
    assert trainer.privacy_report()["noise_randomness"] == "insecure_dp_seed"


def _edit(path: Path, change) -> None:
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s["ledger"].update(history=[]), "disagrees with trainer_state.json"),
        (lambda s: s["ledger"]["history"][0].__setitem__(0, 50.0), "disagrees with trainer_state.json"),
        (lambda s: s.pop("secret"), "corrupt or truncated privacy state"),
    ],
)
def test_an_edited_privacy_state_is_refused(tmp_path, edit, message):
    folder = _checkpointed(tmp_path)
    _edit(folder / PRIVACY_STATE_FILE, edit)
    with pytest.raises(ValueError, match=message):
        _resume(tmp_path, folder)


def test_a_ledger_edited_in_both_files_still_disagrees_with_the_step_count(tmp_path):
    folder = _checkpointed(tmp_path)
    _edit(folder / PRIVACY_STATE_FILE, lambda s: s["ledger"].update(history=[]))
    _edit(
        folder / "trainer_state.json",
        lambda s: s["stateful_callbacks"]["hf_dp_privacy_ledger"]["attributes"].update(history=[]),
    )
    with pytest.raises(ValueError, match="has 0 steps but trainer_state.json.s 2 steps account as 2"):
        _resume(tmp_path, folder)


@pytest.mark.parametrize("content", ["", "{", '{"format": 1}', "[]"])
def test_a_corrupt_or_truncated_state_file_is_one_clear_line(tmp_path, content):
    folder = _checkpointed(tmp_path)
    (folder / PRIVACY_STATE_FILE).write_text(content)
    with pytest.raises(ValueError, match="corrupt or truncated privacy state") as info:
        _resume(tmp_path, folder)
    assert "\n" not in str(info.value)


# ---- checkpoints hold no pickle: resuming from an untrusted one runs no code -------------------------------


class _RunsCode:
    """A pickle that creates ``marker`` when it is loaded (what an attacker's checkpoint file would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _write_pickle(path: Path, marker: Path, how: str) -> None:
    if how == "torch.save":
        torch.save({"noise": _RunsCode(marker), "step": 2}, path)
    else:
        path.write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(Exception):  # noqa: B017, PT011 (only that it runs code: it does, as the real file would)
        torch.load(path, weights_only=True)
    pickle.loads(pickle.dumps(_RunsCode(marker.with_name("proof")))).close()  # the payload does run code
    assert marker.with_name("proof").exists() and not marker.exists()


def test_the_noise_state_is_safetensors_with_its_structure_in_json(tmp_path):
    import safetensors

    folder = _checkpointed(tmp_path)
    path = folder / noise_state_file(0)
    assert path.name == "hf_dp_noise_state_process0.safetensors" and is_private_file(path.name)
    assert not list(folder.glob("hf_dp_*.pt"))
    with safetensors.safe_open(str(path), framework="pt") as f:  # the reference reader
        metadata, names = f.metadata(), list(f.keys())
    state = json.loads(metadata["state"])
    assert metadata["format"] == "3" and names == []  # independent noise: a stream and a step, no tensor
    assert state["step"] == 2 and state["noise"]["stream"]["bit_generator"] == "PCG64DXSM"
    assert load_noise_state(str(folder), 0) == state


def test_a_state_dict_round_trips_through_safetensors_and_json_or_is_refused(tmp_path):
    import numpy as np
    import safetensors.torch

    shared = torch.arange(12.0).view(3, 4)
    state = {
        "past": [[shared, shared[1]], [torch.ones(2, dtype=torch.bfloat16), torch.zeros(0)]],
        "stream": {"state": 2**127 + 5, "generator": torch.Generator().get_state()},
        "pair": (1, np.int64(2), np.arange(3)),
        "a.b": torch.ones(1),
        "a": {"b": torch.zeros(1)},
        "__metadata__": torch.full((1,), 2.0),  # the name safetensors' header keeps for its metadata
    }
    structure, tensors = encode_state(state)
    json.dumps(structure)
    path = tmp_path / noise_state_file(0)
    atomic_write(str(path), lambda f: write_safetensors(f, tensors, {"state": json.dumps(structure)}))
    assert safetensors.torch.load_file(str(path)).keys() == tensors.keys()  # the reference reader
    back = decode_state(json.loads(json.dumps(structure)), safetensors.torch.load_file(str(path)))
    assert torch.equal(back["past"][0][1], shared[1]) and back["past"][1][0].dtype == torch.bfloat16
    assert torch.equal(back["stream"]["generator"], state["stream"]["generator"])
    assert back["stream"]["state"] == 2**127 + 5 and back["pair"][:2] == (1, 2)
    assert (back["pair"][2] == np.arange(3)).all() and back["a.b"].item() == 1 and back["a"]["b"].item() == 0
    assert back["__metadata__"].item() == 2
    with pytest.raises(TypeError, match=r"holds a _RunsCode at 'x.0'.*never a pickle"):
        encode_state({"x": [_RunsCode(Path("never"))]})
    with pytest.raises(TypeError, match="a key must be a string"):
        encode_state({"x": {1: 2}})


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_noise_state_replaced_by_a_pickle_is_refused_and_runs_nothing(tmp_path, how):
    folder = _checkpointed(tmp_path)
    marker = tmp_path / "code_ran"
    _write_pickle(folder / noise_state_file(0), marker, how)
    _write_pickle(folder / "hf_dp_noise_state_process0.pt", marker, how)  # the old name: never opened either
    with pytest.raises(ValueError, match="corrupt noise state, not a safetensors file") as info:
        _resume(tmp_path, folder)
    assert "\n" not in str(info.value) and "never unpickles" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("privacy_state", ["as written", "format edited to 3"])
def test_a_checkpoint_of_the_pickle_format_is_refused_with_what_to_do_and_never_unpickled(
    tmp_path, privacy_state
):
    """Format 2 (hf_dp before this one): the noise state was a torch.save pickle, hf_dp_noise_state_process0.pt."""
    folder = _checkpointed(tmp_path)
    marker = tmp_path / "code_ran"
    (folder / noise_state_file(0)).unlink()
    _write_pickle(folder / "hf_dp_noise_state_process0.pt", marker, "torch.save")
    listed = json.loads((folder / COMPLETE_FILE).read_text())["files"]
    listed = [n.replace(".safetensors", ".pt") if "noise_state" in n else n for n in listed]
    (folder / COMPLETE_FILE).write_text(json.dumps({"format": 2, "files": listed}))
    if privacy_state == "as written":
        _edit(folder / PRIVACY_STATE_FILE, lambda s: s.update(format=2))
    with pytest.raises(
        ValueError, match="written by an earlier hf_dp version whose noise state was a pickle"
    ) as info:
        _resume(tmp_path, folder)
    message = str(info.value)
    assert (
        "\n" not in message
        and "resume it with the hf_dp version that wrote it, or start a new run" in message
    )
    assert not marker.exists()


# ---- misuse, refused before step 1 (the arguments alone: tests/test_arguments.py) -----------------------


def test_a_delta_not_below_one_over_n_is_refused_unless_allowed(tmp_path):
    with pytest.raises(ValueError, match="is not below 1/N") as info:
        make_trainer(tmp_path, noise_multiplier=1.0, target_delta=0.05)
    assert "\n" not in str(info.value)
    trainer = make_trainer(
        tmp_path, noise_multiplier=1.0, target_delta=0.05, allow_large_delta=True, max_steps=1
    )
    trainer.train()
    trainer.create_model_card()
    text = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert "is not below 1/N" in text and "allow_large_delta: true" in text


def test_a_noise_multiplier_that_drowns_every_update_is_refused(tmp_path):
    with pytest.raises(ValueError, match="the noise would drown every update"):
        make_trainer(tmp_path, noise_multiplier=1e7)


def test_train_twice_is_refused(tmp_path):
    trainer = make_trainer(tmp_path, noise_multiplier=1.0, max_steps=1)
    trainer.train()
    with pytest.raises(RuntimeError, match="already called on this DPTrainer"):
        trainer.train()


class _StreamWithLength(IterableDataset):
    def __iter__(self):
        return iter(TokenRows(16))

    def __len__(self) -> int:
        return 16


def test_an_iterable_dataset_with_a_length_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs a map-style train_dataset"):
        make_trainer(tmp_path, dataset=_StreamWithLength(), noise_multiplier=1.0)
