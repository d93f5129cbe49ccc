"""Choose the SST-2 probe's defaults on held-out TRAIN rows, never on dev: ``recipes/glue.py --trainable probe``
(all-mpnet-base-v2's unit-norm mean-pooled features, a private linear classifier) at ε = 8, for each batch, step
count and learning rate below, each twice (fresh noise), through the recipe's own DPTrainer path.

    PYTHONPATH=. python benchmarks/probe_tuning.py   # ~30 min on 2 cores: the encoder's one pass is ~16 of them

The encoder runs once over the training rows; every configuration trains a fresh probe on those features.
Writes benchmarks/results/glue_sst2_probe_tuning.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from recipes import glue  # noqa: E402
from recipes.linear_probe import LinearProbe  # noqa: E402

HOLDOUT = 1000
# (per-device batch, accumulation, steps): logical batches of 1024, 2048 and 4096
SHAPES = ((1024, 1, 300), (1024, 2, 500), (1024, 4, 500))
LEARNING_RATES = (0.1, 0.3, 1.0)
REPEATS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/glue_sst2_probe_tuning.json"))
    parser.add_argument("--max_train_samples", type=int, default=None, help="Fewer rows (a smoke run).")
    parser.add_argument("--quick", action="store_true", help="One shape, one lr, one repeat (a smoke run).")
    options = parser.parse_args()
    base = [
        "--task_name",
        "sst2",
        "--trainable",
        "probe",
        "--holdout",
        str(HOLDOUT),
        "--output_dir",
        "/tmp/probe",
    ]
    if options.max_train_samples:
        base += ["--max_train_samples", str(options.max_train_samples)]
    model_args, data_args, training_args = glue.parse_args(base)
    prepared = glue.prepare(model_args, data_args, training_args)
    shapes, rates, repeats = (
        (SHAPES[:1], LEARNING_RATES[:1], 1) if options.quick else (SHAPES, LEARNING_RATES, REPEATS)
    )
    rows = []
    for batch, accumulation, steps in shapes:
        for lr in rates:
            accuracies = []
            for repeat in range(repeats):
                argv = [
                    *base,
                    *(
                        "--per_device_train_batch_size",
                        str(batch),
                        "--gradient_accumulation_steps",
                        str(accumulation),
                    ),
                    *("--max_steps", str(steps), "--learning_rate", str(lr), "--seed", str(repeat)),
                ]
                run_args = glue.parse_args(argv)
                prepared.model = LinearProbe(prepared.model.config)
                started = time.time()
                _, record = glue.train_and_evaluate(*run_args, prepared)
                accuracies.append(record["accuracy"])
                print(
                    f"batch {batch * accumulation} steps {steps} lr {lr}: held-out {record['accuracy']:.4f}",
                    flush=True,
                )
            rows.append(
                {
                    "expected_batch_size": batch * accumulation,
                    "steps": steps,
                    "learning_rate": lr,
                    "held_out_accuracy": accuracies,
                    "mean": statistics.mean(accuracies),
                    "noise_multiplier": record["noise_multiplier"],
                    "epsilon": record["epsilon"],
                    "train_seconds": round(time.time() - started, 1),
                }
            )
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "what": "SST-2 linear probe on all-mpnet-base-v2 features at epsilon 8: held-out train rows, never dev",
        "held_out_rows": HOLDOUT,
        "train_rows": len(prepared.train),
        "encoder": model_args.model_name_or_path,
        "encode_seconds": round(prepared.encode_seconds, 1),
        "git_commit": commit,
        "runs": rows,
        "best": max(rows, key=lambda row: row["mean"]),
    }
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["best"]), flush=True)


if __name__ == "__main__":
    main()
