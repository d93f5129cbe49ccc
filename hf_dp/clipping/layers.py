"""Moved to hf_dp.clipping.rules (kept importable while the package is being renamed)."""

from hf_dp.clipping.rules import functorch_per_example_grads, register_rule, rule_for

__all__ = ["functorch_per_example_grads", "register_rule", "rule_for"]
