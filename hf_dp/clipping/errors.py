"""The one error the clipping centre raises for a model it cannot clip per example (rules.py re-exports it)."""


class UnsupportedModuleError(ValueError):
    """A trainable parameter cannot be clipped per example."""
