"""σ calibration: hf_dp's bracketed search against Opacus' bisection (``get_noise_multiplier``), same accountant,
same tolerance (hf_dp.accounting.calibrate_noise_multiplier), each from an empty RDP memo.

Both search for σ with target − tolerance ≤ ε(σ) ≤ target, tolerance = min(0.005, 0.002·target), over the same
PRV (or RDP) accountant; each ε evaluation costs 0.1–0.7 s with PRV, so the count of evaluations is the time. Every
case times both in interleaved rounds (benchmarks/_timing.py) and reports paired and min-time ratios, the σ each
returns and the ε that σ spends.

    .venv/bin/python benchmarks/calibration_speed.py     # writes benchmarks/results/calibration_speed.{json,md}
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
if (
    str(_REPO_ROOT) not in sys.path
):  # this checkout's hf_dp and benchmarks (Opacus installs a "benchmarks" too)
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks._timing import (  # noqa: E402  (first: it sets the offline environment)
    Variant,
    environment,
    fmt,
    interleaved,
    paired_ratios,
    timing_summary,
    write_result,
)

# isort: split

from hf_dp.accounting import (  # noqa: E402
    _CALIBRATION_TOLERANCE,
    _PRV_CALIBRATION_RELATIVE_ERROR,
    PrivacyAccountant,
    _cached_epsilon,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from hf_dp.prv_accountant import PRV_MECHANISM_KEY  # noqa: E402
from hf_dp.rdp import RDP_ORDERS, rdp_of_one_step  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# (accountant, target ε, δ, q, steps): the trainer tests' shapes, a typical fine-tune, a tight and a loose budget
CASES = [
    ("prv", 3.0, 32**-1.1, 0.25, 6),
    ("prv", 4.0, 64**-1.1, 0.25, 3),
    ("prv", 8.0, 1e-5, 0.01, 1000),
    ("prv", 1.0, 1e-5, 0.01, 1000),
    ("prv", 30.0, 1e-5, 0.5, 10),
    ("rdp", 8.0, 1e-5, 0.01, 1000),
    ("rdp", 3.0, 1e-6, 0.1, 100),
]


def opacus_sigma(accountant: str, target: float, delta: float, q: float, steps: int) -> float:
    """Opacus' bisection over the same accountant and tolerance that hf_dp's search uses."""
    from opacus.accountants.utils import get_noise_multiplier

    if accountant == "rdp":
        kwargs = {"accountant": "rdp", "alphas": list(RDP_ORDERS)}
    else:
        kwargs = {
            "accountant": PRV_MECHANISM_KEY,
            "min_eps_error": _PRV_CALIBRATION_RELATIVE_ERROR * target,
            "too_large": "inf",
        }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_noise_multiplier(
            target_epsilon=target,
            target_delta=delta,
            sample_rate=q,
            steps=steps,
            epsilon_tolerance=min(_CALIBRATION_TOLERANCE, 0.002 * target),
            **kwargs,
        )


def cold(search: Callable[[], float]) -> Callable[[], float]:
    """``search`` from an empty RDP memo (hf_dp.rdp memoises each (σ, q)'s RDP vector): every round then
    pays for its evaluations as a fresh run's calibration does."""

    def run() -> float:
        rdp_of_one_step.cache_clear()
        return search()

    return run


def logged_epsilons(forget: bool) -> float:
    """A run's ε after each of its 20 steps (a log line each; the main job's σ and q), ``forget``: the RDP memo
    emptied before every ε, so each pays for its RDP vectors as it did before the memo."""
    _cached_epsilon.cache_clear()
    rdp_of_one_step.cache_clear()
    accountant = PrivacyAccountant("prv", 1e-5)
    for _ in range(20):
        accountant.step(0.44, 0.0156)
        if forget:
            rdp_of_one_step.cache_clear()
        epsilon = accountant.get_epsilon()
    return epsilon


def epsilons_at_deltas(forget: bool) -> float:
    """ε of one history at 4 values of δ (what the audit's bounds ask), ``forget`` as above."""
    rdp_of_one_step.cache_clear()
    epsilons = []
    for delta in (1e-5, 1e-3, 1e-2, 0.1):
        if forget:
            rdp_of_one_step.cache_clear()
        epsilons.append(compute_epsilon(1.0, 0.125, 10, delta))
    return epsilons[0]


def repeated_epsilons(rounds: int) -> list[dict]:
    """The memo against none, interleaved, on the two workloads."""
    rows = []
    for name, workload in (("20 logged ε", logged_epsilons), ("ε at 4 δ", epsilons_at_deltas)):
        variants = {
            "memo": Variant("memo", step=lambda w=workload: w(False)),
            "no_memo": Variant("no_memo", step=lambda w=workload: w(True)),
        }
        print(name, flush=True)
        interleaved(variants, rounds, warmup=1)
        rows.append(
            {
                "workload": name,
                "epsilon": {k: v.first_loss for k, v in variants.items()},
                "times": {k: timing_summary(v) for k, v in variants.items()},
                "memo_over_none": paired_ratios(variants["memo"].times, variants["no_memo"].times),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "calibration_speed.json")
    args = parser.parse_args(argv)
    rows = []
    for accountant, target, delta, q, steps in CASES:
        case = (target, delta, q, steps)
        variants = {
            "hf_dp": Variant(
                "hf_dp", step=cold(lambda c=case, a=accountant: calibrate_noise_multiplier(*c, a))
            ),
            "opacus": Variant("opacus", step=cold(lambda c=case, a=accountant: opacus_sigma(a, *c))),
        }
        print(f"{accountant} ε={target} δ={delta:.3g} q={q} steps={steps}", flush=True)
        interleaved(variants, args.rounds, warmup=1)
        sigmas = {name: variant.first_loss for name, variant in variants.items()}
        rows.append(
            {
                "accountant": accountant,
                "target_epsilon": target,
                "delta": delta,
                "sample_rate": q,
                "steps": steps,
                "sigma": sigmas,
                "epsilon_spent": {
                    name: compute_epsilon(sigma, q, steps, delta, accountant)
                    for name, sigma in sigmas.items()
                },
                "times": {name: timing_summary(variant) for name, variant in variants.items()},
                "hf_dp_over_opacus": paired_ratios(variants["hf_dp"].times, variants["opacus"].times),
            }
        )
    repeated = repeated_epsilons(args.rounds)
    result = {
        "environment": environment(),
        "rounds": args.rounds,
        "cases": rows,
        "repeated_epsilon": repeated,
    }
    write_result(args.out, result)
    lines = [
        "# σ calibration: hf_dp's bracketed search vs Opacus' bisection",
        "",
        f"`benchmarks/calibration_speed.py`, {args.rounds} interleaved rounds per case, {result['environment']['date']}.",
        "",
        "| accountant | ε | δ | q | steps | hf_dp s | Opacus s | ratio (paired) | ratio (min) | σ hf_dp | σ Opacus |"
        " ε spent hf_dp | ε spent Opacus |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = row["hf_dp_over_opacus"] or {}
        lines.append(
            f"| {row['accountant']} | {row['target_epsilon']:g} | {row['delta']:.3g} | {row['sample_rate']:g} | "
            f"{row['steps']} | {fmt(row['times']['hf_dp']['median_s'], '.2f')} | "
            f"{fmt(row['times']['opacus']['median_s'], '.2f')} | {fmt(ratio.get('paired_median'), '.2f')} | "
            f"{fmt(ratio.get('min_time'), '.2f')} | {row['sigma']['hf_dp']:.5f} | {row['sigma']['opacus']:.5f} | "
            f"{row['epsilon_spent']['hf_dp']:.4f} | {row['epsilon_spent']['opacus']:.4f} |"
        )
    lines += [
        "",
        "## Repeated ε: the RDP memo against none (emptied before every ε)",
        "",
        "| workload | memo s | no memo s | memo / none (paired) | (min) | ε (both) |",
        "|---|---|---|---|---|---|",
    ]
    for row in repeated:
        ratio = row["memo_over_none"] or {}
        lines.append(
            f"| {row['workload']} | {fmt(row['times']['memo']['median_s'], '.2f')} | "
            f"{fmt(row['times']['no_memo']['median_s'], '.2f')} | {fmt(ratio.get('paired_median'), '.2f')} | "
            f"{fmt(ratio.get('min_time'), '.2f')} | {row['epsilon']['memo']:.6f}, {row['epsilon']['no_memo']:.6f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
