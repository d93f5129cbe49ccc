"""Group-wise clipping (hf_dp/clipping/groups.py): each group of example i's gradient clipped on its own to C_g,
Σ_g C_g² = C², formed in the norm pass's one backward. Compared with tests/oracle.py (one backward per example,
each group clipped by hand), in float64, with clipping active and inactive, with and without checkpointing."""

from __future__ import annotations

import math

import pytest
import torch

from hf_dp.backend import Backend
from hf_dp.clipping.engine import ClippingEngine
from hf_dp.clipping.groups import clip_groups
from hf_dp.clipping.pipeline import clipped_step
from hf_dp.clipping.plan import StepPlan
from hf_dp.hub import privacy_section
from hf_dp.losses import per_example_loss
from tests import models, oracle
from tests.test_checkpointing import llama_lora, step_sums
from tests.test_engine import assert_close
from tests.trainer_utils import make_trainer

C = 0.3


def _names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _reference(model, batch, engine, max_norm):
    """The oracle's Σ_i Σ_g c_ig g_ig with the engine's groups (checked against the spec on their own below)."""
    named = dict(model.named_parameters())
    groups = engine.groups
    norms = groups.norms(max_norm)
    group = {n: groups.of[engine.parameter_name(named[n])] for n in _names(model)}
    by_name = {n: (groups.names[group[n]], norms[group[n]]) for n in _names(model)}
    return oracle.per_example(model, batch, max_norm, groups=by_name)


MODELS = {
    "llama": lambda: models.llama().double().train(),
    "gpt2_tied": lambda: models.gpt2().double().train(),
    "llama_lora": lambda: llama_lora().double().train(),
}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("grouping", ["parameter", "layer"])
@pytest.mark.parametrize("name", list(MODELS))
def test_groupwise_step_equals_brute_force_per_group(name: str, grouping: str, checkpointing: bool) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    batch = models.token_batch()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    plain, norms = oracle.per_example(model, batch, 1e12)
    clip = 0.5 * norms.min().item()
    engine = ClippingEngine(model, grouping=grouping, clip_norm=clip)
    step = clipped_step(engine, model, Backend(checkpointing=checkpointing))
    reference, _ = _reference(model, batch, engine, clip)
    assert len(engine.groups.names) > 1
    # clipping active: the group-wise sum is far from the plain one, and from flat clipping's
    flat, _ = oracle.per_example(model, batch, clip)
    for other in (plain, flat):
        assert max((reference[n] - other[n]).norm() / other[n].norm().clamp(min=1e-12) for n in other) > 1e-2
    mask = torch.ones(batch["input_ids"].shape[0])
    for _ in range(2):  # the first step (checked) and a later one
        ours = step_sums(step, model, lambda module: per_example_loss(module, batch), mask, StepPlan(clip))
        assert_close(ours, reference, rtol=1e-9, floor=1e-9)
    # clipping inactive: C_g above every group's norm, the sum is the plain one
    loose = 1e6
    inactive = ClippingEngine(model, grouping=grouping, clip_norm=loose)
    ours = step_sums(
        clipped_step(inactive, model, Backend(checkpointing=checkpointing)),
        model,
        lambda module: per_example_loss(module, batch),
        mask,
        StepPlan(loose),
    )
    assert_close(ours, plain, rtol=1e-9, floor=1e-9)
    engine.remove_hooks()
    inactive.remove_hooks()


def test_the_groups_are_the_spec_and_their_norms_keep_the_sensitivity() -> None:
    model = models.llama(num_hidden_layers=2)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    per_parameter = clip_groups(named, "parameter", None, 2.0)
    assert len(per_parameter.names) == len(named)
    assert math.isclose(sum((c / 2.0) ** 2 for c in per_parameter.norms(2.0)), 1.0)
    layer = clip_groups(named, "layer", None, 2.0)
    assert layer.names == ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
    prefixes = clip_groups(
        named, "model.embed_tokens, model.layers, model.norm, lm_head", [1.0, 1.0, 1.0, 1.0], 2.0
    )
    assert prefixes.names == ("model.embed_tokens", "model.layers", "model.norm", "lm_head")
    assert clip_groups(named, "all", None, 2.0) is None
    with pytest.raises(ValueError, match="falls under none of the prefixes") as info:
        clip_groups(named, "model.layers", None, 2.0)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"sqrt\(Σ C_g²\) = per_sample_max_grad_norm"):
        clip_groups(named, "layer", [1.0] * 5, 2.0)
    with pytest.raises(ValueError, match="5 groups"):
        clip_groups(named, "layer", [1.0] * 3, 2.0)


def test_a_groupwise_step_runs_one_backward(monkeypatch) -> None:
    """With checkpointing as without: the norm pass's backward forms the sums; no weighted pass follows."""
    torch.manual_seed(0)
    model = models.llama().double().train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    batch = models.token_batch()
    engine = ClippingEngine(model, grouping="layer", clip_norm=C)
    step = clipped_step(engine, model, Backend(checkpointing=True))
    backwards = []
    original = torch.autograd.backward

    def counted(*args, **kwargs):
        backwards.append(None)
        return original(*args, **kwargs)

    mask = torch.ones(batch["input_ids"].shape[0])
    step_sums(step, model, lambda module: per_example_loss(module, batch), mask, StepPlan(C))  # checked
    monkeypatch.setattr(torch.autograd, "backward", counted)
    step_sums(step, model, lambda module: per_example_loss(module, batch), mask, StepPlan(C))
    assert len(backwards) == 1


def test_groupwise_training_states_its_groups_and_refuses_what_it_cannot_run(tmp_path) -> None:
    trainer = make_trainer(tmp_path, noise_multiplier=1.0, max_steps=2, clipping_groups="layer")
    trainer.train()
    report = trainer.privacy_report()
    assert report["clipping_groups"].startswith("group-wise: ")
    assert "sqrt(Σ_g C_g²) = C" in report["clipping_groups"]
    assert "group-wise: " in privacy_section(report)
    with pytest.raises(ValueError, match="DiSK.*group-wise clipping") as info:
        make_trainer(tmp_path, noise_multiplier=1.0, dp_optimizer="disk", clipping_groups="layer").train()
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="clipping_group_norms needs groups"):
        make_trainer(tmp_path, noise_multiplier=1.0, clipping_group_norms=[1.0])


def test_groupwise_clipping_is_refused_where_the_parameters_are_partitioned(tmp_path) -> None:
    from hf_dp.run import clipping_engine
    from tests.trainer_utils import make_args

    args = make_args(tmp_path, noise_multiplier=1.0, clipping_groups="layer")
    with pytest.raises(ValueError, match="not with ZeRO-3 yet") as info:
        clipping_engine(models.gpt2(), args, Backend(world_size=2, zero_stage=3))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_groupwise_clipping_of_units_of_rows_equals_brute_force(checkpointing: bool) -> None:
    """A privacy unit of several rows (a user's examples): each group of the unit's summed gradient clipped once."""
    from hf_dp.clipping.units import PrivacyUnits

    torch.manual_seed(0)
    model = models.llama().double().train()
    batch = models.token_batch(6)
    unit_of_row = torch.tensor([0, 1, 0, 2, 1, 0])
    members = [oracle.rows(batch, [r for r in range(6) if unit_of_row[r] == u]) for u in range(3)]
    _, norms = oracle.per_unit(model, members, 1e9)
    clip = 0.5 * norms.min().item()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    engine = ClippingEngine(model, grouping="layer", clip_norm=clip)
    named = dict(model.named_parameters())
    group_norms = engine.groups.norms(clip)
    group = {n: engine.groups.of[engine.parameter_name(named[n])] for n in _names(model)}
    by_name = {n: (engine.groups.names[group[n]], group_norms[group[n]]) for n in _names(model)}
    reference, _ = oracle.per_unit(model, members, clip, groups=by_name)
    per_row, _ = _reference(model, batch, engine, clip)  # each row its own unit: not what units ask
    units = PrivacyUnits.of_rows(unit_of_row)
    step = clipped_step(engine, model, Backend(checkpointing=checkpointing))
    for _ in range(2):  # the first step (checked) and a later one
        model.zero_grad(set_to_none=True)
        step.run(
            lambda m: units.mean_over_rows(per_example_loss(m, batch)),
            torch.ones(3),
            StepPlan(clip),
            model,
            units,
        )
        ours = {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}
        step.check_untouched()
        assert_close(ours, reference, rtol=1e-9, floor=1e-9)
    assert max((ours[n] - per_row[n]).norm() / per_row[n].norm().clamp(min=1e-12) for n in ours) > 1e-3


@pytest.mark.parametrize(
    "reentrant", [None, False, True], ids=["no_checkpointing", "non_reentrant", "reentrant"]
)
def test_groupwise_through_zero2_is_checked_on_its_first_step_and_equals_brute_force(reentrant) -> None:
    """Through DeepSpeed ZeRO-2 (every process holds every parameter whole) the first step checks the taps along
    their probes with autograd.grad of Σ_i r_i L_i, for fixed unequal r_i; every step is the per-group brute force
    (× W, which the framework's mean removes). A reentrant checkpoint hides its recomputation from autograd.grad."""
    torch.manual_seed(0)
    model = models.llama().double().train()
    batch = models.token_batch()
    _, norms = oracle.per_example(model, batch, 1e12)
    clip = 0.5 * norms.min().item()
    engine = ClippingEngine(model, grouping="layer", clip_norm=clip)
    reference, _ = _reference(model, batch, engine, clip)  # brute force's autograd.grad: before checkpointing
    if reentrant is not None:
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    backend = Backend(world_size=2, zero_stage=2, checkpointing=reentrant is not None)
    step = clipped_step(engine, model, backend)
    mask = torch.ones(batch["input_ids"].shape[0])
    for _ in range(2):
        ours = step_sums(step, model, lambda module: per_example_loss(module, batch), mask, StepPlan(clip))
        assert_close(ours, reference, rtol=1e-9, floor=1e-9)
    engine.remove_hooks()


@pytest.mark.parametrize("zero2", [False, True], ids=["one_process", "zero2"])
def test_groupwise_rows_credited_to_the_wrong_example_are_refused(monkeypatch, zero2: bool) -> None:
    """Mutation (as tests/test_flattened_rows.py): OPT's reshaped rows credited to example B - 1 - r // T, no
    example clipped (a check weighted by the mask alone would pass); the first step's check weighted by fixed
    unequal weights refuses it, on one process and through ZeRO-2."""
    from hf_dp.clipping.engine import UnsupportedModuleError
    from tests.test_flattened_rows import credit_rows_to_the_wrong_examples, opt

    credit_rows_to_the_wrong_examples(monkeypatch)
    model = opt().double().train()
    batch = models.token_batch()
    engine = ClippingEngine(model, grouping="layer", clip_norm=1e9)
    step = clipped_step(engine, model, Backend(world_size=2, zero_stage=2) if zero2 else Backend())
    mask = torch.ones(batch["input_ids"].shape[0])
    with pytest.raises(UnsupportedModuleError, match="credited to the wrong examples"):
        step_sums(step, model, lambda module: per_example_loss(module, batch), mask, StepPlan(1e9))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # each trained with fewer groups than asked, or was refused naming the wrong thing
        (
            {"clipping_groups": "transformer,transformer.h.0,lm_head"},
            r"prefix 'transformer.h.0' takes no trainable",
        ),
        (
            {"clipping_groups": "encoder.layers,transformer,lm_head"},
            r"prefix 'encoder.layers' takes no trainable",
        ),
        (
            {"clipping_groups": "all,layer"},
            r"'all' is a keyword \(all, layer, parameter\) among the prefixes",
        ),
        (
            {"clipping_groups": "layer", "clipping_group_norms": [0.0, 1.0, 0.5, 0.5, 0.5]},
            r"must all be positive, got 0.0",
        ),
        ({"clipping_groups": "layer", "clipping_group_norms": "0.35,0.35"}, r"must be a list of numbers"),
        (
            {"disable_dp": True, "noise_multiplier": None, "clipping_groups": "layer"},
            r"disable_dp=True clips nothing",
        ),
    ],
    ids=["shadowed", "absent", "keyword_among_prefixes", "zero_norm", "norms_as_text", "without_dp"],
)
def test_groups_asked_for_but_not_formed_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, **{"noise_multiplier": 1.0, **overrides})


def test_a_tied_weight_falls_under_a_prefix_of_any_of_its_names(tmp_path):
    # GPT-2's tied embedding is transformer.wte.weight in named_parameters() and lm_head.weight to the engine
    trainer = make_trainer(
        tmp_path,
        noise_multiplier=1.0,
        clipping_groups="transformer.wte,transformer.wpe,transformer.h,transformer.ln_f",
    )
    assert trainer.privacy_report()["clipping_groups"].startswith("group-wise: 4 groups")
    layered = make_trainer(tmp_path, noise_multiplier=1.0, clipping_groups=" Layer, ")  # a keyword, any case
    assert layered.privacy_report()["clipping_groups"].startswith("group-wise: 5 groups")
