"""Frozen bitsandbytes bases (QLoRA): each example's forward must stay its own, and the base must stay the one
that was loaded.

- 4-bit (``Linear4bit``, nf4 / fp4, double quantisation): the weights are dequantised per block and multiplied
  row by row, so a batch's forward is the concatenation of its examples' forwards and the clipped step is as
  exact as on an unquantised float32 model (tests/test_qlora.py). One hazard: on a CPU with AVX512-BF16,
  bitsandbytes repacks a 4-bit layer IN PLACE the first time it runs in eval mode on an input without
  gradients (an evaluation, a generation) for its CPU inference kernel, rounding the quantisation scales to
  bfloat16: the frozen base moves by ~2e-3 (relative) and every later forward, training ones included, runs
  that kernel. The engine turns the repacking off for the layers it clips through, and refuses a layer that was
  repacked before (reload the model).
- 8-bit (``Linear8bitLt``, LLM.int8): with ``llm_int8_threshold > 0`` the activation columns that exceed the
  threshold ANYWHERE in the batch are computed in full precision and the rest in int8, so one example's presence
  changes another's forward and the per-example sensitivity no longer holds: refused. With threshold 0 every
  token row is quantised on its own scale (per-example safe) and is allowed.

TRL casts the trainable parameters of a quantised model (the adapters) to bf16, its QLoRA convention: under DP
they are kept in float32, where the clipped step is as exact as on a float32 base (``bf16=True`` still runs the
forward under bf16 autocast).

A 4-bit layer that computes in bf16 (``bnb_4bit_compute_dtype``) back-propagates in bf16 though it returns
float32: the first-step checks then compare at the bf16 tolerance (checks.py), as under bf16 autocast.
"""

from __future__ import annotations

import sys

from torch import nn

from hf_dp.clipping.hooks import UnsupportedModuleError
from hf_dp.clipping.wide_gemm import LOW_PRECISION


class QuantizedBaseError(UnsupportedModuleError):
    """A quantised frozen layer that would break the per-example guarantee or exactness."""


def check_quantized_base(model: nn.Module) -> bool:
    """Refuse LLM.int8 with a positive outlier threshold and 4-bit layers already repacked for CPU inference;
    pin every other 4-bit layer to the kernel it was loaded for; the trainable parameters of a quantised model
    in float32. Returns whether a quantised layer computes in
    bf16/fp16 (a 4-bit ``compute_dtype``; LLM.int8 quantises its input from fp16): its backward rounds there
    too, though its output is cast back to float32. False without bitsandbytes layers."""
    bnb = sys.modules.get("bitsandbytes")  # a model with bitsandbytes layers has imported it
    if bnb is None:
        return False
    low_precision = quantized = False
    for name, module in model.named_modules():
        quantized |= isinstance(module, bnb.nn.Linear8bitLt | bnb.nn.Linear4bit)
        if isinstance(module, bnb.nn.Linear8bitLt):
            threshold = float(getattr(module.state, "threshold", 0.0) or 0.0)
            if threshold > 0.0:
                raise QuantizedBaseError(
                    f"{name} (bitsandbytes Linear8bitLt, llm_int8_threshold={threshold:g}) computes the activation "
                    "columns above the threshold anywhere in the batch in full precision, so one example's "
                    "presence changes another's forward and the per-example sensitivity does not hold: load "
                    "with BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0) or in 4-bit"
                )
            low_precision = True
        elif isinstance(module, bnb.nn.Linear4bit):
            state = getattr(module.weight, "quant_state", None)
            if getattr(state, "packing_format_for_cpu", False):
                raise QuantizedBaseError(
                    f"{name} (bitsandbytes Linear4bit) was repacked for bitsandbytes' CPU inference kernel by an "
                    "eval-mode forward without gradients (its scales rounded to bfloat16), so it is no longer "
                    "the base that was loaded: reload the model and build the trainer before any such forward"
                )
            module.support_avx512bf16_for_cpu = False  # no in-place repacking during or after the run
            low_precision |= getattr(module, "compute_dtype", None) in LOW_PRECISION
    if quantized:
        for param in model.parameters():
            if param.requires_grad and param.dtype in LOW_PRECISION:
                param.data = param.data.float()
    return low_precision
