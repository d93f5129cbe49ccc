"""Speed and memory of the per-example token loss against ``F.cross_entropy`` on the same logits.

Forward and backward of Σ_i L_i for B sequences of T positions over a vocabulary of V (random logits, every
position labelled, the causal shift): ``ours`` is ``hf_dp.losses.token_loss_per_example`` (lse per row, the
gradient written in place, ``_TokenCrossEntropy``); ``f_cross_entropy`` is one ``F.cross_entropy`` over all
rows (what HF's loss does, without its float32 copy), which keeps a log-softmax of all B·T·V logits. Timed in
interleaved rounds (benchmarks/_timing.py). Memory: the bytes the autograd graph saves beyond the logits.

    .venv/bin/python benchmarks/token_loss.py            # writes benchmarks/results/token_loss.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import _timing  # noqa: E402  (sets the offline environment first)
from benchmarks._timing import Variant  # noqa: E402

# isort: split

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hf_dp.losses import IGNORE_INDEX, shifted_labels, token_loss_per_example  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "token_loss.json"


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    targets = shifted_labels(labels)
    tokens = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return tokens.view(targets.shape).sum(dim=1) / (targets != IGNORE_INDEX).sum(dim=1)


LOSSES = {
    "ours": lambda logits, labels: token_loss_per_example(logits, labels, shift=True),
    "f_cross_entropy": _reference,
}


def saved_bytes(loss_fn, logits: torch.Tensor, labels: torch.Tensor) -> int:
    """Bytes the loss's autograd graph saves for its backward, the logits themselves excluded."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() != logits.untyped_storage().data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(logits, labels)
    return sum(saved.values())


def run(batch: int, seq: int, vocab: int, rounds: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=generator).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)

    def step(loss_fn):
        def one() -> float:
            logits.grad = None
            loss = loss_fn(logits, labels).sum()
            loss.backward()
            return float(loss)

        return one

    variants = {name: Variant(name, step=step(fn)) for name, fn in LOSSES.items()}
    _timing.interleaved(variants, rounds, warmup=1)
    summary = {name: _timing.timing_summary(v) for name, v in variants.items()}
    for name, fn in LOSSES.items():
        summary[name]["saved_bytes"] = saved_bytes(fn, logits, labels)
    return {
        "shape": {"batch": batch, "seq": seq, "vocab": vocab},
        "variants": summary,
        "ours_over_f_cross_entropy": _timing.paired_ratios(
            variants["ours"].times, variants["f_cross_entropy"].times
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    results = [run(args.batch, seq, args.vocab, args.rounds) for seq in args.seq_lens]
    for r in results:
        ratio = r["ours_over_f_cross_entropy"]
        print(
            f"T {r['shape']['seq']}: ours {r['variants']['ours']['min_s']:.3f} s, F.cross_entropy "
            f"{r['variants']['f_cross_entropy']['min_s']:.3f} s (paired {ratio['paired_median']:.2f}); saved "
            f"{r['variants']['ours']['saved_bytes'] / 2**20:.1f} vs "
            f"{r['variants']['f_cross_entropy']['saved_bytes'] / 2**20:.1f} MiB"
        )
    _timing.write_result(
        args.out, {"benchmark": "token_loss", "environment": _timing.environment(), "results": results}
    )


if __name__ == "__main__":
    main()
