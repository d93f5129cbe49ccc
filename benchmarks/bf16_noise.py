"""What drawing the Gaussian noise in bf16 would do, against hf_dp's float32 draw (docs/clipping.md, Low precision).

hf_dp draws the noise in float32, adds it to the float32 clipped sum and casts only the released ĝ (a rounding
of the released value: post-processing). This script measures the two effects of the alternative, a bf16 draw:

- the draw is quantised: the number of distinct values among ``--draws`` N(0, 1) samples, float32 vs bf16;
- noise added in bf16 to a bf16 coordinate g is absorbed: the share of releases g + z that equal g exactly,
  z ~ N(0, 1) drawn in bf16, for g = k·σ. Those coordinates are released without noise.

    .venv/bin/python benchmarks/bf16_noise.py            # writes benchmarks/results/bf16_noise.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bf16_noise.json"


def measure(draws: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(draws, generator=generator)
    rounded = z.bfloat16().float()
    absorbed = {}
    for multiple in (4, 16, 64, 256, 1024):
        g = torch.full((draws,), float(multiple)).bfloat16()
        noise = torch.randn(draws, generator=generator).bfloat16()
        absorbed[str(multiple)] = float(((g + noise) == g).float().mean())
    return {
        "draws": draws,
        "distinct_values": {"float32": int(z.unique().numel()), "bfloat16": int(rounded.unique().numel())},
        "rms_relative_rounding_of_a_draw": float(((rounded - z) / z).pow(2).mean().sqrt()),
        "share_of_bf16_releases_equal_to_g_for_g_equal_k_sigma": absorbed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=10_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    result = {"benchmark": "bf16_noise", "torch": torch.__version__, **measure(args.draws, args.seed)}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
