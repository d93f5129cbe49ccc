"""Moved to hf_dp.clipping.geometry (kept importable while the package is being renamed)."""

from hf_dp.clipping.geometry import ClipScale, ClipScales, FactoredScale, dense_scale

__all__ = ["ClipScale", "ClipScales", "FactoredScale", "dense_scale"]
