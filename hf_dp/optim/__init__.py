"""DP optimizers: a shared privatising step and a registry of update rules."""
