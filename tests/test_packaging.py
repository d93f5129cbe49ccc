"""Packaging: what pyproject.toml declares about the distribution."""

from __future__ import annotations

import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_license_is_an_spdx_string_setuptools_accepts_without_warning():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))
