"""Choose ``recipes/table2text.py``'s learning rate on tables it never trains on: one run of the recipe per
candidate rate, everything else at the recipe's defaults (and ``-- extra recipe flags``), scored by BLEU and
ROUGE-L; the chosen rate is the highest BLEU.

    PYTHONPATH=. python benchmarks/table2text_tuning.py --dataset e2e --eval_split dev --max_eval_samples 100 \\
        --learning_rates 1e-3 2e-3 4e-3 --out benchmarks/results/table2text_e2e_smollm2_nodp_tuning.json -- --disable_dp
    PYTHONPATH=. python benchmarks/table2text_tuning.py --dataset dart --eval_split heldout \\
        --learning_rates 2e-3 4e-3 --out benchmarks/results/table2text_dart_smollm2_tuning.json

E2E tunes on its dev split (first ``--max_eval_samples`` MRs); DART, which has no split offline besides the one it
trains on and the test, on ``--eval_split heldout`` (100 tables spread through its training file, left out of
training). Each candidate runs in its own process (~25-30 min on one core from SmolLM2 + LoRA) and keeps its results
JSON and texts in ``--work``, named by dataset, split, rate and the other flags; a candidate whose results file is
there already is read, not run again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._timing import git_state  # noqa: E402

RECORDED = (
    "bleu", "rouge_l", "eval_tables", "epsilon", "noise_multiplier", "steps", "expected_batch_size",
    "train_loss", "train_seconds",
)  # fmt: skip


def flags_key(options: argparse.Namespace, extra: list[str]) -> str:
    """A short name for the flags a run was given besides its rate, so no run is read for another's."""
    flags = json.dumps([options.max_eval_samples, *extra])
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def candidate(
    options: argparse.Namespace, rate: str, extra: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The recipe's run at learning rate ``rate``: (its numbers, the mean length of its texts in words and its first
    three texts; the results file as the recipe wrote it)."""
    name = f"{options.dataset}_{options.eval_split}_lr{rate}_{flags_key(options, extra)}"
    results, predictions = options.work / f"{name}.json", options.work / f"{name}_predictions.txt"
    if not results.exists():
        command = [
            sys.executable, str(REPO / "recipes/table2text.py"), "--dataset", options.dataset,
            "--eval_split", options.eval_split, "--learning_rate", rate, "--metrics", "bleu,rouge_l",
            "--output_dir", str(options.work / f"out_{name}"), "--results_json", str(results),
            "--predictions_file", str(predictions), *extra,
        ]  # fmt: skip
        if options.max_eval_samples:
            command += ["--max_eval_samples", str(options.max_eval_samples)]
        print(" ".join(command), flush=True)
        subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    record = json.loads(results.read_text())
    texts = [line for line in predictions.read_text(encoding="utf-8").splitlines() if line.strip()]
    summary = {
        **{key: record[key] for key in RECORDED},
        "learning_rate": float(rate),
        "mean_words": sum(len(text.split()) for text in texts) / len(texts),
        "examples": record["examples"][:3],
    }
    return summary, record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=("e2e", "dart"), required=True)
    parser.add_argument("--eval_split", choices=("dev", "heldout"), required=True)
    parser.add_argument("--max_eval_samples", type=int, default=None)
    parser.add_argument("--learning_rates", nargs="+", required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/table2text_tuning"))
    parser.add_argument("--out", type=Path, required=True)
    options, extra = parser.parse_known_args(argv)
    extra = [flag for flag in extra if flag != "--"]
    options.work.mkdir(parents=True, exist_ok=True)
    done = {rate: candidate(options, rate, extra) for rate in options.learning_rates}
    runs = {rate: summary for rate, (summary, _) in done.items()}
    chosen = max(runs, key=lambda rate: runs[rate]["bleu"])
    record = done[chosen][1]
    result = {
        "dataset": options.dataset,
        "split": options.eval_split,
        "recipe_flags": extra,
        "model_name_or_path": record["model_name_or_path"],
        "pretrained": record["pretrained"],
        "runs": runs,
        "chosen_learning_rate": float(chosen),
        "settings": record["settings"],
        "git_commit": git_state(REPO)[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    options.out.write_text(json.dumps(result, indent=1) + "\n")
    for rate, run in runs.items():
        print(
            f"lr {rate}: BLEU {run['bleu']:.2f}  ROUGE-L {run['rouge_l']:.4f}  {run['mean_words']:.1f} words"
        )
    print(f"chosen: lr {chosen}; wrote {options.out}")
    return result


if __name__ == "__main__":
    main()
