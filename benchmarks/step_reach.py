"""How much of hf_dp one steady-state DP step enters: the distinct files, the distinct functions and the Python calls
of ``hf_dp`` during one step after the first (``sys.setprofile``), in step_counts.py's four cells (LoRA and full
fine-tuning of its tiny Llama, with and without activation checkpointing).

    .venv/bin/python benchmarks/step_reach.py --out benchmarks/results/step_reach.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
sys.path[:] = [_REPO_ROOT] + [p for p in sys.path if p != _REPO_ROOT]  # before Opacus' own ``benchmarks``

from benchmarks import llm_memory, step_counts  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "step_reach.json"


def reach(tuning: str, checkpointing: bool) -> dict[str, Any]:
    """One DP step after the first: the hf_dp files and functions it enters, and its Python calls into hf_dp."""
    setting = llm_memory.Setting(
        tuning, "fp32", checkpointing, step_counts.TINY_SEQ, step_counts.TINY_BATCH, step_counts.TINY
    )
    variant = llm_memory.build_variant("dp", setting, llm_memory.make_rows(setting), "cpu")
    variant.step()
    files: dict[str, int] = {}
    functions: set[str] = set()

    def profile(frame, event: str, arg: object) -> None:
        path = frame.f_code.co_filename
        if event == "call" and "/hf_dp/" in path:
            name = path[path.index("/hf_dp/") + 1 :]
            files[name] = files.get(name, 0) + 1
            functions.add(f"{name}:{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        variant.step()
    finally:
        sys.setprofile(None)
    return {"files": len(files), "functions": len(functions), "calls": sum(files.values()), "by_file": files}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    cli = parser.parse_args(argv)
    result = {
        step_counts.cell_name(tuning, checkpointing): reach(tuning, checkpointing)
        for tuning, checkpointing in step_counts.CELLS
    }
    cli.out.write_text(json.dumps(result, indent=2) + "\n")
    for cell, counted in result.items():
        print(f"{cell}: {counted['files']} files, {counted['functions']} functions, {counted['calls']} calls")
    return result


if __name__ == "__main__":
    main()
