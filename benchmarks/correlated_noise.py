"""DP-BandMF correlated noise against independent noise (DP-SGD) at equal ε, through ``DPTrainer`` on real data.

Two tasks (benchmarks/README.md has the protocol and the commands):

- ``mlm``: benchmarks/optimizers.py's ``mlm`` task (recipes/mlm.py's pipeline: BERT-Tiny from scratch on arXiv
  abstracts, held-out MLM loss), rows DP-Adam (``adam``) and scale-then-privatize Adam (``stp``), each with
  ``noise_mechanism="independent"`` and ``"bandmf"`` (``num_bands="auto"``), σ calibrated by the trainer for
  ``target_epsilon`` in both, paired by seed. The learning rate and STP's clip are the TUNED values of
  ``benchmarks/results/optimizers_mlm.json`` (no re-tuning).
- ``sst2``: ``recipes/glue.py --task_name sst2`` at the recipe's defaults, with and without
  ``--noise_mechanism bandmf --num_bands auto``; dev accuracy.

Every run uses 1 torch thread; ``--jobs`` runs that many at once, each in its own process.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # measure this checkout's hf_dp, whatever is installed
    sys.path.insert(0, str(_REPO_ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # every run is single-threaded; the workers inherit it
os.environ.setdefault("MKL_NUM_THREADS", "1")

from benchmarks import optimizers as opt  # noqa: E402  (sets the offline environment first)

# isort: split

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

MECHANISMS = ("independent", "bandmf")
MLM_ROWS = ("adam", "stp")
TUNED_FROM = opt.DEFAULT_OUT / "optimizers_mlm.json"
# The task's 50 steps may be too short for correlated noise to matter: when one probe run at 50 steps takes at
# most PROBE_LIMIT_S, every MLM run trains LONG_STEPS instead (the same in every arm).
PROBE_LIMIT_S = 60.0
LONG_STEPS = 100
# SST-2: a 20-step probe estimates a default-length run; over SST2_LIMIT_S it is shortened to fit SST2_FIT_S.
SST2_PROBE_STEPS = 20
SST2_LIMIT_S = 30 * 60.0
SST2_FIT_S = 25 * 60.0
QUICK_SST2 = [
    "--max_train_samples",
    "64",
    "--max_eval_samples",
    "32",
    "--per_device_train_batch_size",
    "16",
    "--gradient_accumulation_steps",
    "1",
    "--max_steps",
    "4",
]


def _quiet() -> None:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*(bos_token_id|not DIFFERENTIALLY|NOT differentially).*")


def _environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads_per_run": 1,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
    }


def _single_process() -> None:
    """Each worker runs one job at a time like a lone process: transformers' seeded collators (recipes/mlm.py's
    mask_once) refuse any process not named MainProcess unless it is a DataLoader worker."""
    multiprocessing.current_process().name = "MainProcess"


def _pool(jobs: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_single_process
    )


# ---- MLM --------------------------------------------------------------------------------------------

_TASKS: dict[str, opt.Task] = {}  # per process: the loaded task for a settings key


def _mlm_task(settings: opt.TaskSettings) -> opt.Task:
    key = json.dumps(asdict(settings), sort_keys=True)
    if key not in _TASKS:
        _TASKS[key] = opt.load_task(settings)
    return _TASKS[key]


def mlm_run(
    settings: opt.TaskSettings,
    hyper: opt.Hyper,
    row_name: str,
    mechanism: str,
    seed: int,
    accountant: str = "prv",
) -> dict:
    """benchmarks/optimizers.py's ``train_and_score`` for one (row, mechanism, seed), with σ calibrated by the
    trainer for ``target_epsilon`` (``num_bands="auto"`` needs it) instead of passed in."""
    _quiet()
    task = _mlm_task(settings)
    bands = {"noise_mechanism": "bandmf", "num_bands": "auto"} if mechanism == "bandmf" else {}
    privacy = {
        "noise_multiplier": None,
        "target_epsilon": task.settings.epsilon,
        "accountant": accountant,
        **bands,
    }
    record = opt.train_and_score(task, opt.ROWS[row_name], hyper, seed, "report", privacy_changes=privacy)
    record.update({"mechanism": mechanism, "steps_planned": task.settings.steps})
    print(
        f"  mlm {row_name:<5} {mechanism:<11} seed {seed}  b {record.get('num_bands', '-')}  "
        f"σ {opt._fmt(record.get('noise_multiplier'), '.4f')}  ε {opt._fmt(record.get('epsilon'), '.3f')}",
        flush=True,
    )
    return record


def load_tuned(quick: bool, settings: opt.TaskSettings) -> tuple[opt.Hyper, str]:
    """The tuned lr and STP clip of optimizers_mlm.json (quick: the toy grid's values, nothing tuned)."""
    if quick:
        return opt.Hyper(
            lr={"adam": settings.lr_grid["adam"][0]},
            stp_clip=settings.stp_clip_grid[0],
            dp2_lr_adaptive=settings.dp2_lr_adaptive_grid[0],
        ), "quick mode: the toy grid's values, not tuned"
    tuned_run = json.loads(TUNED_FROM.read_text())
    tuned = tuned_run["tuned"]
    source = (
        f"NOT re-tuned: lr and STP's C are the 'tuned' values of {TUNED_FROM.relative_to(_REPO_ROOT)} (tuned "
        f"there on {tuned_run['date']} with independent noise at {tuned_run['settings']['steps']} steps, on the "
        f"pipeline of that file: {tuned_run['description']})"
    )
    return opt.Hyper(**tuned), source


def summarise_mlm(runs: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for row in MLM_ROWS:
        for mechanism in MECHANISMS:
            mine = [r for r in runs if r["optimizer"] == row and r["mechanism"] == mechanism]
            ok = [r for r in mine if r["error"] is None]
            values = [r[metric] for r in ok]
            arms[f"{row}/{mechanism}"] = {
                "optimizer": row,
                "mechanism": mechanism,
                "mean": statistics.fmean(values) if values else None,
                "std": statistics.stdev(values) if len(values) > 1 else None,
                "n": len(values),
                "per_seed": {r["seed"]: r[metric] for r in ok},
                "num_bands": sorted({r["num_bands"] for r in ok}),
                "noise_multiplier": sorted({r["noise_multiplier"] for r in ok}),
                "epsilon": [r["epsilon"] for r in ok],
                "seconds_per_run": statistics.fmean(r["seconds"] for r in ok) if ok else None,
                "errors": [r["error"] for r in mine if r["error"]],
            }
    comparisons = []
    for row in MLM_ROWS:
        base, band = arms[f"{row}/independent"]["per_seed"], arms[f"{row}/bandmf"]["per_seed"]
        seeds = sorted(set(base) & set(band))
        diffs = {k: band[k] - base[k] for k in seeds}  # BandMF − independent: < 0 means BandMF is better
        values = list(diffs.values())
        comparisons.append(
            {
                "optimizer": row,
                "difference": "bandmf - independent (held-out MLM loss; negative: BandMF better)",
                "per_seed": diffs,
                "mean": statistics.fmean(values) if values else None,
                "std": statistics.stdev(values) if len(values) > 1 else None,
                "bandmf_better_on_seeds": f"{sum(d < 0 for d in values)}/{len(values)}",
                "verdict": verdict(values, higher_is_better=False),
            }
        )
    return {"arms": arms, "comparisons": comparisons}


def verdict(diffs: list[float], higher_is_better: bool) -> str:
    """Which ordering holds, and whether the mean paired difference is beyond 2 standard errors."""
    if not diffs:
        return "missing"
    mean = statistics.fmean(diffs)
    gain = mean if higher_is_better else -mean
    order = "BandMF better" if gain > 0 else ("tie" if gain == 0 else "BandMF worse")
    if len(diffs) < 2:
        return order + " (one seed: no spread)"
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    detail = f"|mean| {abs(mean):.4f} vs 2 SE {2 * se:.4f}"
    return order + (
        f" (within seed noise: {detail})" if abs(mean) <= 2 * se else f" (just beyond 2 SE: {detail})"
    )


def run_mlm(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    settings = replace((opt.QUICK if args.quick else opt.FULL)["mlm"], epsilon=args.epsilon)
    hyper, source = load_tuned(args.quick, settings)
    probe = None
    if args.mlm_steps == "auto" and not args.quick and args.mlm_probe:  # a probe run earlier
        probe = json.loads(args.mlm_probe.read_text())
        steps = LONG_STEPS if probe["error"] is None and probe["seconds"] <= PROBE_LIMIT_S else settings.steps
    elif args.mlm_steps == "auto" and not args.quick:
        print(f"MLM probe: adam/bandmf, seed {args.seeds[0]}, {settings.steps} steps", flush=True)
        probe = mlm_run(settings, hyper, "adam", "bandmf", args.seeds[0], args.accountant)
        steps = LONG_STEPS if probe["error"] is None and probe["seconds"] <= PROBE_LIMIT_S else settings.steps
        (args.out_dir / "correlated_noise_mlm_probe.json").write_text(json.dumps(probe, indent=2) + "\n")
    if probe is not None:
        probe["decision"] = (
            f"probe took {probe['seconds']:.0f} s at {settings.steps} steps "
            f"({'≤' if steps == LONG_STEPS else '>'} {PROBE_LIMIT_S:g} s): every MLM run trains {steps} steps"
        )
        print(probe["decision"], flush=True)
    else:
        steps = settings.steps if args.mlm_steps == "auto" else int(args.mlm_steps)
    default_steps = settings.steps
    settings = replace(settings, steps=steps)
    task = _mlm_task(settings)
    print(f"== mlm: {task.data_note}; {task.trainable} trainable parameters; {source}", flush=True)
    jobs = [(row, mech, seed) for seed in args.seeds for row in MLM_ROWS for mech in MECHANISMS]
    done: list[dict[str, Any]] = []
    if args.resume:  # runs recorded by an earlier invocation (its partial file) are kept, not rerun
        done = [r for r in json.loads(args.resume.read_text())["runs"] if r["error"] is None]
        kept = {(r["optimizer"], r["mechanism"], r["seed"]) for r in done}
        todo = [job for job in jobs if job not in kept]
        done = [r for r in done if (r["optimizer"], r["mechanism"], r["seed"]) in set(jobs)]
        jobs = [] if args.no_new_runs else todo
        print(f"resuming: {len(done)} runs kept from {args.resume}, {len(jobs)} to run", flush=True)
    if args.jobs > 1 and jobs:
        with _pool(args.jobs) as pool:
            futures = [pool.submit(mlm_run, settings, hyper, *job, args.accountant) for job in jobs]
            runs = list(done)
            # a partial file after every run, in case the job is cut short (--resume reads it)
            for future in as_completed(futures):
                runs.append(future.result())
                partial = {"partial": True, "settings": asdict(settings), "runs": runs}
                (args.out_dir / "correlated_noise_mlm.partial.json").write_text(
                    json.dumps(partial, indent=2) + "\n"
                )
        (args.out_dir / "correlated_noise_mlm.partial.json").unlink(missing_ok=True)
    else:
        runs = done + [mlm_run(settings, hyper, *job, args.accountant) for job in jobs]
    order = [(row, mech, seed) for seed in args.seeds for row in MLM_ROWS for mech in MECHANISMS]
    runs.sort(key=lambda r: order.index((r["optimizer"], r["mechanism"], r["seed"])))
    missing = [job for job in order if job not in {(r["optimizer"], r["mechanism"], r["seed"]) for r in runs}]
    result = {
        "benchmark": "correlated_noise",
        "task": "mlm",
        "description": task.data_note,
        "date": _dt.date.today().isoformat(),
        "quick": args.quick,
        "settings": asdict(settings),
        "task_default_steps": default_steps,
        "steps_probe": probe,
        "trainable_parameters": task.trainable,
        "metric": task.metric,
        "higher_is_better": False,
        "delta": task.delta,
        "target_epsilon": settings.epsilon,
        "accountant": args.accountant,
        "hyperparameters": {**asdict(hyper), "source": source},
        "untrained": task.score(task.build(args.seeds[0]), task.held_out["report"]),
        "seeds": list(args.seeds),
        "runs": runs,
        "not_run": [{"optimizer": o, "mechanism": m, "seed": k} for o, m, k in missing],
        "resumed_from": str(args.resume) if args.resume else None,
        "wall_seconds_note": "this invocation only: the kept runs' own times are their 'seconds'"
        if args.resume
        else "the whole invocation",
        "summary": summarise_mlm(runs, task.metric),
        "wall_seconds": time.perf_counter() - started,
        "environment": {**_environment(), "jobs": args.jobs},
    }
    return result


# ---- SST-2 ------------------------------------------------------------------------------------------


def glue_run(mechanism: str, extra: list[str], seed: int | None = None) -> dict[str, Any]:
    """One ``recipes/glue.py --task_name sst2`` run at its defaults plus ``extra``, in this process."""
    _quiet()
    from recipes import glue

    argv = ["--task_name", "sst2", *extra]
    if mechanism == "bandmf":
        argv += ["--noise_mechanism", "bandmf", "--num_bands", "auto"]
    if seed is not None:
        argv += ["--seed", str(seed)]
    record: dict[str, Any] = {"mechanism": mechanism, "argv": argv, "accuracy": None, "error": None}
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="hf_dp_correlated_noise_glue_") as tmp:
            trainer, result = glue.run([*argv, "--output_dir", tmp])
            report = trainer.privacy_report()
        record.update({k: v for k, v in result.items() if k != "settings"})
        record.update(
            {
                "noise_mechanism": report["noise_mechanism"],
                "num_bands": report["num_bands"],
                "accounting": report["accounting"],
                "seed": result["settings"]["training"]["seed"],
                "max_steps": result["settings"]["training"]["max_steps"],
            }
        )
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
        traceback.print_exc()
    record["seconds"] = time.perf_counter() - started
    print(
        f"  sst2 {mechanism:<11} steps {record.get('steps', '-')}  b {record.get('num_bands', '-')}  "
        f"σ {opt._fmt(record.get('noise_multiplier'), '.4f')}  ε {opt._fmt(record.get('epsilon'), '.3f')}  "
        f"dev acc {opt._fmt(record['accuracy'], '.4f')}  {record['seconds']:.0f}s  {record['error'] or ''}",
        flush=True,
    )
    return record


def run_sst2(args: argparse.Namespace) -> dict[str, Any]:
    from recipes import glue

    started = time.perf_counter()
    default_steps = glue.RECIPE_DEFAULTS["max_steps"]
    probe, extra = None, (list(QUICK_SST2) if args.quick else []) + ["--accountant", args.accountant]
    if args.quick:
        steps = int(QUICK_SST2[QUICK_SST2.index("--max_steps") + 1])
        note = "quick mode: toy sizes"
    elif args.sst2_max_steps == "auto":
        if args.sst2_probe:  # a probe run earlier (its record: train_seconds, seconds, steps)
            probe = json.loads(args.sst2_probe.read_text())
        else:
            print(f"SST-2 probe: BandMF, {SST2_PROBE_STEPS} steps", flush=True)
            probe = glue_run("bandmf", ["--max_steps", str(SST2_PROBE_STEPS)])
            (args.out_dir / "correlated_noise_sst2_probe.json").write_text(json.dumps(probe, indent=2) + "\n")
        per_step = probe["train_seconds"] / probe["steps"]
        overhead = probe["seconds"] - probe["train_seconds"]  # loading, tokenising, evaluating
        estimate = overhead + per_step * default_steps
        if estimate <= SST2_LIMIT_S:
            steps = default_steps
        else:
            steps = int((SST2_FIT_S - overhead) / per_step) // 10 * 10
        note = (
            f"a {probe['steps']}-step probe took {per_step:.2f} s/step + {overhead:.0f} s overhead on 1 thread: "
            f"a default {default_steps}-step run would take ~{estimate / 60:.0f} min"
        )
        probe["estimate_full_run_seconds"] = estimate
    else:
        steps, note = int(args.sst2_max_steps), "max_steps set by --sst2_max_steps"
    shortened = steps < default_steps
    if not args.quick:
        extra += ["--max_steps", str(steps)]
        note += (
            f"; SHORTENED to {steps} of the recipe's {default_steps} steps ({steps / default_steps:.0%}), "
            "the same in both arms"
            if shortened
            else f"; the recipe's default {default_steps} steps"
        )
    print(f"== sst2: {note}", flush=True)
    seeds = args.sst2_seeds or [None]
    jobs = [(mech, seed) for seed in seeds for mech in MECHANISMS]
    if args.jobs > 1:
        with _pool(args.jobs) as pool:
            futures = [pool.submit(glue_run, mech, extra, seed) for mech, seed in jobs]
            runs = [f.result() for f in futures]
    else:
        runs = [glue_run(mech, extra, seed) for mech, seed in jobs]
    arms = {}
    for mech in MECHANISMS:
        ok = [r for r in runs if r["mechanism"] == mech and r["error"] is None]
        values = [r["accuracy"] for r in ok]
        arms[mech] = {
            "mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values),
            "per_seed": {r["seed"]: r["accuracy"] for r in ok},
            "errors": [r["error"] for r in runs if r["mechanism"] == mech and r["error"]],
        }
    paired = sorted(set(arms["bandmf"]["per_seed"]) & set(arms["independent"]["per_seed"]))
    diffs = [arms["bandmf"]["per_seed"][k] - arms["independent"]["per_seed"][k] for k in paired]
    return {
        "benchmark": "correlated_noise",
        "task": "sst2",
        "description": "recipes/glue.py --task_name sst2 at its defaults (all-MiniLM-L6-v2, DP-BiTFiT, mean "
        "pooling, AdamW head 2e-2 / body 5e-3 linear decay, expected batch 512, ε = 8); metric: GLUE dev accuracy",
        "date": _dt.date.today().isoformat(),
        "quick": args.quick,
        "recipe_default_max_steps": default_steps,
        "max_steps": steps,
        "shortened": shortened,
        "steps_note": note,
        "steps_probe": probe,
        "metric": "accuracy",
        "higher_is_better": True,
        "target_epsilon": 8.0,
        "accountant": args.accountant,
        "runs": runs,
        "summary": {
            "arms": arms,
            "comparison": {
                "difference": "bandmf - independent (dev accuracy; positive: BandMF better)",
                "per_seed": dict(zip(paired, diffs, strict=True)),
                "mean": statistics.fmean(diffs) if diffs else None,
                "std": statistics.stdev(diffs) if len(diffs) > 1 else None,
                "verdict": verdict(diffs, higher_is_better=True),
                "note": "the recipe's noise and batches come from a secret key: the two arms are not paired "
                "noise draws, only the same seed for initialisation and data order",
            },
        },
        "wall_seconds": time.perf_counter() - started,
        "environment": {**_environment(), "jobs": args.jobs},
    }


# ---- the report --------------------------------------------------------------------------------------


def _pm(mean: float | None, std: float | None, spec: str = ".4f") -> str:
    return f"{opt._fmt(mean, spec)} ± {opt._fmt(std, spec.lstrip('+'))}"


def _values(values: list, spec: str) -> str:
    return ", ".join(opt._fmt(v, spec) for v in values) or "-"


def markdown_mlm(r: dict[str, Any]) -> list[str]:
    s = r["settings"]
    lines = [
        f"## MLM (arXiv, BERT-Tiny from scratch), ε = {s['epsilon']:g} ({r['date']})",
        "",
        f"{r['description']}. {s['steps']} steps (the task's default is {r['task_default_steps']}"
        + (f"; {r['steps_probe']['decision']}" if r["steps_probe"] else "")
        + f") of expected batch B̄ = {s['batch']}, N = {s['train_rows']}, δ = {opt._fmt(r['delta'], '.2e')}, "
        f"{r['trainable_parameters']} trainable parameters; σ calibrated by the trainer for ε = {s['epsilon']:g} "
        f"in every arm. {r['hyperparameters']['source']}: lr {r['hyperparameters']['lr']['adam']:g} (adam "
        f"family), STP C = {r['hyperparameters']['stp_clip']:g}, adam C = {s['clip']:g}. Metric: held-out MLM "
        f"loss (lower is better), mean ± sample std over seeds {r['seeds']}, paired by seed "
        f"(insecure_dp_seed); untrained {opt._fmt(r['untrained'], '.4f')}.",
        "",
        "| optimizer | noise | b | σ | ε spent | held-out MLM loss | n | per seed | s/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in r["summary"]["arms"].values():
        errors = f" errors: {arm['errors'][0]}" if arm["errors"] else ""
        lines.append(
            f"| {arm['optimizer']} | {arm['mechanism']} | {_values(arm['num_bands'], 'd')} | "
            f"{_values(arm['noise_multiplier'], '.4f')} | {_values(arm['epsilon'], '.3f')} | "
            f"{_pm(arm['mean'], arm['std'])} | {arm['n']} | {_values(list(arm['per_seed'].values()), '.4f')} | "
            f"{opt._fmt(arm['seconds_per_run'], '.0f')}{errors} |"
        )
    if r.get("not_run"):
        missing = ", ".join(f"{j['optimizer']}/{j['mechanism']} seed {j['seed']}" for j in r["not_run"])
        lines += ["", f"**Not run (out of time on the shared machine): {missing}.**"]
    lines += [
        "",
        "| optimizer | BandMF − independent (paired, per seed) | mean ± std | BandMF better on | verdict |",
        "|---|---|---|---|---|",
    ]
    for c in r["summary"]["comparisons"]:
        lines.append(
            f"| {c['optimizer']} | {_values(list(c['per_seed'].values()), '+.4f')} | "
            f"{_pm(c['mean'], c['std'], '+.4f')} | {c['bandmf_better_on_seeds']} | {c['verdict']} |"
        )
    return lines


def markdown_sst2(r: dict[str, Any]) -> list[str]:
    lines = [
        f"## SST-2 (recipes/glue.py), ε = {r['target_epsilon']:g} ({r['date']})",
        "",
        f"{r['description']}. {r['steps_note']}.",
        "",
        "| noise | seed | steps | b | σ | ε spent | dev accuracy | train s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in r["runs"]:
        lines.append(
            f"| {run['mechanism']} | {run.get('seed', '-')} | {run.get('steps', '-')} | {run.get('num_bands', '-')} | "
            f"{opt._fmt(run.get('noise_multiplier'), '.4f')} | {opt._fmt(run.get('epsilon'), '.3f')} | "
            f"{opt._fmt(run['accuracy'], '.4f')} | {opt._fmt(run.get('train_seconds'), '.0f')}"
            f"{' ' + run['error'] if run['error'] else ''} |"
        )
    c = r["summary"]["comparison"]
    lines += [
        "",
        f"BandMF − independent dev accuracy: {_pm(c['mean'], c['std'], '+.4f')} ({c['verdict']}; {c['note']}).",
    ]
    return lines


def write_markdown(out_dir: Path, results: dict[str, dict[str, Any]], conclusions: dict[str, str]) -> str:
    lines = ["# Correlated noise (DP-BandMF) vs independent noise (DP-SGD) at equal ε", ""]
    lines += [
        "Written by `benchmarks/correlated_noise.py` from `correlated_noise_mlm.json` and "
        '`correlated_noise_sst2.json` (every run, σ, b and ε are there). BandMF: `noise_mechanism="bandmf"`, '
        '`num_bands="auto"`, cyclic Poisson sampling, accounted as DP-SGD with ⌈n/b⌉ steps at p = b·B̄/N.',
        "",
    ]
    for task, render in (("mlm", markdown_mlm), ("sst2", markdown_sst2)):
        if task in results:
            lines += render(results[task])
            if conclusions.get(task):
                lines += ["", f"**Conclusion.** {conclusions[task]}"]
            lines.append("")
    text = "\n".join(lines)
    (out_dir / "correlated_noise.md").write_text(text)
    return text


def conclusion_mlm(r: dict[str, Any]) -> str:
    parts, arms = [], r["summary"]["arms"]
    for c in r["summary"]["comparisons"]:
        if c["mean"] is None:
            parts.append(f"{c['optimizer']}: no paired result")
            continue
        order = "lower (better)" if c["mean"] < 0 else "higher (worse)"
        parts.append(
            f"with {c['optimizer']}, BandMF's held-out loss is {order} than independent noise's by "
            f"{abs(c['mean']):.4f} on average (paired difference {c['mean']:+.4f} ± {opt._fmt(c['std'], '.4f')} "
            f"over {len(c['per_seed'])} seed{'s' if len(c['per_seed']) != 1 else ''}, BandMF better on {c['bandmf_better_on_seeds']}: {c['verdict']}; "
            f"the arms' own seed std: {opt._fmt(arms[c['optimizer'] + '/independent']['std'], '.4f')} "
            f"independent, {opt._fmt(arms[c['optimizer'] + '/bandmf']['std'], '.4f')} BandMF)"
        )
    text = "; ".join(parts) + "."
    return text[:1].upper() + text[1:]


def conclusion_sst2(r: dict[str, Any]) -> str:
    c, arms = r["summary"]["comparison"], r["summary"]["arms"]
    if c["mean"] is None:
        return "no paired result."
    order = "higher (better)" if c["mean"] > 0 else ("equal" if c["mean"] == 0 else "lower (worse)")
    rows = r["runs"][0].get("eval_rows") or 872
    acc = statistics.fmean(a["mean"] for a in arms.values())
    se = math.sqrt(acc * (1 - acc) / rows)  # the dev set's own sampling error of one accuracy
    spread = (
        f"± {c['std']:.4f} over {len(c['per_seed'])} seeds"
        if c["std"] is not None
        else f"one seed per arm, so there is no seed spread; the binomial standard error of one accuracy on "
        f"{rows} dev rows is {se:.4f}, {se * math.sqrt(2):.4f} for the difference of two independent runs"
    )
    within = abs(c["mean"]) <= 2 * se * math.sqrt(2)
    judgement = " The gap is within that error: no ordering can be claimed from this run." if within else ""
    short = (
        f" at {r['max_steps']} of the recipe's {r['recipe_default_max_steps']} steps"
        if r["shortened"]
        else ""
    )
    return (
        f"BandMF's dev accuracy ({opt._fmt(arms['bandmf']['mean'], '.4f')}) is {order} than independent "
        f"noise's ({opt._fmt(arms['independent']['mean'], '.4f')}) by {abs(c['mean']):.4f}{short} ({spread})."
        + judgement
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["mlm", "sst2", "both"], default="both")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="MLM seeds")
    parser.add_argument(
        "--sst2_seeds", nargs="*", type=int, default=[], help="SST-2 seeds (none: the recipe's default seed)"
    )
    parser.add_argument("--epsilon", type=float, default=8.0, help="MLM target ε (SST-2: the recipe's 8)")
    parser.add_argument(
        "--mlm_steps",
        default="auto",
        help=f"'auto': {LONG_STEPS} if a 50-step probe run takes ≤ 60 s, else 50",
    )
    parser.add_argument(
        "--sst2_max_steps",
        default="auto",
        help="'auto': a 20-step probe; the recipe's default if a run fits 30 min, else what fits ~25 min",
    )
    parser.add_argument(
        "--sst2_probe",
        type=Path,
        default=None,
        help="the record of an earlier probe run, instead of running one",
    )
    parser.add_argument(
        "--mlm_probe",
        type=Path,
        default=None,
        help="the record of an earlier MLM probe run, instead of running one",
    )
    parser.add_argument("--resume", type=Path, default=None, help="keep the runs of this (partial) MLM JSON")
    parser.add_argument(
        "--no_new_runs",
        action="store_true",
        help="with --resume: only summarise the kept runs (the rest: not_run)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own 1-thread process")
    parser.add_argument(
        "--accountant", choices=["prv", "rdp"], default=None, help="default: prv (quick: rdp)"
    )
    parser.add_argument("--quick", action="store_true", help="toy sizes, for the smoke test")
    parser.add_argument(
        "--render_only", action="store_true", help="rewrite correlated_noise.md from the JSONs"
    )
    parser.add_argument("--out_dir", type=Path, default=opt.DEFAULT_OUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse_args(argv)
    args.accountant = args.accountant or ("rdp" if args.quick else "prv")  # rdp calibrates in well under 1 s
    _quiet()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tasks = [] if args.render_only else ["mlm", "sst2"] if args.task == "both" else [args.task]
    results: dict[str, dict[str, Any]] = {}
    for task in tasks:
        results[task] = (run_mlm if task == "mlm" else run_sst2)(args)
        path = args.out_dir / f"correlated_noise_{task}.json"
        path.write_text(json.dumps(results[task], indent=2, default=str) + "\n")
    # the markdown covers both tasks: a task not run now is read back from its JSON, when there is one
    for task in ("mlm", "sst2"):
        path = args.out_dir / f"correlated_noise_{task}.json"
        if task not in results and path.is_file():
            results[task] = json.loads(path.read_text())
    conclusions = {
        task: (conclusion_mlm if task == "mlm" else conclusion_sst2)(result)
        for task, result in results.items()
    }
    print(write_markdown(args.out_dir, results, conclusions), flush=True)
    return results


if __name__ == "__main__":
    main()
