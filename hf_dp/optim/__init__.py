"""DP update rules: a base class, a registry (``make_dp_optimizer``), step plans, one module per rule.

Importing the package registers the built-in rules, each module under its names (``registry`` imports none).
"""

from hf_dp.optim import adam_bc, disk, doppler, dp2, scale_then_privatize, torch_rules  # noqa: F401
