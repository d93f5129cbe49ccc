"""What group-wise clipping costs in utility: a recipe run with ``--clipping_groups all`` (flat clipping) and with
``--clipping_groups layer`` (each transformer block, the embeddings and the head clipped to C/sqrt(G) on their own),
in pairs. A pair's two runs share ``--seed`` and ``--insecure_dp_seed`` (a benchmark's key, never a release's): the
same Poisson batches and the same noise draws, so they differ only in how the examples are clipped.

    PYTHONPATH=. python benchmarks/groupwise_utility.py --task sst2 --dp_seeds 1 2 3 \\
        --out benchmarks/results/groupwise_utility_sst2.json
    PYTHONPATH=. python benchmarks/groupwise_utility.py --task mlm --dp_seeds 1 2 3 \\
        --out benchmarks/results/groupwise_utility_mlm.json

``sst2``: the main job's settings (scripts/main_job.sh: MiniLM's biases and a classifier, 100 steps of 512 expected
examples, ε = 8; the dev accuracy). ``mlm``: recipes/mlm.py's defaults (MiniLM fully fine-tuned on arXiv abstracts,
16 steps of 32, ε = 8; the held-out masked-token loss). Flags after ``--`` go to every run. A pair's runs go in
parallel, one torch thread each; every run keeps its results JSON in ``--work`` and is read, not rerun, when it is
there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._timing import git_state  # noqa: E402

GROUPINGS = ("all", "layer")
# scripts/main_job.sh's recipe flags (tests/test_groupwise_utility_smoke.py checks they are its)
MAIN_JOB = [
    "--task_name", "sst2", "--target_epsilon", "8", "--trainable", "bitfit", "--learning_rate", "1e-2",
    "--head_learning_rate", "0", "--per_sample_max_grad_norm", "5", "--max_steps", "100",
]  # fmt: skip
# task: (recipe, its flags, the metric, whether higher is better)
TASKS = {
    "sst2": ("recipes/glue.py", MAIN_JOB, "accuracy", True),
    "mlm": ("recipes/mlm.py", ["--target_epsilon", "8"], "eval_loss", False),
}
RECORDED = ("epsilon", "noise_multiplier", "steps", "expected_batch_size", "train_loss", "train_seconds")


def run_pair(options: argparse.Namespace, seed: int, extra: list[str]) -> dict[str, dict[str, Any]]:
    """Both groupings at ``insecure_dp_seed`` ``seed``, in parallel: each one's results file as the recipe wrote it."""
    recipe, flags, _, _ = TASKS[options.task]
    paths = {grouping: options.work / f"{options.task}_{grouping}_dp{seed}.json" for grouping in GROUPINGS}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running = []
    for grouping, path in paths.items():
        if path.exists():
            continue
        command = [
            sys.executable, str(REPO / recipe), *flags, "--clipping_groups", grouping,
            "--insecure_dp_seed", str(seed), "--output_dir", str(options.work / f"out_{path.stem}"),
            "--results_json", str(path), *extra,
        ]  # fmt: skip
        print(" ".join(command), flush=True)
        log = (options.work / f"{path.stem}.log").open("w")
        running.append(
            (subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log)
        )
    for process, log in running:
        code = process.wait()
        log.close()
        if code:
            raise RuntimeError(f"{' '.join(map(str, process.args))} failed ({code}); see {log.name}")
    return {grouping: json.loads(path.read_text()) for grouping, path in paths.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=tuple(TASKS), required=True)
    parser.add_argument("--dp_seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--work", type=Path, default=Path("/tmp/groupwise_utility"))
    parser.add_argument("--out", type=Path, required=True)
    options, extra = parser.parse_known_args(argv)
    extra = [flag for flag in extra if flag != "--"]
    options.work.mkdir(parents=True, exist_ok=True)
    _, _, metric, higher_is_better = TASKS[options.task]
    pairs = {seed: run_pair(options, seed, extra) for seed in options.dp_seeds}
    runs = {
        str(seed): {g: {metric: r[metric], **{k: r[k] for k in RECORDED}} for g, r in pair.items()}
        for seed, pair in pairs.items()
    }
    differences = [pair["layer"][metric] - pair["all"][metric] for pair in runs.values()]
    summary = {
        grouping: statistics.mean(pair[grouping][metric] for pair in runs.values()) for grouping in GROUPINGS
    }
    result = {
        "task": options.task,
        "metric": metric,
        "higher_is_better": higher_is_better,
        "recipe_flags": TASKS[options.task][1] + extra,
        "runs": runs,
        "mean": summary,
        "layer_minus_all": differences,
        "mean_layer_minus_all": statistics.mean(differences),
        "settings": {g: pairs[options.dp_seeds[0]][g]["settings"] for g in GROUPINGS},
        "git_commit": git_state(REPO)[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    options.out.write_text(json.dumps(result, indent=1) + "\n")
    for seed, pair in runs.items():
        print(f"dp seed {seed}: {metric} all {pair['all'][metric]:.4f}  layer {pair['layer'][metric]:.4f}")
    print(f"mean: all {summary['all']:.4f}  layer {summary['layer']:.4f}; wrote {options.out}")
    return result


if __name__ == "__main__":
    main()
