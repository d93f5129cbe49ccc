"""Privacy units larger than a row (pairs, users) and smaller than a row (records packed into one row).

Each unit's gradient is clipped as a whole: Σ_u clip(∇L_u). The reference runs one backward PER UNIT, each unit
on its own: a unit of rows as its rows alone, a packed record as its own unpacked sequence (so the reference
also checks that packing changes nothing: no attention across records, no label read across a boundary).
Float64, clipping active for every unit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine, UnsupportedModuleError
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.plan import StepPlan
from hf_dp.clipping.units import PrivacyUnits
from hf_dp.losses import per_example_loss, unwrap_model
from tests import models, oracle
from tests.test_checkpointing import float64_rms_norm, llama_lora  # noqa: F401 (an autouse fixture)
from tests.test_engine import assert_close
from tests.trainer_utils import (
    TokenRows,
    assert_step_clips_each_example_alone,
    make_trainer,
    snapshot,
)

UNIT_OF_ROW = torch.tensor([0, 1, 0, 2, 1, 0])  # units of 3, 2 and 1 rows, interleaved

MODELS = {
    "gpt2_tied": (models.gpt2, lambda: models.token_batch(6)),
    "llama": (models.llama, lambda: models.token_batch(6)),
    "llama_lora": (llama_lora, lambda: models.token_batch(6)),
    "bert_classifier": (models.bert_classifier, lambda: models.classification_batch(3, batch=6)),
}


def strategy_step(
    strategy_name: str, model: nn.Module, loss_of, units: PrivacyUnits, max_norm: float
) -> dict:
    """One micro-batch through a clipping strategy; the clipped sum per parameter name."""
    engine = ClippingEngine(model, mode="per_sample" if strategy_name == "per_sample" else "ghost")
    model.zero_grad(set_to_none=True)
    mask = torch.ones(units.count)
    if strategy_name == "two_pass":
        step = clipped_step(engine, model, Backend(zero_stage=0)).run(
            loss_of, mask, StepPlan(max_norm), model, units
        )
        step.backward.backward()
    else:
        checkpointing = strategy_name.startswith("checkpointing")
        strategy = clipped_step(engine, model, Backend(checkpointing=checkpointing))
        with pytest.MonkeyPatch.context() as patch:
            if strategy_name == "in_backward":  # every layer's per-example gradients formed in the backward
                patch.setattr("hf_dp.clipping.bookkeeping.MATERIALISE_BELOW_OUTPUT_SHARE", float("inf"))
            if strategy_name == "checkpointing_deep":  # the tail reaches down over every layer (tail.py)
                patch.setattr("hf_dp.clipping.pipeline.DEEP_TAIL_SHARE", 1e9)
            strategy.run(loss_of, mask, StepPlan(max_norm), model, units)
            if checkpointing:  # again: the checked first step allows skipping the tail
                strategy.check_untouched()
                model.zero_grad(set_to_none=True)
                strategy.run(loss_of, mask, StepPlan(max_norm), model, units)
    engine.remove_hooks()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}


def units_of_rows_step(strategy_name: str, model: nn.Module, batch: dict) -> tuple[dict, dict, float]:
    """UNIT_OF_ROW's units of the batch's six rows through a strategy, and brute force per unit (each unit's rows
    alone), both at the clip norm returned, half the smallest unit norm: every unit clipped."""
    members = [[r for r in range(6) if UNIT_OF_ROW[r] == u] for u in range(3)]
    _, norms = oracle.per_unit(model, [oracle.rows(batch, m) for m in members], 1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = oracle.per_unit(model, [oracle.rows(batch, m) for m in members], max_norm)
    units = PrivacyUnits.of_rows(UNIT_OF_ROW)
    ours = strategy_step(
        strategy_name, model, lambda m: units.mean_over_rows(per_example_loss(m, batch)), units, max_norm
    )
    return ours, reference, max_norm


@pytest.mark.parametrize(
    "strategy_name", ["ghost", "per_sample", "in_backward", "checkpointing", "checkpointing_deep", "two_pass"]
)
@pytest.mark.parametrize("name", list(MODELS))
def test_units_of_rows_are_clipped_as_one(name: str, strategy_name: str) -> None:
    """A unit of several rows (a user's examples, a DPO pair's two rows): one clip of their summed gradient."""
    build, make_batch = MODELS[name]
    model = build().double().train()
    if strategy_name.startswith("checkpointing"):
        unwrap_model(model).activation_checkpointing_enable({"use_reentrant": False})
    batch = make_batch()
    ours, reference, max_norm = units_of_rows_step(strategy_name, model, batch)
    assert_close(ours, reference, rtol=1e-9, floor=1e-6)
    # not the per-row clipping it replaces
    per_row, _ = oracle.per_example(model, batch, max_norm)
    assert max((ours[n] - per_row[n]).norm() / per_row[n].norm().clamp(min=1e-12) for n in ours) > 1e-3


RECORDS = [[5, 3, 2], [4, 6]]  # record lengths in each of two packed rows of 10 tokens


def packed_batch(seed: int = 0) -> tuple[dict, list[torch.Tensor]]:
    """Two rows of records packed without padding (position ids restart at 0), and the records alone."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, models.VOCAB, (2, 10), generator=g)
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in RECORDS])
    records, start = [], 0
    for r, row in enumerate(RECORDS):
        start = 0
        for n in row:
            records.append(ids[r, start : start + n])
            start += n
    return {"input_ids": ids, "position_ids": position_ids, "labels": ids.clone()}, records


PACKED_MODELS = {"gpt2_tied": models.gpt2, "llama": models.llama}


@pytest.mark.parametrize(
    "strategy_name", ["ghost", "in_backward", "checkpointing", "checkpointing_deep", "two_pass"]
)
@pytest.mark.parametrize("name", list(PACKED_MODELS))
def test_packed_records_are_clipped_each_on_its_own(name: str, strategy_name: str) -> None:
    """Records packed into rows (position ids restarting, no attention mask, no cache): each record's gradient
    equals that of the record run alone, and is clipped on its own."""
    model = PACKED_MODELS[name]().double().train()
    unwrap_model(model).config.use_cache = False
    batch, records = packed_batch()
    alone = [[{"input_ids": r[None], "labels": r[None]}] for r in records]
    _, norms = oracle.per_unit(model, alone, 1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = oracle.per_unit(model, alone, max_norm)
    if strategy_name.startswith("checkpointing"):
        unwrap_model(model).activation_checkpointing_enable({"use_reentrant": True})
    units = PrivacyUnits.of_records(batch["position_ids"])
    assert units.count == len(records) == 5
    ours = strategy_step(
        strategy_name, model, lambda m: per_example_loss(m, batch, units=units), units, max_norm
    )
    assert_close(ours, reference, rtol=1e-9, floor=1e-6)


def flatten_collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """transformers' padding-free collation: every example of the micro-batch in one row, positions restarting."""
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_tensors="pt")(examples)


def test_trainer_packs_sampled_records_and_clips_each(tmp_path) -> None:
    """DPTrainer with a padding-free collator: Poisson-sampled records packed into one row per micro-batch, each
    clipped on its own; the noise-free SGD step is lr · Σ_u clip(∇L_u) / B̄ over the records run alone."""
    assert len(assert_step_clips_each_example_alone(tmp_path, flatten_collate)) > 1


def test_trainer_refuses_records_that_attend_to_each_other(tmp_path) -> None:
    """With an all-ones attention mask the model cannot tell packed records apart, so attention crosses them:
    refused on the first step, before any update."""
    model = models.gpt2().double()
    model.config.use_cache = False

    def crossing_collate(examples):
        batch = flatten_collate(examples)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch

    trainer = make_trainer(tmp_path, model=model, noise_multiplier=0.0, max_steps=1, insecure_dp_seed=11)
    trainer.data_collator = crossing_collate
    before = snapshot(model)
    with pytest.raises(ValueError, match="attention crosses records"):
        trainer.train()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_units_group_rows_and_tokens() -> None:
    rows = PrivacyUnits.of_rows(torch.tensor([1, 0, 1]))
    assert rows.count == 2 and rows.slots.tolist() == [[1, -1], [0, 2]]
    x = torch.arange(6.0).view(3, 2)
    assert rows.regroup(x).tolist() == [[[2, 3], [0, 0]], [[0, 1], [4, 5]]]
    assert rows.mean_over_rows(torch.tensor([1.0, 2.0, 3.0])).tolist() == [2.0, 2.0]
    packed = PrivacyUnits.of_records(torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 0]]))
    assert packed.count == 4 and packed.unit_of_token.tolist() == [[0, 0, 1, 1, 1], [2, 2, 2, 2, 3]]
    with pytest.raises(ValueError, match="0..U-1"):
        PrivacyUnits.of_rows(torch.tensor([0, 2]))


class UserRows(TokenRows):
    """Token rows of 8 users with 1 to 6 rows each."""

    def __init__(self) -> None:
        super().__init__(28)
        self.users = [f"user{u}" for u, n in enumerate([1, 6, 2, 5, 3, 4, 1, 6]) for _ in range(n)]

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "user_id": self.users[i]}


def test_trainer_samples_users_and_clips_each_user_once(tmp_path) -> None:
    """privacy_unit_column: users are Poisson-sampled, at most k rows of each enter the step, and a user's rows
    are clipped as one; the noise-free SGD step is lr · Σ_users clip(∇ mean loss of its rows) / B̄ users."""
    from hf_dp.data import units_of_column
    from hf_dp.sampling import SamplerConfig, UnitPoissonBatchSampler

    torch.manual_seed(0)
    model = models.gpt2().double()
    dataset = UserRows()
    trainer = make_trainer(
        tmp_path,
        dataset=dataset,
        model=model,
        noise_multiplier=0.0,
        max_steps=1,
        insecure_dp_seed=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        privacy_unit_column="user_id",
        max_examples_per_unit=3,
        per_sample_max_grad_norm=0.05,
    )
    assert (trainer.num_train_examples, trainer.expected_batch_size) == (8, 2)
    unit_of_row, _ = units_of_column(dataset.users)
    sampler = UnitPoissonBatchSampler(
        unit_of_row,
        sample_rate=trainer.sample_rate,
        max_rows_per_unit=3,
        config=SamplerConfig(steps_per_epoch=trainer.steps_per_epoch, seed=trainer.dp.secret.sampling_key),
    )
    drawn = next(iter(sampler))
    users = sorted({unit_of_row[i] for i in drawn})
    groups = [[i for i in drawn if unit_of_row[i] == u] for u in users]
    assert len(groups) >= 1 and max(len(g) for g in groups) <= 3

    def row(i: int) -> dict:
        ids = torch.tensor(dataset[i]["input_ids"])[None]
        return {"input_ids": ids, "labels": ids}

    reference, norms = oracle.per_unit(model, [[row(i) for i in g] for g in groups], 0.05)
    assert (norms > 0.05).all()
    before = snapshot(model)
    trainer.train()
    for name, p in model.named_parameters():
        step = (before[name] - p.detach()).double()
        torch.testing.assert_close(step, 0.5 * reference[name] / 2, rtol=1e-8, atol=1e-12)
    report = trainer.privacy_report()
    assert (report["unit"], report["max_examples_per_unit"], report["num_train_examples"]) == ("user", 3, 8)


def test_guarantee_names_its_unit(tmp_path, caplog) -> None:
    """The log line, privacy_report() and the model card state the unit and N counted in it."""
    from hf_dp.hub import privacy_section

    with caplog.at_level("INFO", logger="hf_dp.privacy"):
        trainer = make_trainer(tmp_path, noise_multiplier=1.0, rows_are_blocks=True)
    assert "the guarantee is per block: N=32 blocks" in caplog.text
    report = trainer.privacy_report()
    assert report["unit"] == "block"
    report["epsilon"] = 3.0
    text = privacy_section(report)
    assert "private at the block level" in text and "N = 32 blocks" in text
    users = make_trainer(tmp_path, dataset=UserRows(), noise_multiplier=1.0, privacy_unit_column="user_id")
    text = privacy_section({**users.privacy_report(), "epsilon": 3.0})
    assert "private at the user level" in text and "N = 8 users" in text and "at most 4 examples" in text
    with pytest.raises(ValueError, match="max_examples_per_unit=2 caps a user's rows per step, which needs"):
        make_trainer(tmp_path, noise_multiplier=1.0, max_examples_per_unit=2)
    with pytest.raises(ValueError, match="privacy_unit_column=.author."):
        make_trainer(tmp_path, dataset=UserRows(), noise_multiplier=1.0, privacy_unit_column="author")


def test_rows_cut_from_concatenated_text_are_reported_as_blocks(tmp_path) -> None:
    """run_clm's group_texts output (one length, labels = input_ids, no padding) is stated per block, unless the
    user says its rows are records; ragged tokenised records stay examples."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, models.VOCAB, (32, 16), generator=g).tolist()
    blocks = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 16] * 32, "labels": ids})
    assert make_trainer(tmp_path, dataset=blocks, noise_multiplier=1.0).privacy_report()["unit"] == "block"
    declared = make_trainer(tmp_path, dataset=blocks, noise_multiplier=1.0, rows_are_blocks=False)
    assert declared.privacy_report()["unit"] == "example"
    ragged = [row[: 4 + i % 12] for i, row in enumerate(ids)]
    records = Dataset.from_dict({"input_ids": ragged, "labels": ragged})
    assert make_trainer(tmp_path, dataset=records, noise_multiplier=1.0).privacy_report()["unit"] == "example"


def test_user_level_epsilon_is_accounted_over_users(tmp_path) -> None:
    """ε of a user-level run: the subsampled Gaussian with q = B̄ / N_users (not rows), matching Google's
    dp_accounting; δ defaults to N_users^-1.1."""
    from tests.test_trainer import _dp_accounting_epsilon

    trainer = make_trainer(
        tmp_path,
        dataset=UserRows(),
        noise_multiplier=1.5,
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        privacy_unit_column="user_id",
    )
    assert trainer.sample_rate == pytest.approx(2 / 8) and trainer.target_delta == pytest.approx(8**-1.1)
    trainer.train()
    assert trainer.state.global_step == 4
    independent = _dp_accounting_epsilon(1.5, 2 / 8, 4, 8**-1.1, "prv")
    assert trainer.get_epsilon() == pytest.approx(independent, rel=0.01)
    assert all("epsilon" in h for h in trainer.state.log_history)


def _mixtral() -> nn.Module:
    """Mixtral in float64: its routers and fused experts by their call rules (the grouped GEMM takes no float64)."""
    model = models.mixtral()
    model.config._experts_implementation = "batched_mm"
    return model


# MoE routers cast their logits to float32, which a unit alone (brute force) and the batch round differently
MOE_RTOL = 1e-6


@pytest.mark.parametrize("strategy_name", ["ghost", "per_sample", "checkpointing"])
def test_moe_units_of_rows_are_clipped_as_one(strategy_name: str) -> None:
    """A user's or a DPO pair's rows through an MoE: the routed pairs of each unit's rows (experts) and its tokens'
    router rows laid out by unit, clipped once per unit."""
    model = _mixtral().double().train()
    if strategy_name == "checkpointing":
        model.activation_checkpointing_enable({"use_reentrant": False})
    ours, reference, _ = units_of_rows_step(strategy_name, model, models.token_batch(6))
    assert_close(ours, reference, rtol=MOE_RTOL, floor=1e-6)


@pytest.mark.parametrize("strategy_name", ["ghost", "checkpointing"])
def test_moe_packed_records_are_clipped_each_on_its_own(strategy_name: str) -> None:
    """Records packed into rows through an MoE: each routed pair's record is its token's."""
    model = _mixtral().double().train()
    model.config.use_cache = False
    batch, records = packed_batch()
    alone = [[{"input_ids": r[None], "labels": r[None]}] for r in records]
    _, norms = oracle.per_unit(model, alone, 1e9)
    max_norm = 0.5 * norms.min().item()
    reference, _ = oracle.per_unit(model, alone, max_norm)
    if strategy_name == "checkpointing":
        model.activation_checkpointing_enable({"use_reentrant": False})
    units = PrivacyUnits.of_records(batch["position_ids"])
    ours = strategy_step(
        strategy_name, model, lambda m: per_example_loss(m, batch, units=units), units, max_norm
    )
    assert_close(ours, reference, rtol=MOE_RTOL, floor=1e-6)


def test_a_module_without_a_layer_rule_that_sees_whole_packed_rows_is_refused_in_one_line() -> None:
    """Mamba's mixer (the torch.func fallback) takes the packed rows themselves, not their tokens as rows: its
    per-record gradients cannot be split out of a row's, so the step is refused before anything is released."""
    from tests.test_flattened_rows import mamba

    model = mamba().double().train()
    batch, _ = packed_batch()
    units = PrivacyUnits.of_records(batch["position_ids"])
    unpositioned = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    with pytest.raises(UnsupportedModuleError, match="sees whole packed rows") as refused:
        strategy_step("ghost", model, lambda m: per_example_loss(m, unpositioned, units=units), units, 1.0)
    assert "\n" not in str(refused.value)
