"""What one training step with activation checkpointing costs a device, counted on CPU without timing noise.

Three counts of the same step, by torch dispatch modes: the multiply-adds of the matrix products (torch's
``FlopCounterMode``: mm, addmm, bmm, attention, forward and backward, recomputation included), the bytes every
other operator reads and writes (its tensor inputs and outputs; views move none, and a factory its output only),
which is what the memory-bound elementwise kernels of a device stream, the number of those operator calls
(kernel launches), and the host reads of a tensor value (``.item()``, ``bool(t)``: each one a device
synchronisation). Variants: the stock ``transformers.Trainer`` step, ``DPTrainer``'s (``dp``: the weighted pass
runs the checkpointed layers one by one, hf_dp/clipping/layerwise.py) and the same with the layers
back-propagated as one chain (``dp_chained``, replay.py). A Llama of benchmarks/llm_memory.py's kind (GQA, untied
head, random weights) on B random sequences of T tokens, fp32, full fine-tuning, AdamW; each variant takes its
first step (DP's checks), then one counted step. Per token, with the ratios to the stock step: the floors the
time bar meets on a device where GEMMs, or memory traffic, dominate.

    .venv/bin/python benchmarks/step_flops.py --out benchmarks/results/step_flops.json
    .venv/bin/python benchmarks/step_flops.py --hidden 2048 --intermediate 5632 --heads 16 --kv-heads 4 \
        --seq 256 --batch 1 --out /tmp/step_flops_2048.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
sys.path[:] = [_REPO_ROOT] + [p for p in sys.path if p != _REPO_ROOT]  # before Opacus' own ``benchmarks``

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from benchmarks import llm_memory  # noqa: E402

VARIANTS = ("stock", "dp", "dp_chained")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "step_flops.json"


# operators that read no tensor input's data (their bytes are their output's)
_FACTORIES = {"empty", "empty_like", "empty_strided", "new_empty", "zeros", "zeros_like", "new_zeros", "ones"}
_FACTORIES.update(
    ("ones_like", "new_ones", "full", "full_like", "new_full", "arange", "randn", "rand", "normal")
)
_HOST_READ = torch.ops.aten._local_scalar_dense.default
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default  # a view its schema does not mark as one
# operators whose output size depends on tensor values: on a device each waits for the device like a host read
_SIZED_BY_VALUES = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}


def _sized_by_values(func, args: tuple, kwargs: dict) -> bool:
    """A value-sized operator, boolean-mask indexing, or ``repeat_interleave`` of counts without ``output_size``."""
    name = func.overloadpacket.__name__
    if name in _SIZED_BY_VALUES:
        return True
    if name in ("index", "index_put", "index_put_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


def _python_stack() -> list[str]:
    """The caller's frames as ``file:line in function``, without torch's own and this module's."""
    frames = traceback.extract_stack()[:-2]
    return [
        f"{Path(f.filename).name}:{f.lineno} in {f.name}"
        for f in frames
        if "/torch/" not in f.filename and not f.filename.endswith("step_flops.py")
    ]


def _bytes(tensors: list) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Traffic(TorchDispatchMode):
    """Every operator but the matrix products ``products`` counts: bytes read and written (none for a view; a
    factory's output only), calls, host reads of a tensor value, and operators whose output size depends on tensor
    values (``value_sized``: boolean-mask indexing, ``nonzero``; each a device synchronisation too); by operator
    name. With ``stacks`` each host read also records the Python stack that asked for it (``host_read_stacks``,
    innermost frame last), and each value-sized operator its stack (``value_sized_stacks``). With ``ops`` each
    counted call records its operator's name and stack (``call_stacks``)."""

    def __init__(self, products: set, stacks: bool = False, ops: bool = False) -> None:
        super().__init__()
        self.products = products
        self.bytes: dict[str, int] = {}
        self.calls = 0
        self.host_reads = 0
        self.stacks = stacks
        self.host_read_stacks: list[list[str]] = []
        self.value_sized = 0
        self.value_sized_stacks: list[list[str]] = []
        self.ops = ops
        self.call_stacks: list[tuple[str, list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _HOST_READ:
            self.host_reads += 1
            if self.stacks:
                self.host_read_stacks.append(_python_stack())
        elif _sized_by_values(func, args, kwargs or {}):
            self.value_sized += 1
            if self.stacks:
                self.value_sized_stacks.append(_python_stack())
        view = func is _UNSAFE_VIEW or any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        )
        if view or func.overloadpacket in self.products:
            return out
        name = func.overloadpacket.__name__
        moved = _bytes(tree_leaves(out)) + (0 if name in _FACTORIES else _bytes(tree_leaves((args, kwargs))))
        self.bytes[name] = self.bytes.get(name, 0) + moved
        self.calls += 1
        if self.ops:
            self.call_stacks.append((name, _python_stack()))
        return out


def count(name: str, setting: llm_memory.Setting, rows: list[dict]) -> dict[str, Any]:
    """One variant: built, its first step taken, then one step counted: multiply-adds per token by operator, the
    other operators' bytes per token (the largest by operator), their calls and the host reads."""
    variant = llm_memory.build_variant(name, setting, rows, "cpu")
    if variant.error:
        return {"error": variant.error}
    variant.step()
    counter = FlopCounterMode(display=False)
    traffic = Traffic(set(counter.flop_registry))
    with counter, traffic:
        variant.step()
    tokens = setting.batch * setting.seq
    by_op = {str(op): flops / 2 / tokens for op, flops in counter.get_flop_counts()["Global"].items()}
    largest = sorted(traffic.bytes.items(), key=lambda item: -item[1])[:12]
    result: dict[str, Any] = {
        "macs_per_token": counter.get_total_flops() / 2 / tokens,
        "by_op": by_op,
        "other_bytes_per_token": sum(traffic.bytes.values()) / tokens,
        "other_bytes_by_op": {op: moved / tokens for op, moved in largest},
        "other_calls": traffic.calls,
        "host_reads": traffic.host_reads,
    }
    result |= {key: variant.info.get(key) for key in ("tail_layers", "layerwise") if key in variant.info}
    return result


def markdown(result: dict[str, Any]) -> str:
    s = result["setting"]
    shape = s["shape"]
    lines = [
        "# What one checkpointed step costs a device (`benchmarks/step_flops.py`)",
        "",
        f"Llama {shape['layers']} × {shape['hidden']} (intermediate {shape['intermediate']}, {shape['heads']} heads, "
        f"{shape['kv_heads']} KV heads, vocabulary {shape['vocab']}), B {s['batch']}, T {s['seq']}, fp32, full "
        "fine-tuning with activation checkpointing; one step after the first, counted by torch dispatch modes: the "
        "matrix products' multiply-adds (FlopCounterMode), the other operators' bytes read and written, their calls, "
        "and the host reads of a tensor value (device synchronisations).",
        "",
        "| variant | multiply-adds per token | / stock | other operators' bytes per token | / stock | "
        "their calls | / stock | host reads | tail over layers | layer by layer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    stock = result["variants"]["stock"]
    for name, v in result["variants"].items():
        if "error" in v:
            lines.append(f"| {name} | error: {v['error'].splitlines()[0]} | | | | | | | | |")
            continue
        macs, moved, calls = v["macs_per_token"], v["other_bytes_per_token"], v["other_calls"]
        lines.append(
            f"| {name} | {macs / 1e6:.1f}M | {macs / stock['macs_per_token']:.3f} | {moved / 1e3:.1f} kB | "
            f"{moved / stock['other_bytes_per_token']:.3f} | {calls} | {calls / stock['other_calls']:.2f} | "
            f"{v['host_reads']} | {v.get('tail_layers', '-')} | {v.get('layerwise', '-')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = llm_memory.Shape()
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(default, name))
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    shape = llm_memory.Shape(
        **{k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")}
    )
    setting = llm_memory.Setting("full", "fp32", True, args.seq, args.batch, shape)
    rows = llm_memory.make_rows(setting)
    result: dict[str, Any] = {
        "benchmark": "step_flops",
        "setting": {"shape": asdict(shape), "seq": args.seq, "batch": args.batch},
        "variants": {name: count(name, setting, rows) for name in VARIANTS},
        "environment": llm_memory.environment("cpu"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
