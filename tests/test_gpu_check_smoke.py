"""Smoke mode of benchmarks/gpu_check.py (tiny shapes on the CPU): every section is in the JSON, every exactness
case is within the tolerance a DP correctness test states, and every performance cell ran or says why not.

The tolerances are the script's ``TOLERANCE``: fp32 1e-4 (a float32 step against the float64 brute force; measured
~3e-7 here), fp16 5e-3 (tests/test_fp16.py allows 2e-3 on CPU, measured 3-6e-4; measured 6-7e-4 here), bf16 5e-2
(tests/test_mixed_precision.py allows 2e-2 with bf16 weights, measured 0.56%; measured 0.5-0.7% here).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark


def _finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path: Path) -> None:
    gpu_check = load_benchmark("gpu_check")
    out = tmp_path / "gpu_check.json"
    returned = gpu_check.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned, default=str))
    assert out.with_suffix(".md").read_text().startswith("# gpu_check (smoke)")

    assert result["mode"] == "smoke" and result["finished"] is True
    for section in ("environment", "exactness", "performance", "qlora", "profile"):
        assert result[section]["error"] is None, (section, result[section]["error"])
    assert result["errors"] == []
    env = result["environment"]
    assert (
        env["device"] == "cpu" and {"torch", "transformers", "peft", "opacus", "bitsandbytes"} <= env.keys()
    )

    # exactness: every case ran, with clipping active, within its precision's tolerance at both steps
    cases = result["exactness"]["cases"]
    assert set(cases) == {
        f"{tuning}-{precision}-{'ckpt' if ckpt else 'nockpt'}"
        for precision, ckpt, tuning in gpu_check.EXACTNESS_CASES
    }
    assert gpu_check.TOLERANCE == {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-3}
    wide = result["exactness"]["wide_factors"]
    assert wide["tolerance"] == 1e-5
    assert all(
        wide[dtype]["within_tolerance"] and wide[dtype]["output_dtype"] == "float32"
        for dtype in ("bfloat16", "float16")
    )
    for name, case in cases.items():
        assert case["error"] is None, (name, case["error"])
        assert len(case["relative_error_per_step"]) == 2
        assert all(
            0 <= e <= gpu_check.TOLERANCE[case["precision"]] for e in case["relative_error_per_step"]
        ), (
            name,
            case["relative_error_per_step"],
        )
        assert case["within_tolerance"] is True
        assert case["checkpointing_active"] == case["checkpointing"]
        assert max(case["per_example_norms"]) > case["max_norm"] > 0  # every example clipped
        if case["precision"] != "fp32":  # autocast did run the MLP in the low precision
            assert case["mlp_output_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[case["precision"]]
    assert cases["full-fp16-nockpt"]["fp16_loss_scale"] > 1

    # performance: full and LoRA, checkpointing on and off; stock and dp always run; opacus ran or says why
    settings = result["performance"]["settings"]
    assert {(s["setting"]["tuning"], s["setting"]["checkpointing"]) for s in settings.values()} == {
        ("full", True),
        ("lora", True),
        ("full", False),
        ("lora", False),
    }
    for name, setting in settings.items():
        assert "error" not in setting and "skipped" not in setting, (name, setting)
        variants = setting["variants"]
        for variant in ("stock", "dp", "dp_chained", "dp_groupwise"):
            cell = variants[variant]
            assert cell["error"] is None, (name, variant, cell["error"])
            assert len(cell["times_s"]) == 2 and all(_finite_positive(t) for t in cell["times_s"])
            assert _finite_positive(cell["median_s"]) and math.isfinite(cell["first_loss"])
            assert cell["peak_mb"] is None  # memory is measured on CUDA only
            assert cell["checkpointing_active"] == setting["setting"]["checkpointing"]
            assert cell["mlp_output_dtype"] == "bfloat16"
        # what the first step's checks left on, and how often a layer runs a step: the stock step's forward (and
        # recomputation); DP with checkpointing skips the tail and runs the layers one by one (dp) or replays them
        # as one chain (dp_chained): 3 runs, not 4; LoRA keeps its per-example gradients from the norm pass and
        # runs no weighted pass: 2, as the stock step
        checkpointing = setting["setting"]["checkpointing"]
        assert variants["stock"]["layer_runs_per_step"] == (2 if checkpointing else 1), name
        runs = 2 if setting["setting"]["tuning"] == "lora" else 3
        for variant in ("dp", "dp_chained"):
            flags = {
                key: variants[variant][key] for key in ("skips_tail", "layer_runs_per_step", "layerwise")
            }
            checkpointed = {"skips_tail": True, "layer_runs_per_step": runs, "layerwise": variant == "dp"}
            expected = (
                checkpointed
                if checkpointing
                else {"skips_tail": None, "layer_runs_per_step": 1, "layerwise": False}
            )
            assert flags == expected, (name, variant, flags)
        # the same seeded model and batch: the untrained loss agrees between the stock Trainer and DP
        assert abs(variants["stock"]["first_loss"] - variants["dp"]["first_loss"]) < 1e-3
        assert _finite_positive(setting["ratios"]["dp_vs_stock"]["time_paired_median"])
        assert _finite_positive(setting["ratios"]["dp_groupwise_vs_stock"]["time_paired_median"])
        # group-wise: one forward a step (and the recomputation under checkpointing), no weighted pass
        assert variants["dp_groupwise"]["layer_runs_per_step"] == (2 if checkpointing else 1), name
        assert "opacus" in variants or "opacus" in setting["skipped_variants"]
        assert isinstance(setting.get("dp_privacy_report"), dict)

    # QLoRA: ran (bitsandbytes importable, with a working CPU backend) or skipped with the reason
    qlora = result["qlora"]
    if qlora["skipped"] is not None:
        assert "bitsandbytes" in qlora["skipped"] and qlora["settings"] == {}
    else:
        exact = qlora["exactness"]  # on the same model: a quantised base within 2x the float32 base's error
        assert list(exact) == list(gpu_check.QLORA_BASES) and exact["fp32"]["active"] < 1e-5, exact
        assert all(exact[kind]["within_2x_fp32"] is True for kind in ("nf4", "fp4", "int8")), exact
        outliers = qlora["int8_outliers"]  # LLM.int8's outlier columns mix examples: refused
        assert outliers["int8-outliers_change"] > 1e-3 and outliers["int8_change"] == 0.0, outliers
        assert outliers["refused"].startswith("QuantizedBaseError"), outliers
        assert len(qlora["settings"]) == 2
        for name, setting in qlora["settings"].items():
            for variant in ("stock", "dp"):
                assert setting["variants"][variant]["error"] is None, (name, variant)

    # profile: one step of each under the profiler; DP's time is split into its labelled phases
    profiled = result["profile"]["settings"]
    assert list(profiled) == ["full-bf16-ckpt-B2-T16"]
    for variant, step in profiled["full-bf16-ckpt-B2-T16"].items():
        assert "error" not in step, (variant, step)
        assert _finite_positive(step["wall_s"]) and step["top_ops"], (variant, step)
    phases = profiled["full-bf16-ckpt-B2-T16"]["dp"]["phases"]
    assert any(k.endswith("Norms") for k in phases) and any(k.endswith("Sum") for k in phases), phases
    assert "hf_dp.IntoGradients" in phases, phases  # the delivery, where the weighted pass's surrogate runs
    assert "hf_dp.noise" in phases and not profiled["full-bf16-ckpt-B2-T16"]["stock"]["phases"]
    assert profiled["full-bf16-ckpt-B2-T16"]["dp"]["skips_tail"] is True
    assert profiled["full-bf16-ckpt-B2-T16"]["dp"]["layerwise"] is True
    assert profiled["full-bf16-ckpt-B2-T16"]["dp"]["layer_runs_per_step"] == 3
    assert "tail skipped (reaching over 0 layers), layer by layer" in out.with_suffix(".md").read_text()
