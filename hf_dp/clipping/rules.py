"""One small rule per layer type, in a registry: the per-example gradients of a module's own parameters.

Each rule maps (module, its input, the gradient of its output) to per-example gradients in the cheapest
exact form (``per_example.py``). We write our own rules rather than use Opacus' grad samplers because Opacus
1.6 has no rule for HF ``Conv1D``, gives the ``padding_idx`` row of an embedding a non-zero gradient, refuses
tied embeddings in ghost mode and has no single-backward (book-keeping) mode. Add a rule for your own module
with ``@register_rule(MyModule)`` (docs/clipping.md has an example).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module  # what functional_call uses, minus the hooks
from transformers.pytorch_utils import Conv1D

from hf_dp.clipping.errors import UnsupportedModuleError
from hf_dp.clipping.experts import is_routed_experts, routed_experts_rule
from hf_dp.clipping.fallback import ModuleCall, functorch_per_example_grads
from hf_dp.clipping.lora_params import claims_nested, parameter_lora_rule
from hf_dp.clipping.one_linear import one_linear_rule, reads_one_linear
from hf_dp.clipping.per_example import Materialised, OuterProductSum, PerExampleGradient, linear_parts
from hf_dp.clipping.wide_gemm import matmul_factors, wide

Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, PerExampleGradient]]
# a module's whole call (fallback.ModuleCall) -> per-example gradients of the parameters it covers
CallRule = Callable[[ModuleCall], dict[str, PerExampleGradient]]


def linear_rule(module: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, PerExampleGradient]:
    """y = x Wᵀ + b:  G_i(W) = Σ_t ∂y_t ⊗ x_t,  G_i(b) = Σ_t ∂y_t."""
    return linear_parts(x, grad_out, module.out_features, module.bias is not None)


def conv1d_rule(module: Conv1D, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, PerExampleGradient]:
    """HF Conv1D is y = x W + b with W of shape (in, out):  G_i(W) = Σ_t x_t ⊗ ∂y_t."""
    a, g = matmul_factors(x, grad_out)
    bias = Materialised(g.sum(dim=1, dtype=torch.promote_types(g.dtype, torch.float32)))
    return {"weight": OuterProductSum(left=a, right=g, rows=module.nx), "bias": bias}


def embedding_rule(
    module: nn.Embedding, ids: torch.Tensor, grad_out: torch.Tensor
) -> dict[str, PerExampleGradient]:
    """y_t = E[x_t]:  G_i(E) = Σ_t onehot(x_t) ⊗ ∂y_t; the padding_idx row gets no gradient, as in autograd."""
    if ids.is_floating_point() or ids.shape != grad_out.shape[: ids.dim()]:
        raise UnsupportedModuleError(
            f"{type(module).__name__} looks up rows its input does not name (its input: {ids.dtype} of shape "
            f"{tuple(ids.shape)}, as a learned positional embedding that makes its own positions): register a rule "
            "for it with hf_dp.clipping.rules.register_rule, or freeze it"
        )
    ids = ids.reshape(ids.shape[0], -1)
    g = wide(grad_out.reshape(ids.shape[0], ids.shape[1], -1))
    if module.padding_idx is not None:
        g = g.masked_fill((ids == module.padding_idx)[:, :, None], 0.0)
    return {"weight": OuterProductSum(left=ids, right=g, rows=module.num_embeddings)}


def makes_own_rows(module: nn.Module) -> bool:
    """An embedding whose forward computes the rows it looks up (OPT's and BART's learned positions, from a mask or
    a length): its input does not name them."""
    return (
        isinstance(module, nn.Embedding)
        and type(module).forward is not nn.Embedding.forward
        and not is_scaled_embedding(module)
    )


# Embeddings whose forward was found to be a plain lookup of the rows it computes.
_PLAIN_LOOKUP: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def looked_up_rows(module: nn.Embedding, args: tuple, kwargs: dict) -> torch.Tensor:
    """The rows the module's own forward looks up, read back by running it with a weight whose row v is (v, 2v)
    (float64: exact); refused once if the output is not such a row (the forward transforms what it looked up)."""
    rows = torch.arange(module.num_embeddings, dtype=torch.float64, device=module.weight.device)
    probe = torch.stack([rows, 2 * rows], dim=1)
    with torch.no_grad(), _reparametrize_module(module, {"weight": probe}):
        out = module.forward(*args, **kwargs)
    found = out[..., 0]
    if module not in _PLAIN_LOOKUP:
        if not (torch.equal(out[..., 1], 2 * found) and torch.equal(found, found.round())):
            raise UnsupportedModuleError(
                f"{type(module).__name__} computes the rows it looks up and transforms them: register a rule for "
                "it with hf_dp.clipping.rules.register_rule, or freeze it"
            )
        _PLAIN_LOOKUP[module] = True
    return found.long()


def rule_input(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """What a module's rule reads as its input x: its first tensor argument, or for an embedding that computes
    its own rows, those rows."""
    if makes_own_rows(module) and rule_for(module) is embedding_rule:
        return looked_up_rows(module, args, kwargs)
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def is_scaled_embedding(module: nn.Module) -> bool:
    """An embedding whose forward multiplies the looked-up rows by ``embed_scale`` (Gemma's and BART's
    ``…ScaledWordEmbedding``): the plain embedding rule would miss the scale."""
    return (
        isinstance(module, nn.Embedding)
        and type(module).__name__.endswith("ScaledWordEmbedding")
        and hasattr(module, "embed_scale")
    )


def scaled_embedding_rule(
    module: nn.Embedding, ids: torch.Tensor, grad_out: torch.Tensor
) -> dict[str, PerExampleGradient]:
    """y_t = s·E[x_t]:  G_i(E) = Σ_t onehot(x_t) ⊗ s·∂y_t, with s as the forward multiplies by it (a tensor scale
    in the weight's dtype), so the product is autograd's."""
    scale = module.embed_scale
    if isinstance(scale, torch.Tensor):
        scale = scale.to(module.weight.dtype)
    return embedding_rule(module, ids, grad_out * scale)


def layer_norm_rule(
    module: nn.LayerNorm, x: torch.Tensor, grad_out: torch.Tensor
) -> dict[str, PerExampleGradient]:
    """y = x̂ ⊙ γ + β (Ba et al. 2016):  G_i(γ) = Σ_t ∂y_t ⊙ x̂_t,  G_i(β) = Σ_t ∂y_t."""
    shape = module.normalized_shape
    x_hat = torch.nn.functional.layer_norm(wide(x), shape, eps=module.eps)
    g = wide(grad_out)
    reduce = tuple(range(1, g.dim() - len(shape)))

    def per_example(t: torch.Tensor) -> Materialised:  # a (B, d) input has no positions to sum over
        return Materialised(t.sum(dim=reduce) if reduce else t)  # (sum(dim=()) would sum everything)

    parts: dict[str, PerExampleGradient] = {}
    if module.weight is not None:
        parts["weight"] = per_example(g * x_hat)
    if module.bias is not None:
        parts["bias"] = per_example(g)
    return parts


def _forward_with_weight(module: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward with ``weight`` in place of its weight, skipping every hook (ours, and
    DeepSpeed ZeRO-3's parameter gathering, which would try to gather the plain tensor)."""
    with _reparametrize_module(module, {"weight": weight}):
        return module.forward(x)


# Per RMSNorm module, the weight w₀ whose forward returns x̂ itself: 1 for y = x̂ ⊙ w, 0 for y = x̂ ⊙ (1 + w), as a
# tensor of the weight's shape, dtype and device, made once rather than on every step.
_IDENTITY_WEIGHT: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


def _identity_weight(module: nn.Module, shape: torch.Size, like: dict, x: torch.Tensor) -> torch.Tensor:
    """Found once per module (and again if its dtype or device changes), on a row of ones (whose x̂ is not 0):
    with w = 0, x̂ ⊙ w is 0 and x̂ ⊙ (1 + w) is not."""
    kept = _IDENTITY_WEIGHT.get(module)
    if kept is None or kept.shape != shape or kept.dtype != like["dtype"] or kept.device != like["device"]:
        with torch.no_grad():
            zero = torch.zeros(shape, **like)
            offset = bool(_forward_with_weight(module, zero, x.new_ones((1, *shape))).any())
        kept = _IDENTITY_WEIGHT[module] = torch.full(shape, 0.0 if offset else 1.0, **like)
    return kept


def rms_norm_rule(
    module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor
) -> dict[str, PerExampleGradient]:
    """y = x̂ ⊙ w (Llama, T5, torch) or x̂ ⊙ (1 + w) (Gemma), x̂ = x / rms(x) (Zhang & Sennrich 2019):
    G_i(w) = Σ_t ∂y_t ⊙ x̂_t. x̂ comes from the module itself run with the weight that makes it the identity on
    x̂ (1 or 0, found once per module), so it carries exactly the module's own precision choices (HF norms
    compute the variance in float32)."""
    weight = module.weight
    # DeepSpeed ZeRO-3 leaves a partitioned weight of shape (0,) outside the forward; ds_shape is its real one
    shape, like = getattr(weight, "ds_shape", weight.shape), {"dtype": weight.dtype, "device": weight.device}
    x_hat = _forward_with_weight(module, _identity_weight(module, shape, like, x), x)
    g = wide(grad_out)
    return {"weight": Materialised((g * wide(x_hat)).reshape(g.shape[0], -1, g.shape[-1]).sum(dim=1))}


# the HF RMSNorms not named so: T5's and its descendants' w ⊙ x / rms(x)
T5_LAYER_NORMS = frozenset({"T5LayerNorm", "MT5LayerNorm", "UMT5LayerNorm", "LongT5LayerNorm"})


def is_rms_norm(module: nn.Module) -> bool:
    """torch's RMSNorm and the HF ones (LlamaRMSNorm, T5LayerNorm, MT5LayerNorm, ...): a single (d,) weight, no
    bias."""
    if isinstance(module, nn.RMSNorm):
        return module.weight is not None
    name = type(module).__name__
    params = dict(module.named_parameters(recurse=False))
    return (
        (name.endswith("RMSNorm") or name in T5_LAYER_NORMS)
        and list(params) == ["weight"]
        and params["weight"].dim() == 1
        and not list(module.children())
    )


def parameter_at(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter a module holds under ``name``, its own (``weight``) or a submodule's (``lora_A.default.weight``),
    as the module holds it now (FSDP2 swaps in unsharded parameters)."""
    for part in name.split("."):
        module = getattr(module, part)
    return module


_RULES: dict[type, Rule] = {}
_MATCHERS: list[tuple[Callable[[nn.Module], bool], Rule]] = []


def register_rule(*module_types: type, when: Callable[[nn.Module], bool] | None = None):
    """Register ``rule(module, input, grad_output) -> {param_name: PerExampleGradient}`` for ``module_types``
    (subclasses included) or for every module ``when(module)`` accepts::

        @register_rule(MyScale)            # y = x ⊙ w
        def my_scale_rule(module, x, grad_out):
            return {"weight": Materialised((grad_out * x).reshape(x.shape[0], -1, x.shape[-1]).sum(dim=1))}
    """

    def register(rule: Rule) -> Rule:
        for module_type in module_types:
            _RULES[module_type] = rule
        if when is not None:
            _MATCHERS.append((when, rule))
        return rule

    return register


def rule_for(module: nn.Module) -> Rule | None:
    """The rule registered for the module's own type, else the first matcher's that accepts it, else the nearest
    base class's in its MRO (a matcher can thus refine a subclass whose forward differs, like a scaled
    embedding); None means the torch.func fallback. A sparse Embedding has no rule."""
    if isinstance(module, nn.Embedding) and module.sparse:
        return None
    if type(module) in _RULES:
        return _RULES[type(module)]
    matched = next((rule for when, rule in _MATCHERS if when(module)), None)
    if matched is not None:
        return matched
    return next((_RULES[cls] for cls in type(module).__mro__ if cls in _RULES), None)


_CALL_RULES: list[tuple[Callable[[nn.Module], bool], CallRule]] = []


def register_call_rule(when: Callable[[nn.Module], bool]):
    """Register ``rule(call: ModuleCall) -> {param_name: PerExampleGradient}`` for every module ``when(module)``
    accepts that has no layer rule: a rule that needs the whole call (every argument, every output's gradient), as
    fused MoE experts do (experts.py). A rule that returns fewer parameters than asked leaves the call to the
    torch.func fallback."""

    def register(rule: CallRule) -> CallRule:
        _CALL_RULES.append((when, rule))
        return rule

    return register


def call_rule_for(module: nn.Module) -> CallRule | None:
    """The first registered call rule that accepts the module, or None (the torch.func fallback)."""
    return next((rule for when, rule in _CALL_RULES if when(module)), None)


register_rule(nn.Linear)(linear_rule)
register_rule(Conv1D)(conv1d_rule)
register_rule(nn.Embedding)(embedding_rule)
register_rule(nn.LayerNorm)(layer_norm_rule)
register_rule(when=is_rms_norm)(rms_norm_rule)
register_rule(when=is_scaled_embedding)(scaled_embedding_rule)
register_call_rule(is_routed_experts)(routed_experts_rule)
register_call_rule(claims_nested)(parameter_lora_rule)
register_call_rule(reads_one_linear)(one_linear_rule)


def per_call_grads(call: ModuleCall, param_names: list[str]) -> dict[str, PerExampleGradient]:
    """The per-example gradients of a module without a layer rule, from its whole call: its call rule where one
    is registered and covers ``param_names``, else the torch.func fallback."""
    if call.rows is not None and call.rows.time_major:
        raise UnsupportedModuleError(
            f"{type(call.module).__name__} has no layer rule and takes a time-major (T, B, ...) input, which its call "
            "rule and the torch.func fallback do not split per example: register a layer rule for it, or freeze it"
        )
    rule = call_rule_for(call.module)
    if rule is not None:
        found = rule(call)
        if all(name in found for name in param_names):
            return {name: found[name] for name in param_names}
    return functorch_per_example_grads(call, param_names)
