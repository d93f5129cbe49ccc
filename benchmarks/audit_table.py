"""The README's audit table: ``python -m hf_dp.audit`` for every update rule and backend, and for injected bugs.

Every row is one command a user could run (printed in the results file): a GPT-2-family model, the same DP
settings (σ = 1, B̄ = 16 over 16 examples, so q = 16/17 with the canary: the audit's strongest setting; C = 1,
δ = 1e-5), the step audit with ``--trials`` trials per world;
one process runs the one-run audit too (1000 canaries, the 100 planned steps). The bug rows run the same command
with one fault injected into hf_dp (``--inject``): the audit must flag them, and must flag nothing else.

    python benchmarks/audit_table.py [--trials 2000] [--out benchmarks/results/audit]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_dp.audit.faults import fault
from hf_dp.optim.registry import scaled_geometry, shifted_evaluations

REPO = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("sgd", "adam", "adamw", "adam_bc", "stp", "dp2", "disk", "doppler")
BUGS = {  # name in the table → hf_dp.audit.faults
    "no noise": "no_noise",
    "clipping skipped": "no_clipping",
    "noise halved": "half_noise",
    "canary in every batch (q < 1 claimed)": "always_sampled",
}
COMMON = [
    "--model_type", "gpt2", "--num_examples", "16", "--noise_multiplier", "1.0", "--per_sample_max_grad_norm",
    "1.0", "--target_delta", "1e-5", "--learning_rate", "1e-3", "--max_steps", "100", "--use_cpu",
    "--report_to", "none",
]  # fmt: skip


def command(launcher: str, optimizer: str, trials: int, audit_dir: str, bug: str | None) -> list[str]:
    per_device = "8" if launcher == "single" else "4"  # B̄ = 16 either way
    flags = [
        *COMMON, "--dp_optimizer", optimizer, "--trials", str(trials), "--audit_dir", audit_dir,
        "--output_dir", f"{audit_dir}/out", "--per_device_train_batch_size", per_device,
        "--gradient_accumulation_steps", "2", "--audit", "both" if launcher == "single" else "step",
    ]  # fmt: skip
    if bug == "always_sampled":
        flags += ["--num_examples", "32"]  # q ≈ 1/2 claimed, so that drawing the canary every time is a lie
    if bug:
        return [sys.executable, __file__, "--inject", bug, "--", *flags]
    if launcher == "single":
        return [sys.executable, "-m", "hf_dp.audit", *flags]
    config = {"ddp": "ddp.yaml", "zero2": "deepspeed_zero2.yaml"}[launcher]
    accelerate = str(Path(sys.executable).parent / "accelerate")
    return [accelerate, "launch", "--config_file", f"recipes/configs/{config}", "-m", "hf_dp.audit", *flags]


def run(launcher: str, optimizer: str, trials: int, bug: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as audit_dir:
        cmd = command(launcher, optimizer, trials, audit_dir, bug)
        env = {**os.environ, "OMP_NUM_THREADS": "1" if launcher != "single" else "2", "DS_ACCELERATOR": "cpu"}
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        report = json.loads(Path(audit_dir, "audit.json").read_text())
    shown = " ".join(c for c in cmd if audit_dir not in c).replace(str(REPO) + "/", "")
    return {"launcher": launcher, "optimizer": optimizer, "bug": bug, "command": shown, "wall_seconds": seconds,
            **report}  # fmt: skip


def ratio(bound: float, reported: float) -> str:
    return f"{bound / reported:.2f}" if reported > 0 else "–"


def markdown(rows: list[dict], trials: int) -> str:
    lines = [
        f"Step audit: {trials} one-step trials per world, lower bound at 95% confidence at the δ where it is "
        "most telling, against the ε the accountant reports for one step at that δ; 'exact' is the median "
        "bound a perfect implementation gives with as many trials (simulated). One-run: 1000 canaries, 100 "
        "steps, against the run's reported ε at δ = 1e-5.",
        "",
        "| configuration | step audit: ε ≥ (δ) | reported ε | exact | bound / reported | one-run: ε ≥ "
        "| reported ε (run) | flagged | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        step = row["step"]
        name = row["bug"] and f"**bug: {row['bug_name']}** ({row['optimizer']})"
        name = name or f"{row['optimizer']}, {step['backend']} ×{step['world_size']}"
        one = row.get("one_run")
        one_cells = f"{one['epsilon']:.3f} | {one['claimed_epsilon']:.3f}" if one else "– | –"
        flagged = step["flagged"] or bool(one and one["flagged"])
        lines.append(
            f"| {name} | {step['epsilon_lower_bound']:.3f} ({step['delta']:g}) | "
            f"{step['reported_epsilon_one_step']:.3f} | {step['ideal_lower_bound']:.3f} | "
            f"{ratio(step['epsilon_lower_bound'], step['reported_epsilon_one_step'])} | {one_cells} | "
            f"{'**yes**' if flagged else 'no'} | {row['wall_seconds']:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "audit"))
    parser.add_argument("--only", choices=["single", "ddp", "zero2", "bugs"], nargs="*")
    cli = parser.parse_args()
    plan = [("single", opt, None) for opt in OPTIMIZERS]
    plan += [("ddp", opt, None) for opt in OPTIMIZERS]
    plan += [  # the rest is refused under DeepSpeed
        ("zero2", opt, None) for opt in OPTIMIZERS if not (scaled_geometry(opt) or shifted_evaluations(opt))
    ]
    plan += [("single", "sgd", bug) for bug in BUGS.values()]
    names = {v: k for k, v in BUGS.items()}
    rows = []
    for launcher, optimizer, bug in plan:
        if cli.only and (("bugs" if bug else launcher) not in cli.only):
            continue
        row = run(launcher, optimizer, cli.trials, bug)
        row["bug_name"] = names.get(bug)
        step = row["step"]
        print(
            f"{launcher:6} {optimizer:8} {bug or '':15} ε ≥ {step['epsilon_lower_bound']:.3f} "
            f"(reported {step['reported_epsilon_one_step']:.3f}) flagged={step['flagged']} {row['wall_seconds']:.0f}s",
            flush=True,
        )
        rows.append(row)
    Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{cli.out}.json").write_text(json.dumps({"trials": cli.trials, "rows": rows}, indent=2))
    Path(f"{cli.out}.md").write_text(markdown(rows, cli.trials))


if __name__ == "__main__":
    if "--inject" in sys.argv:  # python audit_table.py --inject BUG -- <hf_dp.audit flags>
        setattr(*fault(sys.argv[sys.argv.index("--inject") + 1]))
        from hf_dp.audit.__main__ import main as audit_main

        audit_main(sys.argv[sys.argv.index("--") + 1 :])
    else:
        main()
