"""What the benchmark scripts share: offline settings, the GPT-2 model they time, paired timing ratios.

Import it before torch / transformers: it sets the environment variables those read at import time.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from recipes.common import set_offline_defaults

set_offline_defaults()
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from transformers import GPT2Config  # noqa: E402


def gpt2_config(layers: int, width: int, heads: int, vocab: int, seq: int, tied: bool = True) -> GPT2Config:
    """A GPT-2 shape without dropout (timed steps must not depend on the dropout draw), token id 0 for all
    special tokens."""
    return GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocab,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )


def paired_ratios(times: Sequence[float | None], base: Sequence[float | None]) -> dict[str, Any] | None:
    """Time ratios of a variant to its base measured in interleaved rounds (``None``: the round failed):
    the median of per-round ratios (robust to the machine changing speed between rounds) and min / min."""
    pairs = [t / b for t, b in zip(times, base, strict=False) if t and b]
    if not pairs:
        return None
    return {
        "paired_median": statistics.median(pairs),
        "min_time": min(t for t in times if t) / min(b for b in base if b),
        "per_round": pairs,
    }
