"""torch.profiler table of one step of each named ``benchmarks/optimizer_cost.py`` variant, in the order given.

Shows where DiSK's two-evaluation step spends its time against its base (GEMMs, Gram ``bmm``s, element-wise
work). Run it in both orders: element-wise ops slow down for whichever variant runs second in the process.

    python benchmarks/disk_profile.py --layers 12 --batch 4 --order disk adamw > benchmarks/results/...txt
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks import optimizer_cost  # noqa: E402  (sets the offline environment first)

# isort: split

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--order", nargs="+", choices=list(optimizer_cost.VARIANTS), default=["adamw", "disk"]
    )
    cli = parser.parse_args()
    cfg = optimizer_cost.Config(
        layers=cli.layers, width=768, heads=12, vocab=50257, batch=cli.batch, threads=1
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    base, batch = optimizer_cost.build_model(cfg), optimizer_cost.make_batch(cfg)
    for name in cli.order:
        variant = optimizer_cost.build_variant(name, cfg, base, batch)
        for _ in range(optimizer_cost.WARMUP_STEPS):
            variant.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            variant.step()
        print(f"===== {name}")
        print(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=40)
        )


if __name__ == "__main__":
    main()
