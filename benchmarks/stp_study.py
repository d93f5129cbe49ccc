"""The scale-then-privatize study where it was made (Ganesh, McMahan, Thakurta; ../shared/spec/CORRELATED-NOISE.md):
DP-Adam and scale-then-privatize (STP), each with independent noise and with BandMF (``num_bands="auto"``), for
thousands of steps at ε = 8 on SST-2 (DP-BiTFiT on all-MiniLM-L6-v2, recipes/glue.py's defaults otherwise), paired seeds: each
seed's four arms draw the same batches and the same noise streams (``insecure_dp_seed``, an experiment's only use
of it). It reports SST-2 dev accuracy per arm, its mean and spread over seeds, and which ordering holds.

Made for a GPU (about 9 minutes on an H200 at the defaults); ``--budget_s`` stops starting runs once spent, a seed's
four arms being run together so that what finished stays paired. The GPU machines take 64 MiB of files:
``--bundle DIR`` writes MiniLM in fp16 (~45 MB) and SST-2's train and dev TSVs into DIR, and ``--from_bundle DIR``
runs from it (the weights widened back to float32 once, into a temporary folder). ``--smoke`` runs a few steps on
CPU (the test suite's check that the script works).

    python benchmarks/stp_study.py --bundle bundle/                        # here, then carry bundle/
    python benchmarks/stp_study.py --from_bundle bundle/ --out benchmarks/results/stp_study_h200.json   # on the GPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
sys.path[:] = [_REPO_ROOT] + [p for p in sys.path if p != _REPO_ROOT]  # before Opacus' own ``benchmarks``

from benchmarks import _timing  # noqa: E402  (sets the offline environment first)
from recipes import glue  # noqa: E402
from recipes.common import default_minilm_path, shared_data_dir  # noqa: E402

# (name, dp_optimizer, noise_mechanism)
ARMS = (
    ("dp_adam", "adamw", "independent"),
    ("dp_adam_bandmf", "adamw", "bandmf"),
    ("stp", "stp", "independent"),
    ("stp_bandmf", "stp", "bandmf"),
)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "stp_study.json"
BUNDLE_LIMIT_MB = 60  # what a GPU machine takes (64 MiB), less room for this checkout's changes


def make_bundle(folder: Path) -> dict[str, float]:
    """MiniLM in fp16 and SST-2's train and dev TSVs in ``folder``; their sizes in MB."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = default_minilm_path()
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=2).half()
    model.save_pretrained(folder / "minilm-fp16")
    AutoTokenizer.from_pretrained(source).save_pretrained(folder / "minilm-fp16")
    data = folder / "SST-2"
    data.mkdir(parents=True, exist_ok=True)
    for name in ("train.tsv", "dev.tsv"):
        shutil.copy(shared_data_dir() / "glue" / "SST-2" / name, data / name)
    sizes = {p.name: p.stat().st_size / 2**20 for p in folder.rglob("*") if p.is_file()}
    if sum(sizes.values()) > BUNDLE_LIMIT_MB:
        raise RuntimeError(f"the bundle takes {sum(sizes.values()):.1f} MB, over {BUNDLE_LIMIT_MB} MB")
    return sizes


def float32_copy(folder: Path, into: Path) -> Path:
    """The bundle's fp16 MiniLM widened to float32 (the recipe trains in float32)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2).float()
    model.save_pretrained(into)
    AutoTokenizer.from_pretrained(folder).save_pretrained(into)
    return into


def arm_args(
    arm: tuple[str, str, str], seed: int, cli: argparse.Namespace, model: str, data: str, out: Path
) -> list:
    name, optimizer, mechanism = arm
    args = [
        "--task_name", "sst2", "--model_name_or_path", model, "--trainable", "bitfit", "--data_dir", data,
        "--target_epsilon", "8",
        "--max_steps", str(cli.steps), "--dp_optimizer", optimizer, "--noise_mechanism", mechanism,
        "--insecure_dp_seed", str(seed), "--seed", str(seed), "--logging_steps", str(max(1, cli.steps // 10)),
        "--output_dir", str(out / f"{name}_{seed}"), "--results_json", str(out / f"{name}_{seed}.json"),
    ]  # fmt: skip
    if mechanism == "bandmf":
        args += ["--num_bands", "auto"]
    if cli.per_device is not None:
        args += [
            "--per_device_train_batch_size",
            str(cli.per_device),
            "--gradient_accumulation_steps",
            str(cli.gas),
        ]
    if cli.smoke:
        args += ["--use_cpu", "--max_train_samples", "512", "--per_device_eval_batch_size", "64"]
    return args


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the accuracies by seed, their mean and standard deviation; the arms in order of mean accuracy."""
    arms: dict[str, Any] = {}
    for name, _, _ in ARMS:
        found = [r["accuracy"] for r in runs if r["arm"] == name]
        if found:
            spread = statistics.stdev(found) if len(found) > 1 else None
            arms[name] = {"accuracy": found, "mean": statistics.fmean(found), "std": spread}
    order = sorted(arms, key=lambda a: -arms[a]["mean"])
    return {"arms": arms, "ordering": " > ".join(order)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="write the GPU bundle into this folder and stop")
    parser.add_argument("--from_bundle", type=Path, help="run from a bundle (on the GPU machine)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--per_device", type=int, default=512, help="micro-batch (None: the recipe's)")
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation steps with --per_device")
    parser.add_argument("--budget_s", type=float, default=520.0, help="start no seed's arms after this")
    parser.add_argument("--smoke", action="store_true", help="a few steps on CPU")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    cli = parser.parse_args(argv)
    if cli.bundle is not None:
        sizes = make_bundle(cli.bundle)
        print(f"bundle: {sum(sizes.values()):.1f} MB in {cli.bundle}")
        return {"bundle_mb": sizes}
    if cli.smoke:
        cli.steps, cli.per_device, cli.gas = 4, 64, 1
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="stp_study_") as scratch:
        work = Path(scratch)
        if cli.from_bundle is not None:
            model = str(float32_copy(cli.from_bundle / "minilm-fp16", work / "minilm"))
            data = str(cli.from_bundle / "SST-2")
        else:
            model, data = default_minilm_path(), str(shared_data_dir() / "glue" / "SST-2")
        for seed in cli.seeds:
            if time.perf_counter() - start > cli.budget_s:
                print(f"budget of {cli.budget_s:.0f} s spent: seed {seed} and later not run", flush=True)
                break
            for arm in ARMS:
                began = time.perf_counter()
                _, record = glue.run(arm_args(arm, seed, cli, model, data, work))
                runs.append(
                    {
                        "arm": arm[0],
                        "seed": seed,
                        "accuracy": record["accuracy"],
                        "epsilon": record["epsilon"],
                        "noise_multiplier": record["noise_multiplier"],
                        "seconds": time.perf_counter() - began,
                    }
                )
                print(f"{arm[0]} seed {seed}: dev accuracy {record['accuracy']:.4f}", flush=True)
    commit, dirty = _timing.git_state(_REPO_ROOT)
    result = {
        "what": "SST-2 dev accuracy, MiniLM (recipes/glue.py defaults otherwise), epsilon 8, paired seeds",
        "git_commit": commit,
        "hf_dp_dirty": dirty,
        "steps": cli.steps,
        "per_device_train_batch_size": cli.per_device,
        "gradient_accumulation_steps": cli.gas,
        "smoke": cli.smoke,
        "seconds": time.perf_counter() - start,
        "runs": runs,
        **summary(runs),
    }
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    cli.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ordering: {result['ordering']}; wrote {cli.out}")
    return result


if __name__ == "__main__":
    main()
