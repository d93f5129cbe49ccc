"""Group-wise clipping (He et al. 2022, "Exploring the limits of differentially private deep learning with
group-wise clipping"): the clipped parameters split into G groups, example i's gradient on group g clipped on its
own to C_g, with Σ_g C_g² = C²:

    ‖Σ_g c_ig g_ig‖² = Σ_g c_ig² ‖g_ig‖² ≤ Σ_g C_g² = C²,

so the sensitivity, the noise and the accounting are flat clipping's at C. A group's norms are complete once the
backward has passed the last use of its parameters, so its clipped sum Σ_i c_ig G_i is formed there from the taps'
per-example gradients (taps.py) and they are let go: one backward per step, with or without activation
checkpointing, and no weighted pass.

Groups (``clipping_groups``): ``"layer"``, each transformer block (the name up to its first numeric segment, e.g.
``model.layers.3``) and every other module on its own (embeddings, final norm, head); ``"parameter"``, each trainable
tensor; or module-name prefixes, each parameter in the group of the first prefix it falls under.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hf_dp.clipping.geometry import ClipScale
from hf_dp.clipping.per_example import (
    Dropped,
    Folded,
    PerExampleGradient,
    Weighted,
    clipped_total,
    combined_squared_norm,
)

GROUPINGS = ("all", "layer", "parameter")


@dataclass(frozen=True)
class ClipGroups:
    """The groups' ``names``, each one's share C_g / C of the clip norm (Σ_g share² = 1) and each clipped
    parameter's group, by the parameter's name (FSDP2 swaps the objects, not the names)."""

    names: tuple[str, ...]
    shares: tuple[float, ...]
    of: dict[str, int]

    def index(self, named: dict[int, str]) -> dict[int, int]:
        """Each clipped parameter's group by the id of the object now named so (``named``: id → name)."""
        return {pid: self.of[name] for pid, name in named.items() if name in self.of}

    def norms(self, clip_norm: float) -> list[float]:
        """C_g at the step's clip norm C."""
        return [share * clip_norm for share in self.shares]

    def describe(self, clip_norm: float) -> str:
        """One line for the report and the model card."""
        norms = sorted({round(c, 6) for c in self.norms(clip_norm)})
        each = f"C_g = {norms[0]:.4g}" if len(norms) == 1 else f"C_g from {norms[0]:.4g} to {norms[-1]:.4g}"
        return f"group-wise: {len(self.names)} groups, {each}, sqrt(Σ_g C_g²) = C = {clip_norm:g}"


def _layer_group(name: str) -> str:
    """A transformer block (the name up to its first numeric segment), or the module holding the parameter."""
    segments = name.split(".")
    for k, segment in enumerate(segments[:-1]):
        if segment.isdigit():
            return ".".join(segments[: k + 1])
    return ".".join(segments[:-1]) or name


def _prefix_group(names: Sequence[str], prefixes: Sequence[str]) -> str:
    """The first prefix that any of the parameter's ``names`` falls under (a tied weight has several)."""
    for prefix in prefixes:
        if any(name == prefix or name.startswith(prefix + ".") for name in names):
            return prefix
    raise ValueError(
        f"clipping_groups: parameter {' = '.join(names)} falls under none of the prefixes {list(prefixes)}: add a "
        "prefix for it or freeze it"
    )


def _grouping(grouping: str | Sequence[str]) -> str | list[str]:
    """A keyword (any case, spaces or a trailing comma around it) or module-name prefixes; a keyword among
    prefixes is refused in one line."""
    if isinstance(grouping, str):
        parts = [p.strip() for p in grouping.split(",") if p.strip()]
        if len(parts) == 1 and parts[0].lower() in GROUPINGS:
            return parts[0].lower()
        grouping = parts
    keywords = [p for p in grouping if p.lower() in GROUPINGS]
    if keywords:
        raise ValueError(
            f"clipping_groups: {keywords[0]!r} is a keyword ({', '.join(GROUPINGS)}) among the prefixes "
            f"{list(grouping)}: give the keyword alone, or module-name prefixes only"
        )
    return list(grouping)


def clip_groups(
    named: Sequence[tuple[str, nn.Parameter]],
    grouping: str | Sequence[str],
    group_norms: Sequence[float] | None,
    clip_norm: float,
    aliases: dict[str, Sequence[str]] | None = None,
) -> ClipGroups | None:
    """The groups of the clipped parameters ``named`` (None: ``"all"``, flat clipping); ``group_norms``: explicit
    C_g in the groups' order (first appearance), whose root sum of squares must be C, else C / sqrt(G) each;
    ``aliases``: every name of a tied parameter, by its name in ``named`` (prefixes match any). A prefix that takes
    no clipped parameter is refused."""
    grouping = _grouping(grouping)
    if grouping == "all":
        return None
    if grouping == "parameter":
        group_of = [name for name, _ in named]
    elif grouping == "layer":
        group_of = [_layer_group(name) for name, _ in named]
    else:
        aliases = aliases or {}
        group_of = [_prefix_group(aliases.get(name, (name,)), grouping) for name, _ in named]
        empty = [prefix for prefix in grouping if prefix not in group_of]
        if empty:
            raise ValueError(
                f"clipping_groups: prefix {empty[0]!r} takes no trainable parameter (none under it, all frozen, or "
                "all taken by an earlier prefix): drop it, or put the narrower prefix first"
            )
    names = tuple(dict.fromkeys(group_of))
    index = {name: k for k, name in enumerate(names)}
    if group_norms is None:
        shares = (1 / math.sqrt(len(names)),) * len(names)
    else:
        if len(group_norms) != len(names):
            raise ValueError(
                f"clipping_group_norms has {len(group_norms)} values for {len(names)} groups ({', '.join(names)}): "
                "give one per group, in this order"
            )
        not_positive = [c for c in group_norms if not c > 0]
        if not_positive:
            raise ValueError(f"clipping_group_norms must all be positive, got {not_positive[0]}")
        total = math.sqrt(sum(c * c for c in group_norms))
        if not math.isclose(total, clip_norm, rel_tol=1e-6):
            raise ValueError(
                f"clipping_group_norms must be positive with sqrt(Σ C_g²) = per_sample_max_grad_norm = {clip_norm:g} "
                f"(the noise is sized for it), got {total:.6g}: rescale them"
            )
        shares = tuple(c / clip_norm for c in group_norms)
    return ClipGroups(names, shares, {n: index[g] for (n, _), g in zip(named, group_of, strict=True)})


class GroupSums:
    """Σ_i c_ig G_i of each group, formed as soon as every clipped parameter of the group has its per-example
    gradients (all its uses), from c_ig = clip(‖s ⊙ g_ig‖, C_g) · mask_i, 0 where the norm is not finite (nan or
    inf: clip gives nan or 0, and nan is set to 0), those examples' rows left out (0 · inf being nan). Each group's
    ‖s ⊙ g_ig‖² is one buffer its parameters' norms are added into (``buffer``). ``group_of``: each clipped
    parameter's group by the id of the object its module holds before the forward. ``finish`` after the backward
    forms the groups some of whose parameters got no gradient, and returns the norms (U, G)."""

    def __init__(
        self,
        groups: ClipGroups,
        group_of: dict[int, int],
        clip_norm: float,
        clip: Callable[[torch.Tensor, float], torch.Tensor],
        mask: torch.Tensor,
        dtype: torch.dtype,
        loss_scale: float = 1.0,
    ) -> None:
        self.groups, self.norms_g, self.clip = groups, groups.norms(clip_norm), clip
        self.mask = mask.to(dtype)  # cast once, not once a group
        self.group_of, self.loss_scale, self.dtype = group_of, loss_scale, dtype
        self.squared: list[torch.Tensor | None] = [None] * len(groups.names)  # ‖s ⊙ g_ig‖², (U,) a group
        self.norms: list[torch.Tensor | None] = [None] * len(groups.names)  # ‖s ⊙ g_ig‖ once formed
        self.remaining = [0] * len(groups.names)
        for group in group_of.values():
            self.remaining[group] += 1
        self.pending: list[list[tuple[nn.Parameter, list[PerExampleGradient]]]] = [[] for _ in groups.names]
        self.totals: dict[nn.Parameter, torch.Tensor] = {}

    def add(
        self,
        group: int,
        param: nn.Parameter,
        terms: list[Weighted],
        scale: ClipScale | None,
        shape: torch.Size,
        materialise: bool,
    ) -> None:
        """A parameter's per-example gradients (every use, ``terms``), their ‖s ⊙ G_i‖² added into its group's
        buffer in place (``combined_squared_norm``; the group's first parameter's is the buffer); ``param``: the
        object the backward saw (FSDP2's unsharded one), whose total is formed."""
        with torch.no_grad():  # a shared use's parts may carry autograd history
            squared = combined_squared_norm(terms, scale, shape, materialise, into=self.squared[group])
        self.squared[group] = squared.to(self.dtype)
        self.pending[group].append((param, [part for _, part in terms]))
        self.remaining[group] -= 1
        if self.remaining[group] == 0:
            self._form(group)

    def _form(self, group: int) -> None:
        norms = self.squared[group].clamp_(min=0).sqrt_()
        if self.loss_scale != 1:
            norms = norms.div_(self.loss_scale)
        self.norms[group] = norms
        factors = self.clip(norms, self.norms_g[group]).nan_to_num_(nan=0.0).mul_(self.mask)
        dropped = Dropped(factors == 0)
        if self.loss_scale != 1:
            factors = factors / self.loss_scale  # the weights of the S-scaled per-example gradients
        folded = Folded()  # q, k and v (gate and up) share their input: set to 0 and scaled once
        with torch.no_grad():
            for param, parts in self.pending[group]:
                total = clipped_total(param, [(1.0, part) for part in parts], factors, dropped, folded)
                self.totals[param] = total if param not in self.totals else self.totals[param].add_(total)
        self.pending[group] = []

    def finish(self) -> torch.Tensor:
        """After the backward: the groups not yet formed, then ‖s ⊙ g_ig‖ (U, G), 0 for a group that got no
        gradient."""
        for group, pending in enumerate(self.pending):
            if pending:
                self._form(group)
        missing = None if all(n is not None for n in self.norms) else self.mask.new_zeros(self.mask.shape)
        return torch.stack([missing if n is None else n for n in self.norms], dim=1)
