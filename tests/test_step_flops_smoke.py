"""benchmarks/step_flops.py on a tiny Llama: the layer-by-layer weighted pass does exactly the chained pass's
multiply-adds less the input gradients of q, k, v, gate and up in every layer below the tail, plus the norm weights'
clipped sums (layerwise.py); the other operators' traffic is counted too."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmark_scripts import load_benchmark


def test_the_layer_by_layer_pass_skips_exactly_the_input_gradients_below_norms(tmp_path: Path) -> None:
    step_flops = load_benchmark("step_flops")
    layers, hidden, intermediate, heads, kv_heads, seq = 2, 64, 176, 4, 2, 32
    sizes = {"layers": layers, "hidden": hidden, "intermediate": intermediate, "heads": heads}
    sizes |= {"kv-heads": kv_heads, "vocab": 1000, "seq": seq, "batch": 8}
    shape = [arg for name, value in sizes.items() for arg in (f"--{name}", str(value))]
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
    # the other operators' traffic: DP's passes stream more than the stock step, and the layer-by-layer pass less
    # than the chained one (the input gradients' elementwise work below the points goes too)
    assert stock["other_bytes_per_token"] < dp["other_bytes_per_token"] < chained["other_bytes_per_token"]
    assert stock["other_calls"] < dp["other_calls"] and stock["host_reads"] > 0
    assert out.with_suffix(".md").read_text().count("| dp") == 2
