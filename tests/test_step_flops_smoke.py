"""benchmarks/step_flops.py on a tiny Llama: the layer-by-layer weighted pass does exactly the chained pass's
multiply-adds less the input gradients of q, k, v, gate and up in every layer below the tail, plus the norm weights'
clipped sums (layerwise.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_flops.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("hf_dp_benchmark_step_flops", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_layer_by_layer_pass_skips_exactly_the_input_gradients_below_norms(tmp_path: Path) -> None:
    step_flops = _load_script()
    layers, hidden, intermediate, heads, kv_heads, seq = 2, 64, 176, 4, 2, 32
    shape = ["--layers", str(layers), "--hidden", str(hidden), "--intermediate", str(intermediate)]
    shape += [
        "--heads",
        str(heads),
        "--kv-heads",
        str(kv_heads),
        "--vocab",
        "1000",
        "--seq",
        "32",
        "--batch",
        "8",
    ]
    out = tmp_path / "flops.json"
    step_flops.main([*shape, "--out", str(out)])
    variants = json.loads(out.read_text())["variants"]
    stock, dp, chained = (variants[name] for name in ("stock", "dp", "dp_chained"))
    assert dp["layerwise"] is True and chained["layerwise"] is False
    assert dp["tail_layers"] == chained["tail_layers"] == 0  # B 8 of a layer's gradients exceed the budget
    head_dim = hidden // heads
    # per token and layer: q (d → heads·head_dim), k and v (d → kv_heads·head_dim), gate and up (d → intermediate)
    skipped = layers * hidden * (heads * head_dim + 2 * kv_heads * head_dim + 2 * intermediate)
    # and the two norm weights' Σ_i c_i G_i from their kept (B, d) gradients, B·d each, over B·T tokens
    norm_sums = 2 * layers * hidden / seq
    assert abs((chained["macs_per_token"] - dp["macs_per_token"]) - (skipped - norm_sums)) < 1e-9 * skipped
    assert stock["macs_per_token"] < dp["macs_per_token"]
    assert out.with_suffix(".md").read_text().count("| dp") == 2
