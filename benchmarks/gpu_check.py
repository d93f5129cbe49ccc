"""One command on one GPU: CUDA exactness against brute force, and peak memory / step time at Llama shapes.

Sections (each in its own try/except: a failure is recorded in the JSON and the next section runs; the JSON
and the table are rewritten after every case and setting, so a run cut short keeps what it measured):

1. ``exactness``: a small Llama (``LlamaConfig``, random weights, GQA, ragged right-padded rows) takes one
   ``DPTrainer.train_one_step`` with σ = 0, SGD at learning rate 0 and C = half the smallest per-example norm
   (every example clipped); the released gradient (captured in the optimizer's step pre-hook) is compared with
   the brute force Σ_i min(1, C/(‖∇L_i‖ + 1e-6)) ∇L_i / B̄, one backward per example on a float64 copy of the
   model on the same device (tests/oracle.py, the exactness tests' oracle). For fp32, ``bf16=True`` (autocast,
   fp32 weights) and ``fp16=True`` (autocast with hf_dp's fixed loss scale ``dp_fp16_loss_scale``), activation
   checkpointing off and on, plus LoRA in fp32 and bf16 with checkpointing. Two steps each (the model does not move at lr 0): the first step checks its engine,
   the second takes the fast path (with checkpointing: the tail skip / one-pass step); both are compared.
   TF32 matmuls are switched off for this section (they would round fp32 to 10 bits). Then ``wide_factors``: a
   Linear's per-example factors in bf16 and fp16 on the device (B 4, T 256, 512 x 384): norms by the Gram and
   materialised, a cross-Gram and Σ_i c_i G_i against float64 arithmetic on the same values, within 1e-5 (on CUDA
   the Grams run as tensor-core GEMMs with float32 accumulation and output, and bf16's Σ_i c_i G_i as three of
   them on bf16 pieces of the weighted side).
2. ``performance``: a Llama (default 8 layers x 2048, intermediate 5632, 16 heads, 4 KV heads, vocab 32000,
   untied head) on B = 8 random sequences of T = 1024 tokens, bf16 autocast with fp32 weights, AdamW, for
   {full, lora (r 16, all linear layers)} x activation checkpointing {on, off}; variants ``stock``
   (``transformers.Trainer.training_step`` + ``optimizer.step()``), ``dp`` (``DPTrainer.train_one_step``,
   σ = 1, C = 1, noised and accounted), ``dp_groupwise`` (the same with clipping_groups="layer": one backward),
   ``dp_chained`` (the same with the weighted pass's checkpointed layers
   back-propagated as one chain instead of one by one, hf_dp/clipping/layerwise.py) and ``opacus`` (Opacus 1.6 ghost clipping,
   ``make_private(..., grad_sample_mode="ghost")`` + ``DPTensorFastGradientClipping``; skipped with its reason
   if Opacus does not import). All variants of a setting live together: each is built and warmed up (2 steps) in turn, then
   ``--rounds`` rounds time one step of each in rotated order (``torch.cuda.synchronize`` around each step;
   benchmarks/_timing.py). The Llama, its LoRA, checkpointing and the variants' steps are benchmarks/_llama.py's.
   Peak memory of a variant = what it holds at rest (``memory_allocated`` after its warm-up minus before its
   build) + the most a step allocates above that (``max_memory_allocated`` - ``memory_allocated`` at the
   step's start, peak stats reset before each step), so the other variants' resident memory is not counted.
   Each variant also reports what its passes did: how many times a step the first layer's q_proj ran (2 for
   the stock checkpointed step, 3 for DP's with the layers replayed or run one by one, 4 without) and, for DP,
   whether the first step's check let the weighted pass skip the tail, how many layers the tail reaches down
   over, and whether the layers below it run one by one.
3. ``qlora``: first its exactness on the device: the exactness shape's Llama loaded as float32, nf4 and fp4
   (double quantisation, float32 compute), LLM.int8 at threshold 0 and nf4 computing in bf16, prepared as for
   QLoRA, against one backward per example on the same model (a quantised base must be within 2× the float32
   base's error), and LLM.int8 at threshold 6: one example's effect on another's logits, and the refusal. Then
   the same Llama saved in bf16 and reloaded with bitsandbytes nf4 (``BitsAndBytesConfig``,
   bf16 compute, double quantisation), ``peft.prepare_model_for_kbit_training``, LoRA on all linear layers;
   ``stock`` and ``dp``, checkpointing on and off. Skipped with its reason if bitsandbytes does not import or
   has no working backend on the device; Opacus cannot clip through 4-bit layers and is not run.
4. ``profile``: one step of ``stock`` and ``dp`` at the performance shape (full fine-tuning, checkpointing on
   and off) under ``torch.profiler``, after the warm-up: the device time of hf_dp's phases (its norm passes,
   sum passes and the noise, labelled with ``record_function``) and of the ops that take most of it.

``--smoke`` (automatic without CUDA) runs the same code at tiny shapes on the CPU, one thread, in about a minute
(memory is then not measured: ``peak_mb`` is null). Ratios: paired median over rounds of the per-round time
ratio, min / min, and peak / peak, of dp and opacus against the stock Trainer of the same setting.
``--budget-s`` (default 240 s from the start of the process) starts no setting after it, recording why.

    python -u benchmarks/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
    python benchmarks/gpu_check.py --smoke --out /tmp/gpu_check_smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_T0 = time.perf_counter()  # the run's clock starts before the imports (torch, CUDA) it pays for

# The repository root first, even when PYTHONPATH lists it after a --target folder of wheels: the script measures
# this checkout's hf_dp (and the top-level ``benchmarks`` package that Opacus installs never shadows this one).
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [_REPO_ROOT] + [p for p in sys.path if p != _REPO_ROOT]

from benchmarks import _llama, _timing  # noqa: E402  (_timing sets the offline environment first)
from benchmarks._llama import (  # noqa: E402
    CKPT_ARG,
    DATASET_BATCHES,
    MAX_GRAD_NORM,
    NOISE_MULTIPLIER,
    SEED,
    Shape,
)

# isort: split

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaForCausalLM, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402
from tests import oracle  # noqa: E402  (the brute force every exactness test compares with)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_check.json"
IGNORE_INDEX = -100
LORA_R = 16
# Relative-error tolerances of the exactness cases, as a DP correctness test would state them (the smoke test
# asserts them). fp32: the float64 brute force against float32 arithmetic (tests/test_checkpointing.py is exact
# to 1e-9 in float64; a float32 step is ~1e-6). fp16: tests/test_fp16.py allows 2e-3 (measured 3-6e-4 on tiny
# Llamas on CPU); 5e-3 leaves room for other kernels. bf16: tests/test_mixed_precision.py allows 2e-2 with bf16
# WEIGHTS (measured 0.56%); bf16 autocast with fp32 weights rounds less, 5e-2 is the issue's bound.
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-3}
# bf16/fp16 factors multiply exactly in float32; what is left is float32 summation over T·d terms (~1e-7).
WIDE_FACTORS_TOLERANCE = 1e-5
SECTIONS = ("environment", "exactness", "performance", "qlora", "profile")
PROFILE_TOP_OPS = 15


@dataclass(frozen=True)
class Config:
    device: str
    smoke: bool
    exact_shape: Shape
    exact_batch: int
    exact_seq: int
    perf_shape: Shape
    perf_batch: int
    perf_seq: int
    warmup: int
    rounds: int
    budget_s: float


def make_config(device: str, smoke: bool, args: argparse.Namespace) -> Config:
    exact = Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256)
    if smoke:
        perf = Shape(layers=2, hidden=64, intermediate=176, heads=4, kv_heads=2, vocab=512)
        return Config(
            device, True, exact, 4, 16, perf, 2, 16, warmup=1, rounds=2, budget_s=args.budget_s or 240
        )
    perf = Shape(
        layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab,
    )  # fmt: skip
    return Config(
        device,
        False,
        exact,
        8,
        64,
        perf,
        args.batch,
        args.seq,
        args.warmup,
        args.rounds,
        args.budget_s or 240,
    )


# ---- the run's record: every section, written after every cell ---------------------------------------------


class Record:
    """The JSON being built; ``save()`` rewrites it (atomically) with the table next to it as ``.md``."""

    def __init__(self, out: Path, config: Config) -> None:
        self.out, self.start = out, _T0
        self.data: dict[str, Any] = {
            "benchmark": "gpu_check",
            "mode": "smoke" if config.smoke else "full",
            "config": asdict(config) | {"tolerances": TOLERANCE, "checkpointing_argument": CKPT_ARG},
            "environment": {"error": None},
            "exactness": {"error": None, "skipped": None, "cases": {}},
            "performance": {"error": None, "skipped": None, "settings": {}},
            "qlora": {"error": None, "skipped": None, "settings": {}},
            "profile": {"error": None, "skipped": None, "settings": {}},
            "errors": [],
            "finished": False,
            "elapsed_s": 0.0,
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
            os.replace(tmp, self.out)
            self.out.with_suffix(".md").write_text(table(self.data))
        except OSError as exc:
            print(f"could not write {self.out}: {exc}", flush=True)

    def fail(self, section: str, exc: BaseException) -> None:
        traceback.print_exc()
        message = f"{type(exc).__name__}: {exc}"
        self.data[section]["error"] = message
        self.data["errors"].append({"section": section, "error": message})
        self.save()


def error_text(exc: BaseException) -> str:
    return _timing.first_line(f"{type(exc).__name__}: {exc}") or type(exc).__name__


def mb(n_bytes: float | None) -> float | None:
    return None if n_bytes is None else n_bytes / 2**20


# ---- environment ------------------------------------------------------------------------------------------


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception as exc:  # not installed, or broken: either way recorded
        return f"not importable: {error_text(exc)}"


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "accelerate": _version("accelerate"),
        "peft": _version("peft"),
        "opacus": _version("opacus"),
        "bitsandbytes": _version("bitsandbytes"),
        "hf_dp_path": str(Path(sys.modules["hf_dp"].__file__).parent),
        "git_commit": _timing.git_state(_REPO_ROOT)[0],
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["cuda_capability"] = list(torch.cuda.get_device_capability())
        env["cuda_total_memory_mb"] = mb(props.total_memory)
        env["matmul_allow_tf32_at_start"] = torch.backends.cuda.matmul.allow_tf32
    return env


# ---- models and batches -------------------------------------------------------------------------------------


def build_llama(shape: Shape, seq: int, device: str, tuning: str) -> nn.Module:
    """The seeded random Llama with fp32 weights, initialised on ``device`` (fast on a GPU); LoRA-wrapped (r 16)
    for ``lora``. Same seed, same weights in every variant."""
    return _llama.build_llama(shape, seq, device, tuning, lora_r=LORA_R)


def ragged_batch(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of ragged lengths (the first full), pad labels -100 and a few more ignored labels."""
    g = torch.Generator().manual_seed(SEED + 11)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    lengths = torch.randint(seq // 3, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[1, :3] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ---- 1. exactness ---------------------------------------------------------------------------------------------


def clipped_reference(
    model: nn.Module, batch: dict[str, torch.Tensor], max_norm_of: Callable[[list[float]], float]
) -> tuple[torch.Tensor, torch.Tensor, list[float], float]:
    """tests/oracle.py's brute force (one backward per example, each row alone, hf_dp's per-example loss) on
    ``model``, twice: unclipped for the norms, then clipped at C = ``max_norm_of(norms)``. Returns Σ_i ∇L_i and
    Σ_i min(1, C/(‖∇L_i‖ + 1e-6)) ∇L_i (float64, flattened in the model's order), the norms and C."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    unclipped, norms = oracle.per_example(model, batch, math.inf)
    norms = [float(n) for n in norms]
    max_norm = max_norm_of(norms)
    clipped, _ = oracle.per_example(model, batch, max_norm)
    flat = [torch.cat([total[n].flatten() for n in names]) for total in (unclipped, clipped)]
    return flat[0], flat[1], norms, max_norm


def exactness_case(
    config: Config, precision: str, checkpointing: bool, tuning: str, folder: str
) -> dict[str, Any]:
    device, shape = config.device, config.exact_shape
    model = build_llama(shape, config.exact_seq, device, tuning)
    batch = {
        k: v.to(device) for k, v in ragged_batch(config.exact_batch, config.exact_seq, shape.vocab).items()
    }
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    start = time.perf_counter()
    reference = copy.deepcopy(model).double()  # the brute force in float64 on the same device
    _, clipped, norms, max_norm = clipped_reference(reference, batch, lambda n: 0.5 * min(n))  # all clipped
    del reference
    brute_s = time.perf_counter() - start

    rows = _llama.token_rows(DATASET_BATCHES * config.exact_batch, config.exact_seq, shape.vocab)
    args = _llama.training_args(
        DPTrainingArguments,
        device,
        folder,
        per_device_train_batch_size=config.exact_batch,
        dp_optimizer="sgd",
        learning_rate=0.0,  # the model does not move: every step's release is compared with the same reference
        lr_scheduler_type="constant",
        noise_multiplier=0.0,
        per_sample_max_grad_norm=max_norm,
        insecure_dp_seed=SEED,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        **{CKPT_ARG: checkpointing},
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=rows)
    trainer.create_optimizer()
    _llama.prepare_like_train(trainer)
    info: dict[str, Any] = {}
    _llama.dtype_probe(trainer.model, info)
    index = {id(p): n for n, p in trainer.model.named_parameters()}
    released: list[dict[str, torch.Tensor]] = []

    def capture(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        released.append(
            {
                index[id(p)]: p.grad.detach().double().clone()
                for g in optimizer.param_groups
                for p in g["params"]
                if p.grad is not None
            }
        )

    trainer.optimizer.register_step_pre_hook(capture)
    expected = clipped / trainer.expected_batch_size
    errors, losses = [], []
    for _ in range(2):
        losses.append(trainer.train_one_step([batch]))
        _timing.synchronize(device)
        ours = torch.cat([released[-1][n].flatten() for n in names])
        errors.append(float((ours - expected).norm() / expected.norm()))
    engine = trainer.dp.engine
    return {
        "precision": precision,
        "tuning": tuning,
        "checkpointing": checkpointing,
        "checkpointing_active": _llama.is_checkpointing(trainer.model),
        "relative_error": max(errors),
        "relative_error_per_step": errors,
        "tolerance": TOLERANCE[precision],
        "within_tolerance": max(errors) <= TOLERANCE[precision],
        "max_norm": max_norm,
        "per_example_norms": norms,
        "expected_batch_size": trainer.expected_batch_size,
        "trainable_parameters": int(expected.numel()),
        "fp16_loss_scale": trainer.args.dp_fp16_loss_scale if precision == "fp16" else None,
        "nonfinite_examples": getattr(engine, "nonfinite_examples", None),
        "losses": losses,
        "brute_force_s": brute_s,
        **info,
        "error": None,
    }


EXACTNESS_CASES = [
    (precision, ckpt, "full") for precision in ("fp32", "bf16", "fp16") for ckpt in (False, True)
] + [("fp32", True, "lora"), ("bf16", True, "lora")]


def run_exactness(config: Config, record: Record) -> None:
    section = record.data["exactness"]
    tf32 = None
    if config.device == "cuda":
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for precision, ckpt, tuning in EXACTNESS_CASES:
            name = f"{tuning}-{precision}-{'ckpt' if ckpt else 'nockpt'}"
            start = time.perf_counter()
            try:
                with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
                    case = exactness_case(config, precision, ckpt, tuning, folder)
            except Exception as exc:
                traceback.print_exc()
                case = {
                    "precision": precision,
                    "tuning": tuning,
                    "checkpointing": ckpt,
                    "error": error_text(exc),
                }
            case["seconds"] = time.perf_counter() - start
            section["cases"][name] = case
            _timing.release(config.device)
            print(exactness_line(name, case), flush=True)
            done = [c for c in section["cases"].values() if not c.get("error")]
            section["all_within_tolerance"] = len(done) == len(section["cases"]) and all(
                c["within_tolerance"] for c in done
            )
            section["max_relative_error"] = {
                p: max((c["relative_error"] for c in done if c["precision"] == p), default=None)
                for p in TOLERANCE
            }
            record.save()
        section["wide_factors"] = wide_factors_check(config)
        print(f"wide factors: {section['wide_factors']}", flush=True)
        record.save()
    finally:
        if tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = tf32


def wide_factors_check(config: Config) -> dict[str, Any]:
    """The per-example arithmetic of low-precision factors (``OuterProductSum``) against float64 on the same
    values: the largest relative error of ‖G_i‖² (Gram, materialised), ⟨G_i, G'_i⟩, G_i and Σ_i c_i G_i."""
    from hf_dp.clipping.per_example import OuterProductSum
    from hf_dp.clipping.wide_gemm import wide_bmm

    batch, steps, rows, cols = (4, 256, 512, 384) if not config.smoke else (2, 16, 24, 16)
    generator = torch.Generator(device=config.device).manual_seed(SEED)
    result: dict[str, Any] = {"tolerance": WIDE_FACTORS_TOLERANCE}
    for dtype in (torch.bfloat16, torch.float16):

        def factors(size: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            shape = (batch, steps, size)
            return torch.randn(shape, generator=generator, device=config.device).to(dtype)

        part = OuterProductSum(factors(rows), factors(cols), rows)
        other = OuterProductSum(factors(rows), factors(cols), rows)
        explicit = torch.einsum("btr,btc->brc", part.left.double(), part.right.double())
        explicit_other = torch.einsum("btr,btc->brc", other.left.double(), other.right.double())
        weights = torch.rand(batch, generator=generator, device=config.device)
        pairs = {
            "gram_norm": (part.squared_norm(materialise=False), explicit.pow(2).sum(dim=(1, 2))),
            "materialised_norm": (part.squared_norm(materialise=True), explicit.pow(2).sum(dim=(1, 2))),
            "cross_gram": (part.inner(other), (explicit * explicit_other).sum(dim=(1, 2))),
            "explicit": (part.materialise(0, batch), explicit),
            "clipped_sum": (
                part.accumulate(None, weights, torch.zeros(rows, cols, device=config.device)),
                torch.einsum("b,brc->rc", weights.double(), explicit),
            ),
        }
        errors = {
            name: float((ours.double() - truth).norm() / truth.norm())
            for name, (ours, truth) in pairs.items()
        }
        probe = wide_bmm(part.left[:1].transpose(1, 2), part.right[:1])
        result[str(dtype).removeprefix("torch.")] = {
            "errors": errors,
            "output_dtype": str(probe.dtype).removeprefix("torch."),
            "within_tolerance": max(errors.values()) <= WIDE_FACTORS_TOLERANCE,
        }
    return result


# ---- 2./3. memory and time ------------------------------------------------------------------------------------


@dataclass
class Cell(_timing.Variant):
    """One variant of a setting (benchmarks/_timing.py's ``Variant``: ``step()`` runs one step and returns its
    loss; on CUDA its resident bytes and each step's transient peak) with what is read after its rounds: how many
    times the first layer's q_proj ran, and DP's privacy report and what its first-step checks left on."""

    report: Callable[[], dict[str, Any]] | None = None  # the DPTrainer's privacy_report
    weighted_pass: Callable[[], dict[str, Any]] | None = None  # what DP's first-step checks left on
    layer_runs: list[int] = field(default_factory=lambda: [0])  # forwards of the first layer's q_proj


def summary(cell: Cell) -> dict[str, Any]:
    """Peak (resident + the largest step transient), the step times and the variant's info."""
    transient = max(cell.transient) if cell.transient else None
    peak = cell.resident + transient if cell.resident is not None and transient is not None else None
    result = {
        "peak_mb": mb(peak),
        "resident_mb": mb(cell.resident),
        "step_transient_mb": mb(transient),
        **_timing.timing_summary(cell),
    }
    result["error"] = _timing.first_line(cell.error)
    return result


@dataclass(frozen=True)
class Setting:
    tuning: str  # full, lora, qlora
    checkpointing: bool
    shape: Shape
    batch: int
    seq: int

    @property
    def name(self) -> str:
        return f"{self.tuning}-bf16-{'ckpt' if self.checkpointing else 'nockpt'}-B{self.batch}-T{self.seq}"


def _cell_info(cell: Cell, model: nn.Module) -> None:
    _llama.model_info(model, cell.info)
    count_layer_runs(cell, model)


def build_stock(s: Setting, model: nn.Module, rows: list[dict], device: str) -> Cell:
    folder = tempfile.TemporaryDirectory(prefix="gpu_check_")
    args = _llama.training_args(
        TrainingArguments, device, folder.name, per_device_train_batch_size=s.batch, bf16=True,
        optim="adamw_torch", **{CKPT_ARG: s.checkpointing},
    )  # fmt: skip
    step, trainer, wrapped = _llama.stock_step(model, args, rows, s.batch, 1, device)
    cell = Cell("stock", step=step, keep=[folder, trainer])
    _cell_info(cell, wrapped)
    return cell


def build_dp(
    s: Setting, model: nn.Module, rows: list[dict], device: str, name: str = "dp", **dp_args: Any
) -> Cell:
    """DPTrainer's step (σ = 1, C = 1); ``dp_args``: more DPTrainingArguments (a variant's)."""
    folder = tempfile.TemporaryDirectory(prefix="gpu_check_")
    args = _llama.training_args(
        DPTrainingArguments, device, folder.name, per_device_train_batch_size=s.batch, bf16=True,
        optim="adamw_torch", dp_optimizer="adamw", noise_multiplier=NOISE_MULTIPLIER,
        per_sample_max_grad_norm=MAX_GRAD_NORM, insecure_dp_seed=SEED, **{CKPT_ARG: s.checkpointing}, **dp_args,
    )  # fmt: skip
    trainer, (batch,) = _llama.dp_trainer(model, args, rows, s.batch, 1, device)
    cell = Cell(name, step=lambda: trainer.train_one_step([batch]), keep=[folder, trainer])
    _cell_info(cell, trainer.model)
    strategy = trainer.dp.clipping
    cell.info["clipping_strategy"] = type(strategy).__name__ if strategy is not None else None
    cell.info["norms_in_backward"] = getattr(strategy, "norms_in_backward", None)
    cell.report = trainer.privacy_report
    cell.weighted_pass = lambda: weighted_pass(strategy)
    return cell


def weighted_pass(strategy: Any) -> dict[str, Any]:
    """What the first step's checks left on for the weighted pass: the tail skip, how many checkpointed layers
    the tail reaches down over, and whether the layers below it run one by one (None where the strategy has no
    such pass)."""
    calibration = getattr(strategy, "calibration", None)
    if calibration is None:
        return dict.fromkeys(("skips_tail", "tail_layers", "layerwise"))
    found = {key: getattr(calibration, key) for key in ("skips_tail", "tail_layers", "layerwise")}
    if not strategy.norms_in_backward:  # book-keeping's one pass: no weighted pass, no tail to skip
        found["skips_tail"] = None
    return found


def weighted_pass_text(cell: dict[str, Any]) -> str:
    """The tail skip, and how many times a step the first layer's q_proj ran: 2 in the stock checkpointed step
    (forward, recomputation), 3 in DP's with the layers replayed, 4 without."""
    runs = cell.get("layer_runs_per_step")
    text = "-" if runs is None else f"layer runs {runs:g}×"
    if cell.get("skips_tail") is not None:
        below = cell.get("tail_layers")
        reach = f"tail skipped (reaching over {below} layers)" if cell["skips_tail"] else "tail run"
        reach += ", layer by layer" if cell.get("layerwise") else ""
        text = f"{reach}; {text}"
    return text


def count_layer_runs(cell: Cell, model: nn.Module) -> None:
    """Counts the forwards of the first decoder layer's q_proj (under peft, LoRA's wrapper of it)."""
    q_proj = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))

    def counted(*_: Any) -> None:
        cell.layer_runs[0] += 1

    cell.keep.append(q_proj.register_forward_hook(counted))


def passes(cell: Cell, steps: int) -> dict[str, Any]:
    """What ``steps`` timed steps of the cell did: layer runs per step, and DP's tail skip (``weighted_pass``)."""
    report = {"layer_runs_per_step": cell.layer_runs[0] / steps if steps else None}
    return report | (cell.weighted_pass() if cell.weighted_pass is not None else {})


def build_opacus(s: Setting, model: nn.Module, rows: list[dict], device: str) -> Cell:
    step, keep = _llama.opacus_step(model, rows, s.batch, device, s.checkpointing, bf16=True)
    cell = Cell("opacus", step=step, keep=keep)
    _cell_info(cell, model)
    return cell


def build_dp_chained(s: Setting, model: nn.Module, rows: list[dict], device: str) -> Cell:
    """``dp`` with the weighted pass's checkpointed layers back-propagated as one chain (replayed) instead of one
    by one (hf_dp/clipping/layerwise.py): what the layer-by-layer pass buys, paired in the same run."""
    cell = build_dp(s, model, rows, device)
    cell.keep[1].dp.clipping.force(
        layerwise=False
    )  # the first step still checks; later steps chain the layers
    cell.name = "dp_chained"
    return cell


def build_dp_groupwise(s: Setting, model: nn.Module, rows: list[dict], device: str) -> Cell:
    """``dp`` with group-wise clipping, each transformer block, the embeddings and the head a group
    (hf_dp/clipping/groups.py): one forward and one backward per step."""
    return build_dp(s, model, rows, device, name="dp_groupwise", clipping_groups="layer")


BUILDERS = {
    "stock": build_stock,
    "dp": build_dp,
    "dp_chained": build_dp_chained,
    "dp_groupwise": build_dp_groupwise,
    "opacus": build_opacus,
}


def _opacus_missing() -> str | None:
    try:
        import opacus  # noqa: F401
    except Exception as exc:
        return f"opacus not importable: {error_text(exc)}"
    return None


def ratio(cells: dict[str, Cell], num: str, den: str) -> dict[str, Any] | None:
    if num not in cells or den not in cells:
        return None
    a, b = summary(cells[num]), summary(cells[den])
    paired = _timing.paired_ratios(cells[num].times, cells[den].times)
    return {
        "peak": a["peak_mb"] / b["peak_mb"] if a["peak_mb"] and b["peak_mb"] else None,
        "time_paired_median": paired["paired_median"] if paired else None,
        "time_min": a["min_s"] / b["min_s"] if a["min_s"] and b["min_s"] else None,
    }


def run_setting(
    s: Setting, variants: list[str], model_builder: Callable[[], nn.Module], config: Config
) -> dict[str, Any]:
    """Build and warm up each variant in turn (its resident memory measured), then time interleaved rounds."""
    device = config.device
    rows = _llama.token_rows(DATASET_BATCHES * s.batch, s.seq, s.shape.vocab)
    cells: dict[str, Cell] = {}
    skipped: dict[str, str] = {}
    for name in variants:
        if name == "opacus" and (reason := _opacus_missing()):
            skipped[name] = reason
            continue
        _timing.release(device)
        before = torch.cuda.memory_allocated() if device == "cuda" else None
        start = time.perf_counter()
        cell = _timing.build(name, lambda n=name: BUILDERS[n](s, model_builder(), rows, device), failed=Cell)
        cells[name] = cell
        for _ in range(config.warmup):
            _timing.time_step(cell, device=device, step_peak=True)
        cell.times, cell.transient, cell.layer_runs[0] = [], [], 0
        cell.info["build_and_warmup_s"] = time.perf_counter() - start
        if cell.step is not None and device == "cuda":
            _timing.release(device)
            cell.resident = torch.cuda.memory_allocated() - before
    _timing.timed_rounds(cells, config.rounds, device=device, step_peak=True)
    for cell in cells.values():
        cell.info.update(passes(cell, sum(1 for t in cell.times if t)))
    result: dict[str, Any] = {
        "setting": asdict(s),
        "variants": {name: summary(cell) for name, cell in cells.items()},
        "skipped_variants": skipped,
    }
    dp = cells.get("dp")
    if dp is not None and dp.step is not None:
        with contextlib.suppress(Exception):
            report = dp.report()
            result["dp_privacy_report"] = {
                k: v for k, v in report.items() if isinstance(v, int | float | str | bool) or v is None
            }
    result["ratios"] = {
        key: value
        for key, value in (
            ("dp_vs_stock", ratio(cells, "dp", "stock")),
            ("dp_chained_vs_stock", ratio(cells, "dp_chained", "stock")),
            ("dp_vs_dp_chained", ratio(cells, "dp", "dp_chained")),
            ("dp_groupwise_vs_stock", ratio(cells, "dp_groupwise", "stock")),
            ("opacus_vs_stock", ratio(cells, "opacus", "stock")),
            ("dp_vs_opacus", ratio(cells, "dp", "opacus")),
        )
        if value is not None
    }
    for cell in cells.values():
        cell.keep.clear()
        cell.step = cell.report = cell.weighted_pass = None
    cells.clear()
    _timing.release(device)
    return result


def over_budget(record: Record, config: Config) -> str | None:
    if record.elapsed() > config.budget_s:
        return f"skipped: time budget of {config.budget_s:.0f} s spent ({record.elapsed():.0f} s elapsed)"
    return None


def timed_setting(
    s: Setting, build: Callable[[], nn.Module], config: Config, record: Record, section: dict
) -> None:
    """Stock, DP and Opacus on one setting, interleaved; an error is recorded and the next setting runs."""
    start = time.perf_counter()
    try:
        result = run_setting(s, ["stock", "dp", "dp_chained", "dp_groupwise", "opacus"], build, config)
    except Exception as exc:
        traceback.print_exc()
        result = {"setting": asdict(s), "error": error_text(exc)}
        _timing.release(config.device)
    result["seconds"] = time.perf_counter() - start
    section["settings"][s.name] = result
    print(setting_lines(s.name, result), flush=True)
    record.save()


def run_performance(config: Config, record: Record) -> None:
    section = record.data["performance"]
    for tuning, ckpt in (("full", True), ("lora", True), ("full", False), ("lora", False)):
        s = Setting(tuning, ckpt, config.perf_shape, config.perf_batch, config.perf_seq)
        if reason := over_budget(record, config):
            section["settings"][s.name] = {"setting": asdict(s), "skipped": reason}
            record.save()
            continue
        timed_setting(
            s, lambda s=s: build_llama(s.shape, s.seq, config.device, s.tuning), config, record, section
        )


def bitsandbytes_problem(device: str) -> str | None:
    """Why 4-bit cannot run here, or None: bitsandbytes imports and quantises a small matrix on the device."""
    try:
        import bitsandbytes.functional as bnbf

        w = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
        q, state = bnbf.quantize_4bit(w, quant_type="nf4")
        back = bnbf.dequantize_4bit(q, state)
        if not torch.isfinite(back).all() or (back.float() - w.float()).norm() > 0.2 * w.float().norm():
            return "bitsandbytes nf4 round trip is wrong on this device"
    except Exception as exc:
        return f"bitsandbytes 4-bit unavailable on {device}: {error_text(exc)}"
    return None


def build_qlora(s: Setting, folder: str, device: str) -> nn.Module:
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    model = LlamaForCausalLM.from_pretrained(
        folder,
        quantization_config=quantization,
        dtype=torch.bfloat16,
        device_map={"": 0 if device == "cuda" else "cpu"},
    )
    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=s.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    quantized = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
    if quantized == 0:
        raise RuntimeError("no bitsandbytes Linear4bit layer after loading with load_in_4bit")
    torch.manual_seed(SEED)
    return get_peft_model(model, _llama.lora_config(LORA_R)).train()


# The exactness check's bases: the unquantised float32 model (the error level to meet), 4-bit nf4 / fp4 with double
# quantisation computing in float32, LLM.int8 without outlier columns, and nf4 computing in bf16 (bf16's error).
QLORA_BASES = ("fp32", "nf4", "fp4", "int8", "nf4-bf16")


def quantization_config(kind: str):
    from transformers import BitsAndBytesConfig

    if kind.startswith(("nf4", "fp4")):
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=kind[:3],
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if kind.endswith("-bf16") else torch.float32,
        )
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0 if kind == "int8-outliers" else 0.0)


def small_qlora(kind: str, folder: str, device: str) -> nn.Module:
    """The exactness shape's Llama loaded as ``kind``, prepared as for QLoRA (frozen base, non-reentrant
    checkpointing), LoRA r 4 on every linear layer with random lora_B (so lora_A has gradients too)."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    place = {"": 0 if device == "cuda" else "cpu"}
    if kind == "fp32":
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map=place)
        model.requires_grad_(False)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    else:
        model = LlamaForCausalLM.from_pretrained(
            folder, quantization_config=quantization_config(kind), dtype=torch.float32, device_map=place
        )
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    torch.manual_seed(SEED + 1)
    model = get_peft_model(model, _llama.lora_config(4))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model.train()


@contextlib.contextmanager
def checkpointing_off(model: nn.Module):
    """The brute force's forward without checkpointing (the same numbers; autograd.grad sees every gradient)."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


def released_step(
    model: nn.Module, batch: dict[str, torch.Tensor], max_norm: float, config: Config, folder: str
) -> torch.Tensor:
    """One DPTrainer step at σ = 0, SGD at learning rate 0: the released gradient × B̄ (float64, flattened)."""
    rows = _llama.token_rows(DATASET_BATCHES * config.exact_batch, config.exact_seq, config.exact_shape.vocab)
    args = _llama.training_args(
        DPTrainingArguments, config.device, folder, per_device_train_batch_size=config.exact_batch,
        dp_optimizer="sgd", learning_rate=0.0, lr_scheduler_type="constant", noise_multiplier=0.0,
        per_sample_max_grad_norm=max_norm, insecure_dp_seed=SEED,
    )  # fmt: skip
    trainer = DPTrainer(model=model, args=args, train_dataset=rows)
    trainer.create_optimizer()
    _llama.prepare_like_train(trainer)
    order = [p for p in model.parameters() if p.requires_grad]
    released: list[torch.Tensor] = []

    def capture(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        released.append(torch.cat([p.grad.detach().double().flatten() for p in order]))

    trainer.optimizer.register_step_pre_hook(capture)
    trainer.train_one_step([batch])
    _timing.synchronize(config.device)
    trainer.dp.close()
    return released[-1] * trainer.expected_batch_size


def qlora_exactness(config: Config, section: dict[str, Any]) -> None:
    """The released clipped sum of each base against the brute force on the same model, clipping inactive
    (C = 10 × the largest norm) and active (C = half the smallest): a quantised base must be within 2× the
    float32 base's error. LLM.int8 with an outlier threshold: how much one example changes another's logits,
    and DPTrainer's refusal."""
    cases = section.setdefault("exactness", {})
    device = config.device
    with tempfile.TemporaryDirectory(prefix="gpu_check_qlora_exact_") as folder:
        torch.manual_seed(SEED)
        LlamaForCausalLM(_llama.llama_config(config.exact_shape, config.exact_seq)).save_pretrained(folder)
        batch = {
            k: v.to(device)
            for k, v in ragged_batch(config.exact_batch, config.exact_seq, config.exact_shape.vocab).items()
        }
        for kind in QLORA_BASES:
            try:
                model = small_qlora(kind, folder, device)
                with checkpointing_off(model):  # the same (quantised) model, each example alone
                    unclipped, clipped, norms, active = clipped_reference(
                        model, batch, lambda n: 0.5 * min(n)
                    )
                case: dict[str, Any] = {"per_example_norms": norms}
                # C = 10 x the largest norm clips nothing: every factor is exactly 1, the sum the unclipped one
                for clipping, max_norm, expected in (
                    ("inactive", 10 * max(norms), unclipped),
                    ("active", active, clipped),
                ):
                    with tempfile.TemporaryDirectory(prefix="gpu_check_") as out:
                        ours = released_step(model, batch, max_norm, config, out)
                    case[clipping] = float((ours - expected).norm() / expected.norm())
                del model
            except Exception as exc:
                traceback.print_exc()
                case = {"error": error_text(exc)}
            _timing.release(device)
            cases[kind] = case
        reference = cases.get("fp32", {})
        for kind, case in cases.items():
            if kind in ("fp32", "nf4-bf16") or "error" in case or "error" in reference:
                continue
            case["ratio_to_fp32"] = max(case[c] / reference[c] for c in ("inactive", "active"))
            case["within_2x_fp32"] = case["ratio_to_fp32"] <= 2.0
        section["int8_outliers"] = int8_outlier_check(folder, batch, config) if "int8" in cases else None
    print(qlora_exactness_line(section), flush=True)


def int8_outlier_check(folder: str, batch: dict[str, torch.Tensor], config: Config) -> dict[str, Any]:
    """Example 1 carries an outlier token (one embedding feature √d after the norm > the 6.0 threshold) or an
    ordinary one; the relative change of example 0's logits, at threshold 6 and 0; then DPTrainer on the
    thresholded base."""
    result: dict[str, Any] = {}
    ids, other = batch["input_ids"].clone(), batch["input_ids"].clone()
    ids[0][ids[0] == 7] = 9
    ids[1, 2], other[1, 2] = 7, 8
    other[0] = ids[0]
    for kind in ("int8-outliers", "int8"):
        try:
            model = small_qlora(kind, folder, config.device).eval()
            with torch.no_grad():
                embedding = model.get_input_embeddings().weight
                embedding[7].zero_()
                embedding[7, 3] = 1.0
                a = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[0]
                b = model(input_ids=other, attention_mask=batch["attention_mask"]).logits[0]
            result[f"{kind}_change"] = float((a - b).abs().max() / b.abs().max())
            if kind == "int8-outliers":
                model.train()
                with tempfile.TemporaryDirectory(prefix="gpu_check_") as out:
                    try:
                        released_step(model, batch, 1.0, config, out)
                        result["refused"] = None
                    except Exception as exc:
                        result["refused"] = error_text(exc)
            del model
        except Exception as exc:
            traceback.print_exc()
            result[f"{kind}_error"] = error_text(exc)
        _timing.release(config.device)
    return result


def qlora_exactness_line(section: dict[str, Any]) -> str:
    parts = []
    for kind, case in section.get("exactness", {}).items():
        if "error" in case:
            parts.append(f"{kind} ERROR {case['error']}")
        else:
            ratio = f", {case['ratio_to_fp32']:.2f}x fp32" if "ratio_to_fp32" in case else ""
            parts.append(f"{kind} {case['inactive']:.2e}/{case['active']:.2e}{ratio}")
    return (
        "qlora exactness (unclipped/clipped): "
        + "; ".join(parts)
        + f"; int8 outliers: {section.get('int8_outliers')}"
    )


def run_qlora(config: Config, record: Record) -> None:
    section = record.data["qlora"]
    if reason := bitsandbytes_problem(config.device):
        section["skipped"] = reason
        record.save()
        print(f"qlora: {reason}", flush=True)
        return
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 in the exactness check
    try:
        qlora_exactness(config, section)
    except Exception as exc:
        traceback.print_exc()
        section["exactness_error"] = error_text(exc)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    record.save()
    with tempfile.TemporaryDirectory(prefix="gpu_check_qlora_") as folder:
        base = build_llama(config.perf_shape, config.perf_seq, config.device, "full")
        base.to(torch.bfloat16).save_pretrained(folder)
        del base
        _timing.release(config.device)
        for ckpt in (True, False):
            s = Setting("qlora", ckpt, config.perf_shape, config.perf_batch, config.perf_seq)
            if reason := over_budget(record, config):
                section["settings"][s.name] = {"setting": asdict(s), "skipped": reason}
                record.save()
                continue
            timed_setting(s, lambda s=s: build_qlora(s, folder, config.device), config, record, section)


# ---- 4. where the time goes ----------------------------------------------------------------------------------


@contextlib.contextmanager
def labelled_dp_phases():
    """Every norm pass, sum pass, delivery (where a sum's surrogate runs) and the noise release under a
    ``record_function`` range named after it."""
    from hf_dp import mechanism
    from hf_dp.clipping import delivery, norm_passes, sum_passes

    targets = [
        (cls, "__call__", f"hf_dp.{cls.__name__}")
        for module in (norm_passes, sum_passes, delivery)
        for cls in vars(module).values()
        if isinstance(cls, type) and cls.__module__ == module.__name__ and "__call__" in vars(cls)
    ] + [(mechanism.GaussianMechanism, "release", "hf_dp.noise")]
    originals = [(cls, name, vars(cls)[name]) for cls, name, _ in targets]

    def labelled(function: Callable, label: str) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(label):
                return function(*args, **kwargs)

        return run

    for (cls, name, label), (_, _, function) in zip(targets, originals, strict=True):
        setattr(cls, name, labelled(function, label))
    try:
        yield
    finally:
        for cls, name, function in originals:
            setattr(cls, name, function)


def profiled_step(cell: Cell, device: str) -> dict[str, Any]:
    """One step under the profiler: its wall time, hf_dp's labelled phases and the top ops by device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _timing.synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        cell.step()
        _timing.synchronize(device)
    wall = time.perf_counter() - start

    def device_ms(event: Any, own: bool) -> float:
        if device != "cuda":
            return (event.self_cpu_time_total if own else event.cpu_time_total) / 1e3
        return (event.self_device_time_total if own else event.device_time_total) / 1e3

    events = prof.key_averages()
    phases = {
        e.key: {"device_ms": device_ms(e, own=False), "cpu_ms": e.cpu_time_total / 1e3, "count": e.count}
        for e in events
        if e.key.startswith("hf_dp.")
    }
    ops = sorted((e for e in events if not e.key.startswith("hf_dp.")), key=lambda e: -device_ms(e, own=True))
    top = [
        {"op": e.key, "self_device_ms": device_ms(e, own=True), "count": e.count}
        for e in ops[:PROFILE_TOP_OPS]
    ]
    total = sum(device_ms(e, own=True) for e in ops)
    return {"wall_s": wall, "device_total_ms": total, "phases": phases, "top_ops": top}


def run_profile(config: Config, record: Record) -> None:
    section = record.data["profile"]
    for ckpt in (True,) if config.smoke else (True, False):
        s = Setting("full", ckpt, config.perf_shape, config.perf_batch, config.perf_seq)
        if reason := over_budget(record, config):
            section["settings"][s.name] = {"skipped": reason}
            record.save()
            continue
        rows = _llama.token_rows(DATASET_BATCHES * s.batch, s.seq, s.shape.vocab)
        result: dict[str, Any] = {}
        for name in ("stock", "dp"):
            _timing.release(config.device)
            try:
                with labelled_dp_phases():
                    cell = BUILDERS[name](
                        s, build_llama(s.shape, s.seq, config.device, "full"), rows, config.device
                    )
                    for _ in range(config.warmup):
                        cell.step()
                    cell.layer_runs[0] = 0
                    result[name] = profiled_step(cell, config.device)
                result[name].update(passes(cell, 1))
                cell.keep.clear()
                cell.step = cell.report = cell.weighted_pass = None
            except Exception as exc:
                traceback.print_exc()
                result[name] = {"error": error_text(exc)}
            _timing.release(config.device)
        section["settings"][s.name] = result
        print(profile_lines(s.name, result), flush=True)
        record.save()


# ---- the table --------------------------------------------------------------------------------------------------


def _f(x: Any, spec: str = ".3f") -> str:
    return "-" if not isinstance(x, int | float) or isinstance(x, bool) else format(x, spec)


def exactness_line(name: str, case: dict[str, Any]) -> str:
    if case.get("error"):
        return f"exactness {name}: ERROR {case['error']}"
    verdict = "ok" if case["within_tolerance"] else "OVER TOLERANCE"
    steps = ", ".join(format(e, ".2e") for e in case["relative_error_per_step"])
    return f"exactness {name}: relative error {steps} (tol {case['tolerance']:.0e}) {verdict}"


def setting_lines(name: str, result: dict[str, Any]) -> str:
    if result.get("skipped") or result.get("error"):
        return f"{name}: {result.get('skipped') or 'ERROR ' + str(result.get('error'))}"
    lines = [f"{name}:"]
    for v, r in result["variants"].items():
        lines.append(
            f"  {v:7s} peak {_f(r['peak_mb'], '.0f')} MB, median {_f(r['median_s'])} s, min {_f(r['min_s'])} s"
            f"; {weighted_pass_text(r)}{'  ERROR ' + r['error'] if r['error'] else ''}"
        )
    for v, why in result.get("skipped_variants", {}).items():
        lines.append(f"  {v:7s} skipped: {why}")
    for key, r in result.get("ratios", {}).items():
        lines.append(
            f"  {key}: peak {_f(r['peak'], '.2f')}, time {_f(r['time_paired_median'], '.2f')} (paired median), "
            f"{_f(r['time_min'], '.2f')} (min/min)"
        )
    return "\n".join(lines)


def profile_lines(name: str, result: dict[str, Any]) -> str:
    lines = [f"profile {name}:"]
    for variant, r in result.items():
        if r.get("error"):
            lines.append(f"  {variant}: ERROR {r['error']}")
            continue
        phases = ", ".join(f"{k.removeprefix('hf_dp.')} {v['device_ms']:.1f}" for k, v in r["phases"].items())
        lines.append(
            f"  {variant}: wall {r['wall_s'] * 1e3:.1f} ms, device {r['device_total_ms']:.1f} ms; {phases}; "
            f"{weighted_pass_text(r)}"
        )
        lines += [
            f"    {op['self_device_ms']:8.2f} ms  x{op['count']:<4d} {op['op']}" for op in r["top_ops"][:8]
        ]
    return "\n".join(lines)


def table(data: dict[str, Any]) -> str:
    env = data.get("environment", {})
    lines = [
        f"# gpu_check ({data['mode']}): {env.get('device', '?')}, torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}, opacus {env.get('opacus', '?')}, "
        f"bitsandbytes {env.get('bitsandbytes', '?')}; {data['elapsed_s']} s"
        f"{'' if data['finished'] else ' (not finished)'}",
        "",
        "## Exactness: released clipped sum vs float64 brute force (relative error)",
        "",
        "| case | step 1 | step 2 | tolerance | status |",
        "|---|---|---|---|---|",
    ]
    for name, c in data["exactness"]["cases"].items():
        if c.get("error"):
            lines.append(
                f"| {name} | - | - | {TOLERANCE.get(c.get('precision'), '-')} | error: {c['error']} |"
            )
            continue
        e = c["relative_error_per_step"]
        status = "ok" if c["within_tolerance"] else "over"
        lines.append(f"| {name} | {e[0]:.2e} | {e[-1]:.2e} | {c['tolerance']:.0e} | {status} |")
    wide = data["exactness"].get("wide_factors") or {}
    for dtype in ("bfloat16", "float16"):
        if dtype in wide:
            errors = ", ".join(f"{k} {v:.1e}" for k, v in wide[dtype]["errors"].items())
            status = "ok" if wide[dtype]["within_tolerance"] else "over"
            lines.append(
                f"| {dtype} factors ({wide[dtype]['output_dtype']} GEMM output): {errors} | | | "
                f"{wide['tolerance']:.0e} | {status} |"
            )
    for key in ("performance", "qlora"):
        section = data[key]
        lines += [
            "",
            f"## {key}: peak MB (resident + step transient) and step seconds",
            "",
            "| setting | variant | peak MB | median s | min s | first loss | vs stock: peak | time (paired) | "
            "passes | error |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        if section.get("skipped"):
            lines.append(f"| - | - | - | - | - | - | - | - | - | skipped: {section['skipped']} |")
        for name, r in section["settings"].items():
            if r.get("skipped") or r.get("error"):
                why = r.get("skipped") or r.get("error")
                lines.append(f"| {name} | - | - | - | - | - | - | - | - | {why} |")
                continue
            for v, c in r["variants"].items():
                rt = r["ratios"].get(f"{v}_vs_stock", {})
                error = (c["error"] or "").replace("|", "/")
                lines.append(
                    f"| {name} | {v} | {_f(c['peak_mb'], '.0f')} | {_f(c['median_s'])} | {_f(c['min_s'])} | "
                    f"{_f(c['first_loss'], '.4f')} | {_f(rt.get('peak'), '.2f')} | "
                    f"{_f(rt.get('time_paired_median'), '.2f')} | {weighted_pass_text(c)} | {error} |"
                )
            for v, why in r.get("skipped_variants", {}).items():
                lines.append(f"| {name} | {v} | - | - | - | - | - | - | - | skipped: {why} |")
        if section.get("error"):
            lines.append(f"| - | - | - | - | - | - | - | - | - | section error: {section['error']} |")
    qlora_exact = data["qlora"].get("exactness") or {}
    if qlora_exact:
        lines += [
            "",
            "## qlora exactness: released clipped sum vs brute force on the same model (relative error)",
            "",
            "| base | clipping inactive | every example clipped | ratio to fp32 | within 2x |",
            "|---|---|---|---|---|",
        ]
        for kind, c in qlora_exact.items():
            if "error" in c:
                lines.append(f"| {kind} | - | - | - | error: {c['error']} |")
                continue
            lines.append(
                f"| {kind} | {c['inactive']:.2e} | {c['active']:.2e} | {_f(c.get('ratio_to_fp32'), '.2f')} | "
                f"{c.get('within_2x_fp32', '-')} |"
            )
        outliers = data["qlora"].get("int8_outliers") or {}
        if outliers:
            lines.append(
                f"\nLLM.int8: example 0's logits change by {_f(outliers.get('int8-outliers_change'), '.2e')} when "
                f"example 1 carries an outlier token (threshold 6), {_f(outliers.get('int8_change'), '.2e')} at "
                f"threshold 0; DPTrainer on the thresholded base: {outliers.get('refused') or 'NOT refused'}"
            )
    profiled = data["profile"]["settings"]
    if profiled:
        lines += [
            "",
            "## profile: one step's device time (ms) by hf_dp phase, and the top ops",
            "",
            "| setting | variant | wall ms | device ms | phases (device ms, inclusive) | top ops (self device ms) |",
            "|---|---|---|---|---|---|",
        ]
        for name, result in profiled.items():
            for variant, r in result.items():
                if not isinstance(r, dict) or r.get("error") or "wall_s" not in r:
                    lines.append(f"| {name} | {variant} | - | - | - | {r} |")
                    continue
                phases = "; ".join(
                    f"{k.removeprefix('hf_dp.')} {v['device_ms']:.1f}" for k, v in r["phases"].items()
                )
                ops = "; ".join(f"{op['op']} {op['self_device_ms']:.1f}" for op in r["top_ops"][:6])
                lines.append(
                    f"| {name} | {variant} | {r['wall_s'] * 1e3:.1f} | {r['device_total_ms']:.1f} | {phases}; "
                    f"{weighted_pass_text(r)} | {ops} |"
                )
    if data["errors"]:
        lines += ["", "Section errors: " + "; ".join(f"{e['section']}: {e['error']}" for e in data["errors"])]
    return "\n".join(lines) + "\n"


# ---- entry point ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (automatic without CUDA)")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="JSON path; the table goes next to it as .md"
    )
    p.add_argument("--sections", nargs="+", choices=SECTIONS[1:], default=list(SECTIONS[1:]))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument(
        "--warmup", type=int, default=2, help="warm-up steps per variant (the first DP step checks)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=None, help="start no setting after this many seconds")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*(use_cache|insecure_dp_seed|bos_token_id|checkpointing).*")
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    config = make_config(device, not cuda, args)
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # on a few shared cores, more threads wait for each other (optimizers.py)
    try:
        return _run(args, config, device)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, config: Config, device: str) -> dict[str, Any]:
    record = Record(args.out, config)
    print(f"gpu_check: mode {record.data['mode']}, device {device}, writing {args.out}", flush=True)
    try:
        record.data["environment"].update(environment(device))
    except Exception as exc:
        record.fail("environment", exc)
    record.save()
    runners = {
        "exactness": run_exactness,
        "performance": run_performance,
        "qlora": run_qlora,
        "profile": run_profile,
    }
    for name in set(runners) - set(args.sections):
        record.data[name]["skipped"] = "not in --sections"
    for name in args.sections:
        try:
            runners[name](config, record)
        except Exception as exc:
            record.fail(name, exc)
            _timing.release(device)
    record.data["finished"] = True
    record.save()
    print("\n" + table(record.data), flush=True)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}", flush=True)
    return record.data


if __name__ == "__main__":
    main()
