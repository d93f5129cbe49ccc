"""What the call rules of trained MoE layers (hf_dp/clipping/experts.py for fused experts, one_linear.py for routers)
save over the torch.func fallback: a small Mixtral (2 layers, d 128, 8 experts of width 256, top-2, B 8, T 128,
fp32, one thread), one steady-state book-keeping DP step with the call rules and with them switched off (both on
the fallback, vmapped over rows), and the non-private step, interleaved; and the floats each keeps per micro-batch
for the experts' per-example gradients (the fallback: every row's gradient of all experts' weights; the rule: each
routed pair's two factor pairs).

    .venv/bin/python benchmarks/moe_experts.py --out benchmarks/results/moe_experts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
sys.path[:] = [_REPO_ROOT] + [p for p in sys.path if p != _REPO_ROOT]

import torch  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

from hf_dp.backend import Backend  # noqa: E402
from hf_dp.clipping import rules  # noqa: E402
from hf_dp.clipping.engine import ClippingEngine  # noqa: E402
from hf_dp.clipping.pipeline import clipped_step  # noqa: E402
from hf_dp.clipping.plan import StepPlan  # noqa: E402
from hf_dp.losses import per_example_loss  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "moe_experts.json"
SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_local_experts": 8, "num_experts_per_tok": 2}
BATCH, SEQ, LAYERS = 8, 128, 2


def measure(rounds: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = MixtralConfig(
        vocab_size=512, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, **SIZES
    )
    model = MixtralForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    step = clipped_step(ClippingEngine(model), model, Backend())
    mask = torch.ones(BATCH)
    call_rule_for = rules.call_rule_for

    def private() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step.run(lambda module: per_example_loss(module, batch), mask, StepPlan(1.0), model)
        seconds = time.perf_counter() - start
        step.check_untouched()
        return seconds

    def non_private() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        per_example_loss(model, batch).sum().backward()
        return time.perf_counter() - start

    private()  # the checked first step, with the rule
    seconds: dict[str, list[float]] = {"non_private": [], "rule": [], "fallback": []}
    try:
        for _ in range(rounds):
            for label in seconds:
                rules.call_rule_for = call_rule_for if label == "rule" else (lambda module: None)
                seconds[label].append(non_private() if label == "non_private" else private())
    finally:
        rules.call_rule_for = call_rule_for
    step.engine.remove_hooks()
    median = {label: statistics.median(times) for label, times in seconds.items()}
    experts = model.model.layers[0].mlp.experts
    weights = sum(p.numel() for p in experts.parameters())
    up, down = experts.gate_up_proj.shape[1], experts.down_proj.shape[1]
    pairs = BATCH * SEQ * SIZES["num_experts_per_tok"]
    return {
        "shape": {**SIZES, "batch": BATCH, "seq": SEQ, "layers": LAYERS, "dtype": "float32", "threads": 1},
        "rounds": rounds,
        "median_seconds": median,
        "rule_vs_non_private": median["rule"] / median["non_private"],
        "fallback_vs_non_private": median["fallback"] / median["non_private"],
        "fallback_vs_rule": median["fallback"] / median["rule"],
        # per experts layer and micro-batch: the fallback's per-row gradients; the rule's (δ, x) and (∂y, a) per pair
        "floats_per_layer": {
            "fallback": BATCH * SEQ * weights,
            "rule": pairs * (up + config.hidden_size + down + SIZES["intermediate_size"]),
        },
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    result = measure(args.rounds)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
