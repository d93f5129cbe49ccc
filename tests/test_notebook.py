"""notebooks/quickstart.ipynb runs top to bottom (tiny size via HF_DP_QUICKSTART_SMOKE=1) and reports ε."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def _text(cell: nbformat.NotebookNode) -> str:
    return "".join(
        output.get("text", "") + "".join(output.get("data", {}).get("text/plain", ""))
        for output in cell.get("outputs", [])
    )


def test_quickstart_notebook_trains_privately_and_prints_epsilon(monkeypatch, shared_data):
    monkeypatch.setenv("HF_DP_QUICKSTART_SMOKE", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    text = "\n".join(_text(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert "'epsilon'" in text  # the training log lines
    spent = re.search(r"spent epsilon = (\S+) at delta", text)
    final = re.search(r"SST-2 dev accuracy (\S+) at epsilon (\S+) \(delta \S+, 2 steps\)", text)
    assert spent and final, text[-3000:]
    assert 0 < float(final.group(2)) <= 8.0 and 0.0 <= float(final.group(1)) <= 1.0
    assert "differential_privacy:" in text and "## Differential privacy" in text
