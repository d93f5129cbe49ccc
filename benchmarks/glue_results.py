"""The GLUE results table (README) from benchmarks/results/glue_*.json, written by recipes/glue.py --results_json.

python benchmarks/glue_results.py            # prints a Markdown table
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def rows() -> list[dict]:
    found = []
    for path in sorted(RESULTS.glob("glue_*.json")):
        record = json.loads(path.read_text())
        if "accuracy" in record and "task" in record:
            found.append({**record, "file": path.name})
    return found


def table(records: list[dict]) -> str:
    lines = [
        "| task | split | ε (target) | δ | trainable | steps × B̄ | accuracy | train wall (CPU s) | file |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        model = r["settings"]["model"]
        trainable = "lora" if model.get("use_lora") else model.get("trainable", "all")
        epsilon = r["epsilon"] if isinstance(r["epsilon"], str) else f"{r['epsilon']:.2f}"
        target = r["settings"]["training"].get("target_epsilon")
        lines.append(
            f"| {r['task']} | {r['split']} | {epsilon} ({target}) | {r['delta']:.2g} | {trainable} | "
            f"{r['steps']} × {r['expected_batch_size']} | {r['accuracy']:.4f} | "
            f"{r['train_seconds'] / 60:.0f} min ({r.get('train_cpu_seconds', float('nan')):.0f}) | {r['file']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(rows()))
