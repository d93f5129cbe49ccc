"""The privacy guarantee in the model card (hf_dp.hub), written by create_model_card and push_to_hub.

The upload goes to a minimal Hub-compatible HTTP endpoint on 127.0.0.1 (create repo, preupload, commit),
through the real ``Trainer.push_to_hub`` → ``HfApi.upload_folder`` → ``create_commit`` path. No network.
"""

from __future__ import annotations

import base64
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from huggingface_hub import HfApi, ModelCard

from hf_dp.hub import DP_TAG, METADATA_KEY, SECTION_TITLE, add_privacy_to_model_card
from tests.trainer_utils import make_trainer


def front_matter(text: str) -> dict[str, Any]:
    """The YAML between the card's leading ``---`` lines, parsed independently of huggingface_hub."""
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


def trained(tmp_path: Path, **overrides):
    trainer = make_trainer(tmp_path, **overrides)
    trainer.train()
    return trainer


def test_card_metadata_equals_the_trainers_guarantee(tmp_path):
    trainer = trained(tmp_path, target_epsilon=8.0, dp_optimizer_kwargs={"momentum": 0.9})
    trainer.create_model_card(dataset="sst2")
    text = (Path(trainer.args.output_dir) / "README.md").read_text()
    meta = front_matter(text)[METADATA_KEY]

    assert meta["guarantee"] == "(epsilon, delta)-DP" and meta["unit"] == "example"
    assert meta["epsilon"] == trainer.get_epsilon() and 0 < meta["epsilon"] <= 8.0
    assert meta["delta"] == trainer.target_delta
    assert meta["target_epsilon"] == 8.0
    assert meta["noise_multiplier"] == trainer.noise_multiplier > 0
    assert meta["max_grad_norm"] == trainer.args.per_sample_max_grad_norm
    assert meta["sample_rate"] == trainer.sample_rate
    assert meta["steps"] == trainer.accountant.steps == trainer.state.global_step == 2
    assert meta["expected_batch_size"] == trainer.expected_batch_size
    assert meta["num_train_examples"] == trainer.num_train_examples == 32
    assert meta["accountant"] == "prv" and meta["sampling"] == "poisson"
    assert meta["optimizer"] == "sgd" and meta["optimizer_kwargs"] == {"momentum": 0.9}
    assert (meta["clipping_mode"], meta["clipping_fn"]) == ("ghost", "abadi")
    assert meta["dataset"] == "sst2" and meta["disable_dp"] is False
    assert DP_TAG in ModelCard(text).data.tags
    assert f"(ε, δ) = ({meta['epsilon']:.4g}, {meta['delta']:.3g})-differentially private" in text
    assert "- optimizer: DP-SGD from hf_dp" in text and "ADAMW_TORCH" not in text


def test_card_is_rewritten_not_duplicated(tmp_path):
    trainer = trained(tmp_path, target_epsilon=8.0)
    trainer.create_model_card(dataset="sst2")
    trainer.create_model_card(dataset=["e2e_nlg"])
    text = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert text.count(SECTION_TITLE) == 1
    assert front_matter(text)[METADATA_KEY]["dataset"] == ["e2e_nlg"]
    assert front_matter(text)["tags"].count(DP_TAG) == 1


def test_non_private_card_says_there_is_no_guarantee(tmp_path):
    trainer = trained(tmp_path, disable_dp=True)
    trainer.create_model_card()
    text = (Path(trainer.args.output_dir) / "README.md").read_text()
    meta = front_matter(text)[METADATA_KEY]
    assert meta["guarantee"] == "none" and meta["disable_dp"] is True and meta["epsilon"] == math.inf
    assert "NO differential privacy guarantee" in text
    assert "differentially private at the example level" not in text
    assert DP_TAG not in (front_matter(text).get("tags") or [])


def test_shuffled_batches_are_stated_as_accounted_as_if_poisson(tmp_path):
    with pytest.warns(UserWarning, match="as if"):
        trainer = trained(tmp_path, target_epsilon=8.0, poisson_sampling=False)
    trainer.create_model_card()
    text = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert "accounted AS IF Poisson-sampled" in text


def test_a_missing_card_is_created_with_the_guarantee(tmp_path):
    report = {
        "epsilon": 2.5, "delta": 1e-5, "target_epsilon": None, "accountant": "rdp", "noise_multiplier": 1.1,
        "max_grad_norm": 1.0, "sample_rate": 0.01, "sampling": "poisson", "expected_batch_size": 100,
        "num_train_examples": 10000, "steps": 300, "optimizer": "adam", "optimizer_kwargs": {},
        "clipping_mode": "per_sample", "clipping_fn": "automatic", "disable_dp": False, "unit": "example",
        "noise_randomness": "os_entropy", "allow_large_delta": False, "noise_mechanism": "independent",
        "num_bands": 1, "strategy_coefs": [1.0], "accounting": "independent Gaussian noise, accounted as DP-SGD",
        "noise_phases": [[1.1, 300]],
    }  # fmt: skip
    readme = tmp_path / "README.md"
    add_privacy_to_model_card(str(readme), report, ["e2e_nlg", "dart"])
    text = readme.read_text()
    meta = front_matter(text)[METADATA_KEY]
    assert {k: meta[k] for k in report} == report and meta["dataset"] == ["e2e_nlg", "dart"]
    assert text.split("---\n", 2)[2].lstrip().startswith(SECTION_TITLE)
    assert "(ε, δ) = (2.5, 1e-05)" in text and "RDP accountant" in text and "DP-Adam" in text


class _FakeHub(BaseHTTPRequestHandler):
    """Answers the calls of an upload like the Hub: repos/create, validate-yaml (of the README's metadata),
    preupload (all files "regular", so the commit carries them base64-inline) and commit (NDJSON).
    Records every validated README and every commit's files and headers."""

    commits: list[dict[str, Any]] = []
    validated: list[str] = []
    unexpected: list[str] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().strip(), 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _reply(self, payload: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body, endpoint = self._body(), f"http://{self.headers['Host']}"
        if self.path == "/api/repos/create":
            request = json.loads(body)
            owner = request.get("organization") or "tester"
            self._reply({"url": f"{endpoint}/{owner}/{request['name']}"})
        elif self.path == "/api/validate-yaml":
            content = json.loads(body)["content"]
            _FakeHub.validated.append(content)
            try:
                front_matter(content)
            except (AssertionError, yaml.YAMLError) as error:
                self._reply({"errors": [{"message": str(error)}]}, 400)
            else:
                self._reply({"warnings": []})
        elif "/preupload/" in self.path:
            files = json.loads(body)["files"]
            self._reply(
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                    ]
                }
            )
        elif "/commit/" in self.path:
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            files = {
                line["value"]["path"]: base64.b64decode(line["value"]["content"])
                for line in lines
                if line["key"] == "file"
            }
            _FakeHub.commits.append(
                {"path": self.path, "files": files, "authorization": self.headers.get("Authorization")}
            )
            oid = f"{len(_FakeHub.commits):040x}"
            repo_id = self.path.removeprefix("/api/models/").split("/commit/")[0]
            self._reply({"commitUrl": f"{endpoint}/{repo_id}/commit/{oid}", "commitOid": oid})
        else:
            _FakeHub.unexpected.append(f"POST {self.path}")
            self._reply({"error": "not found"}, 404)

    def do_GET(self) -> None:
        _FakeHub.unexpected.append(f"GET {self.path}")
        self._reply({"error": "not found"}, 404)


@pytest.fixture
def fake_hub(monkeypatch) -> Iterator[type[_FakeHub]]:
    """A Hub endpoint on 127.0.0.1 that transformers' shared HfApi talks to, with offline mode lifted."""
    import huggingface_hub.constants
    import transformers.utils.hub

    _FakeHub.commits, _FakeHub.validated, _FakeHub.unexpected = [], [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(
        transformers.utils.hub, "_hf_api", HfApi(endpoint=endpoint, library_name="transformers")
    )
    try:
        yield _FakeHub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_push_to_hub_uploads_the_card_with_the_guarantee(tmp_path, fake_hub):
    trainer = trained(tmp_path, target_epsilon=8.0, hub_model_id="tester/dp-model", hub_token="hf_test_token")
    trainer.push_to_hub(dataset="sst2")

    assert fake_hub.unexpected == []
    [commit] = fake_hub.commits
    assert commit["path"] == "/api/models/tester/dp-model/commit/main"
    assert commit["authorization"] == "Bearer hf_test_token"
    assert {"README.md", "config.json", "model.safetensors"} <= set(commit["files"])
    sent = commit["files"]["README.md"].decode()
    meta = front_matter(sent)[METADATA_KEY]
    assert meta["epsilon"] == trainer.get_epsilon() and meta["delta"] == trainer.target_delta
    assert meta["noise_multiplier"] == trainer.noise_multiplier and meta["dataset"] == "sst2"
    assert meta["steps"] == 2 and meta["sample_rate"] == trainer.sample_rate
    assert SECTION_TITLE in sent and fake_hub.validated == [sent]
    assert sent == (Path(trainer.args.output_dir) / "README.md").read_text()
