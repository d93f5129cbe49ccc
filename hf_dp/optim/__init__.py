"""DP update rules: a base class, a registry (``make_dp_optimizer``), step plans, one module per rule."""
