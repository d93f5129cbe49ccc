"""The registry of DP update rules: ``dp_optimizer`` names to builders of the rule fed the privatised ĝ.

A builder is ``build(params, *, mean_noise_std, **kwargs) -> torch.optim.Optimizer``; ``mean_noise_std`` = σC/B̄
is the per-coordinate std of the noise in ĝ, which noise-aware rules (DP-AdamBC) use and the others ignore.
Register your own rule in a few lines::

    @register_dp_optimizer("signsgd")
    def build_signsgd(params, *, mean_noise_std, lr=1e-3):
        return SignSGD(params, lr=lr)

then ``DPTrainingArguments(dp_optimizer="signsgd", ...)``. Say what the rule's step plans ask of clipping, since
the sharded backends cannot give all of it: ``scaled_geometry=True`` (it clips ‖s ⊙ g_i‖ with s from its
per-parameter state; refused under DeepSpeed, whose optimizer holds flattened partitions) and
``shifted_evaluations=True`` (it evaluates each example away from θ; refused under DeepSpeed and FSDP).
Each name holds one ``RuleSpec``. This module imports no rule: ``hf_dp.optim`` registers the built-in ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

Builder = Callable[..., torch.optim.Optimizer]


@dataclass(frozen=True)
class RuleSpec:
    """One registered rule: its builder, the constructor the builder forwards its kwargs to (named in the
    error for a wrong kwarg), and what its step plans ask of clipping (the sharded backends refuse some)."""

    build: Builder
    rule_class: Callable[..., Any] | None = None
    scaled_geometry: bool = False
    shifted_evaluations: bool = False


_RULES: dict[str, RuleSpec] = {}


def register_dp_optimizer(
    name: str,
    *,
    rule_class: Callable[..., Any] | None = None,
    scaled_geometry: bool = False,
    shifted_evaluations: bool = False,
) -> Callable[[Builder], Builder]:
    """Register ``build`` under ``name`` (replacing an earlier one); ``rule_class`` is what it forwards to."""

    def register(build: Builder) -> Builder:
        _RULES[name] = RuleSpec(build, rule_class, scaled_geometry, shifted_evaluations)
        return build

    return register


def rule_spec(name: str) -> RuleSpec:
    """The record registered under ``name``; a ValueError naming the registered ones if there is none."""
    if name not in _RULES:
        raise ValueError(f"unknown dp_optimizer {name!r}; use one of {list(dp_optimizer_names())}")
    return _RULES[name]


def dp_optimizer_names() -> tuple[str, ...]:
    return tuple(sorted(_RULES))


def scaled_geometry(name: str) -> bool:
    """The rule clips ‖s ⊙ g_i‖ with a scale built from its per-parameter state (STP, DP²)."""
    return name in _RULES and _RULES[name].scaled_geometry


def shifted_evaluations(name: str) -> bool:
    """The rule evaluates each example at points other than θ within one step (DiSK)."""
    return name in _RULES and _RULES[name].shifted_evaluations


def make_dp_optimizer(
    name: str, params: Iterable[Any], *, mean_noise_std: float = 0.0, **kwargs: Any
) -> torch.optim.Optimizer:
    """Build the update rule ``name`` over ``params``; the trainer releases ĝ into it through the mechanism."""
    spec = rule_spec(name)
    try:
        return spec.build(params, mean_noise_std=mean_noise_std, **kwargs)
    except TypeError as error:
        raise ValueError(
            f"dp_optimizer {name!r} does not accept dp_optimizer_kwargs {kwargs}: {_culprit(spec, kwargs, error)}"
        ) from None


def decay_groups(
    model: torch.nn.Module, decay_names: Iterable[str], weight_decay: float
) -> list[dict[str, Any]]:
    """The trainable parameters in two groups, as the Trainer makes them: with and without weight decay."""
    decay = set(decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _culprit(spec: RuleSpec, kwargs: dict[str, Any], error: TypeError) -> str:
    """Which kwarg is wrong, from the builder's signature (and the rule's constructor it forwards to)."""
    accepted: set[str] = set()
    open_ended = False
    for function in (spec.build, spec.rule_class):
        if function is None:
            continue
        for parameter in inspect.signature(function).parameters.values():
            open_ended |= parameter.kind is inspect.Parameter.VAR_KEYWORD
            accepted.add(parameter.name)
    unknown = sorted(set(kwargs) - accepted - {"mean_noise_std"})
    if unknown and not open_ended:
        return f"unknown {', '.join(map(repr, unknown))}; it takes {sorted(accepted - {'params', 'mean_noise_std'})}"
    return str(error).replace("\n", " ")
